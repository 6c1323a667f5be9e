"""Version and dependencies come from the repository's versioning.py (one place for all packages)."""

import pathlib
import runpy

from setuptools import setup

_meta = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[2] / "versioning.py"))
setup(**_meta["setup_kwargs"](pathlib.Path(__file__).resolve().parent.name))
