"""The one place that holds the release version and each package's dependencies.

Every package's ``setup.py`` reads this file, so the four packages always share one version and pin
their siblings to exactly that version.
"""

VERSION = "0.1.0"

# Torch is declared as a range; installers put torch==2.13.0 (the CPU wheel) in place first.
TORCH = "torch>=2.1,<2.15"

_EXTERNAL = {
    "popir": ["numpy>=1.24"],
    # plotly ships the plotly.js that popsim.report bundles into its HTML reports.
    "popsim": ["numpy>=1.24", "scipy>=1.10", "plotly>=5"],
    "popdata": [TORCH, "numpy>=1.24"],
    "poptorch": [TORCH, "numpy>=1.24", "tqdm>=4.60"],
}
_SIBLINGS = {
    "popir": [],
    "popsim": ["popir"],
    "popdata": [],
    "poptorch": ["popir", "popsim", "popdata"],
}


def setup_kwargs(name):
    """Version and install requirements for package ``name``."""
    return {
        "version": VERSION,
        "install_requires": _EXTERNAL[name] + [f"{s}=={VERSION}" for s in _SIBLINGS[name]],
    }
