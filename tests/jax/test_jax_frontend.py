"""The JAX frontend (examples/jax_frontend.py): a JAX MLP trains on popsim as in JAX, step by step, and JAX's
integer semantics survive the translation. Runs in the ``jax`` nox session (jax installed, no torch)."""

import pathlib
import runpy

import numpy as np
import pytest

jax = pytest.importorskip("jax")
lax = jax.lax

import popsim  # noqa: E402

FRONTEND = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "jax_frontend.py"))
TARGET = popsim.Target.small(num_tiles=16)


def test_a_jax_mlp_trains_on_popsim_as_in_jax_step_by_step():
    history = FRONTEND["train"](steps=6, target=TARGET)
    for device_loss, jax_loss, parameter_difference in history:
        assert device_loss == pytest.approx(jax_loss, rel=1e-5)
        assert parameter_difference < 1e-5
    assert history[-1][1] < history[0][1]  # it learns


def _run(fn, *args):
    graph, inputs, outputs = FRONTEND["translate"](fn, *args)
    for i, value in enumerate(outputs):
        graph.output(f"out{i}", value)
    results = popsim.compile(graph, TARGET).run({v.name: a for v, a in zip(inputs, args)})
    return [results[f"out{i}"] for i in range(len(outputs))]


def test_integer_division_and_remainder_keep_jaxs_semantics():
    a = np.array([7, -7, 7, -7, 6, -6, 0, 5], np.int32)
    b = np.array([2, 2, -2, -2, 3, 4, 3, -5], np.int32)
    quotient, remainder = _run(lambda x, y: (lax.div(x, y), lax.rem(x, y)), a, b)
    np.testing.assert_array_equal(quotient, np.asarray(lax.div(a, b)))  # truncates toward zero
    np.testing.assert_array_equal(remainder, np.asarray(lax.rem(a, b)))  # the dividend's sign


def test_float_remainder_keeps_the_dividends_sign():
    a = np.array([5.5, -5.5, 5.5, -5.5], np.float32)
    b = np.array([2.0, 2.0, -2.0, -2.0], np.float32)
    (remainder,) = _run(lambda x, y: (lax.rem(x, y),), a, b)
    np.testing.assert_allclose(remainder, np.asarray(lax.rem(a, b)))


def test_untranslated_primitives_are_all_listed_up_front():
    with pytest.raises(NotImplementedError, match="cumsum.*sort|sort.*cumsum"):
        FRONTEND["translate"](lambda x: (lax.cumsum(x), lax.sort(x)), np.ones(4, np.float32))
