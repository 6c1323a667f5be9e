"""Builds popsim's Cython engine; version and dependencies come from the repository's versioning.py.

Compiler directives are set once, here. ``POPSIM_DEBUG_BUILD=1`` builds with bounds checks,
wrap-around indexing, initialised-memory checks and ``-O0 -g`` for debugging a kernel.
"""

import os
import pathlib
import runpy

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

_here = pathlib.Path(__file__).resolve().parent
_meta = runpy.run_path(str(_here.parents[1] / "versioning.py"))
_debug = os.environ.get("POPSIM_DEBUG_BUILD") == "1"

_directives = {
    "language_level": 3,
    "boundscheck": _debug,
    "wraparound": _debug,
    "initializedcheck": _debug,
    "cdivision": not _debug,
    "nonecheck": _debug,
    "embedsignature": True,
}
# OpenMP runs the independent rows of one BSP phase (a compute set's vertices, an exchange's copies) in threads.
_compile_args = (["-O0", "-g"] if _debug else ["-O3"]) + ["-fopenmp"]

_extensions = [
    Extension(
        f"popsim.{path.stem}",
        [str(path.relative_to(_here))],
        include_dirs=[numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=_compile_args,
        extra_link_args=["-fopenmp"],
    )
    for path in sorted((_here / "src" / "popsim").glob("*.pyx"))
]

setup(
    **_meta["setup_kwargs"]("popsim"),
    ext_modules=cythonize(_extensions, compiler_directives=_directives),
)
