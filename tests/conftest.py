"""Hypothesis profiles: ``ci`` (deterministic, no example database) when CI=true, else ``dev``."""

import os
import sys

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    max_examples=25,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") == "true" else "dev"))

# tests/opdb.py (the op database) is shared by the popir, popsim and poptorch suites.
sys.path.insert(0, os.path.dirname(__file__))
