"""Test matrix. ``popir`` and ``popsim`` run in venvs without torch, proving the layering.

Every session that needs torch installs ``torch==2.13.0`` (the CPU wheel) before anything else, so no
resolver ever pulls a CUDA build.
"""

import os

import nox

nox.options.sessions = ["lint", "popir", "popsim", "jax", "popdata", "poptorch", "models", "report"]
nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True

TORCH = "torch==2.13.0"
REPORT_ARTIFACTS = "build/report-artifacts"  # the browser test's screenshots and HTML reports
TEST_DEPS = ["pytest>=7", "hypothesis>=6.80"]
BUILD_DEPS = ["setuptools>=68", "Cython>=3.0", "numpy>=1.24", "scipy>=1.10"]
ASSERT_NO_TORCH = (
    "import importlib.util, sys; "
    "sys.exit('torch must not be installed in this session' if importlib.util.find_spec('torch') else 0)"
)


def _install_layers(session, *names):
    session.install(*BUILD_DEPS)
    session.install("--no-build-isolation", *(f"packages/{name}" for name in names))


def _pytest(session, *paths):
    session.run("pytest", "-p", "no:cacheprovider", *paths, *session.posargs)


@nox.session
def lint(session):
    session.install("ruff>=0.5")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def popir(session):
    session.install(*TEST_DEPS, "numpy>=1.24")
    session.install("packages/popir")
    session.run("python", "-c", ASSERT_NO_TORCH)
    session.run("python", "-c", "import popir")
    _pytest(session, "tests/popir", "tests/reliability/popir")


@nox.session
def popsim(session):
    session.install(*TEST_DEPS)
    _install_layers(session, "popir", "popsim")
    session.run("python", "-c", ASSERT_NO_TORCH)
    _pytest(session, "tests/popsim", "tests/reliability/popsim")


@nox.session
def jax(session):
    """The JAX frontend example (examples/jax_frontend.py) checked against JAX: popir + popsim, no torch."""
    session.install(*TEST_DEPS, "jax", "jaxlib")
    _install_layers(session, "popir", "popsim")
    session.run("python", "-c", ASSERT_NO_TORCH)
    _pytest(session, "tests/jax")


@nox.session
def popdata(session):
    session.install(TORCH)
    session.install(*TEST_DEPS)
    session.install("packages/popdata")
    _pytest(session, "tests/popdata", "tests/reliability/popdata")


@nox.session
def poptorch(session):
    session.install(TORCH)
    session.install(*TEST_DEPS, "scikit-learn>=1.3")
    _install_layers(session, "popir", "popsim", "popdata", "poptorch")
    _pytest(session, "tests/poptorch", "tests/common", "tests/examples", "tests/reliability/poptorch")


@nox.session
def models(session):
    """The model zoo (tests/models): Hugging Face transformers, CNNs and RNNs against eager PyTorch."""
    session.install(TORCH)
    session.install(*TEST_DEPS, "transformers>=5")
    _install_layers(session, "popir", "popsim", "popdata", "poptorch")
    _pytest(session, "tests/models")


@nox.session
def report(session):
    """The tutorial CNN's HTML profile report in headless Chromium (Debian's chromium and chromium-driver,
    installed by .ci/install_chromium.sh; driven by Selenium). Its screenshots and HTML files, the test's
    artefacts, land in build/report-artifacts (kept after the run, ignored by git)."""
    session.run("bash", ".ci/install_chromium.sh", external=True)
    session.install(TORCH)
    session.install(*TEST_DEPS, "selenium>=4.10")
    _install_layers(session, "popir", "popsim", "popdata", "poptorch")
    artifacts = os.path.abspath(REPORT_ARTIFACTS)
    session.env["REPORT_ARTIFACTS"] = artifacts
    _pytest(session, "tests/report")
    session.log(f"report screenshots and HTML files: {artifacts}")


@nox.session(default=False)
def bench(session):
    session.install(TORCH)
    session.install("scikit-learn>=1.3", "transformers>=5")
    _install_layers(session, "popir", "popsim", "popdata", "poptorch")
    session.run("python", "bench/run_all.py", *session.posargs)
