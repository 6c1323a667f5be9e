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
_package = _here / "src" / "popsim"
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
_compile_args = (["-O0", "-g"] if _debug else ["-O3"]) + ["-pthread"]

# The engine's numbers are declared once, in _opcodes.py; the Cython modules cimport them from generated files.
for _name, _text in runpy.run_path(str(_package / "_opcodes.py"))["generated_files"]().items():
    _path = _package / _name
    if not _path.exists() or _path.read_text() != _text:
        _path.write_text(_text)

_extensions = [
    Extension(
        f"popsim.{path.stem}",
        [str(path.relative_to(_here))],
        include_dirs=[numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=_compile_args,
        extra_link_args=["-pthread"],
    )
    for path in sorted(_package.glob("*.pyx"))
]

setup(
    **_meta["setup_kwargs"]("popsim"),
    ext_modules=cythonize(_extensions, compiler_directives=_directives),
)
