"""All four packages share the one version in versioning.py and pin each other to exactly it."""

import pathlib
import runpy
from importlib.metadata import requires, version

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
META = runpy.run_path(str(ROOT / "versioning.py"))
PACKAGES = ["popir", "popsim", "popdata", "poptorch"]


@pytest.mark.parametrize("name", PACKAGES)
def test_installed_version_is_the_one_version(name):
    assert version(name) == META["VERSION"]


@pytest.mark.parametrize("name", PACKAGES)
def test_siblings_pinned_exactly(name):
    pins = [r for r in requires(name) if r.split("=")[0].split(">")[0].strip() in PACKAGES]
    assert all(r.endswith(f"=={META['VERSION']}") for r in pins), pins
    assert len(pins) == len(META["_SIBLINGS"][name])
