"""Test matrix. ``popir`` and ``popsim`` run in venvs without torch, proving the layering.

Every session that needs torch installs ``torch==2.13.0`` (the CPU wheel) before anything else, so no
resolver ever pulls a CUDA build. The ``wheels`` session builds the four packages once (popsim's Cython
engine compiles only there); the later sessions of the same run install those wheels. A session run on its
own (``nox -s popsim``) builds from source instead, so it never installs wheels left by an earlier run.
"""

import os
import pathlib
import shutil

import nox

nox.options.sessions = ["lint", "wheels", "popir", "popsim", "jax", "popdata", "poptorch", "models", "report"]
nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True

TORCH = "torch==2.13.0"
REPORT_ARTIFACTS = "build/report-artifacts"  # the browser test's screenshots and HTML reports
WHEELHOUSE = "build/wheels"
LAYERS = ("popir", "popsim", "popdata", "poptorch")
TEST_DEPS = ["pytest>=7", "hypothesis>=6.80"]
XDIST = "pytest-xdist>=3.5"
SLOWEST_SHOWN = 20  # pytest --durations: the slowest tests of each session, to keep an eye on CI time
BUILD_DEPS = ["setuptools>=68", "Cython>=3.0", "numpy>=1.24", "scipy>=1.10"]
ASSERT_NO_TORCH = (
    "import importlib.util, sys; "
    "sys.exit('torch must not be installed in this session' if importlib.util.find_spec('torch') else 0)"
)


# Package name -> the wheel the ``wheels`` session built in this nox run (empty when it did not run).
_built_wheels = {}


def _install_layers(session, *names):
    """Installs the named packages: this run's wheels if the ``wheels`` session built them, else from source
    (popsim's Cython build needs its build requirements in the venv)."""
    if _built_wheels:
        session.install(*(_built_wheels[name] for name in names))
    elif "popsim" in names:
        session.install(*BUILD_DEPS)
        session.install("--no-build-isolation", *(f"packages/{name}" for name in names))
    else:
        session.install(*(f"packages/{name}" for name in names))


def _pytest(session, *paths, dist=None):
    """Runs pytest on ``paths``; with ``dist`` (a pytest-xdist distribution mode) in one worker per core."""
    workers = []
    if dist:
        # One engine thread per worker: the engine's helper threads spin while they wait for rows, so two
        # workers' thread teams on two cores would mostly wait for each other.
        session.env["POPSIM_NUM_THREADS"] = "1"
        workers = ["-n", "auto", "--dist", dist]
    session.run("pytest", "-p", "no:cacheprovider", f"--durations={SLOWEST_SHOWN}", *workers, *paths, *session.posargs)


@nox.session
def lint(session):
    session.install("ruff>=0.5")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def wheels(session):
    """Builds the four packages' wheels into build/wheels for the later sessions of this run."""
    _built_wheels.clear()
    session.install(*BUILD_DEPS)
    wheelhouse = pathlib.Path(WHEELHOUSE).resolve()
    shutil.rmtree(wheelhouse, ignore_errors=True)
    sources = (f"packages/{name}" for name in LAYERS)
    session.run("pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheelhouse), *sources)
    built = {}
    for name in LAYERS:
        (wheel,) = wheelhouse.glob(f"{name}-*.whl")
        built[name] = str(wheel)
    _built_wheels.update(built)


@nox.session
def popir(session):
    session.install(*TEST_DEPS, "numpy>=1.24")
    _install_layers(session, "popir")
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
    _install_layers(session, "popdata")
    _pytest(session, "tests/popdata", "tests/reliability/popdata")


@nox.session
def poptorch(session):
    session.install(TORCH)
    session.install(*TEST_DEPS, XDIST, "scikit-learn>=1.3")
    _install_layers(session, "popir", "popsim", "popdata", "poptorch")
    # Whole files per worker: module-scoped fixtures (a trained pipeline, distributed runs) are built once.
    paths = ("tests/poptorch", "tests/common", "tests/examples", "tests/reliability/poptorch")
    _pytest(session, *paths, dist="loadfile")


@nox.session
def models(session):
    """The model zoo (tests/models): Hugging Face transformers, CNNs and RNNs against eager PyTorch."""
    session.install(TORCH)
    session.install(*TEST_DEPS, XDIST, "transformers>=5")
    _install_layers(session, "popir", "popsim", "popdata", "poptorch")
    _pytest(session, "tests/models", dist="load")


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
