"""Walk PopTorch's supported-ops list: each op's forward through inferenceModel and, where differentiable,
its gradient after one trainingModel step, against eager. All cases run bundled in one model each way (one
compile); when a bundle fails, each case runs alone to name the failing ops."""

import copy

import pytest
import torch
from op_check import assert_matches, options
from supported_ops import CASES, KNOWN_FAILURES, SUPPORTED_OPS, THIRD_PARTY

import poptorch

# The share of the list (third-party packages included) that must match eager.
REQUIRED_PASS_RATE = 0.95
CHECKED = [name for name in SUPPORTED_OPS if name in CASES and name not in KNOWN_FAILURES]


def test_every_listed_op_has_a_case_or_a_reason():
    assert len(SUPPORTED_OPS) == len(set(SUPPORTED_OPS))
    assert set(CASES) | set(THIRD_PARTY) == set(SUPPORTED_OPS)
    assert set(KNOWN_FAILURES) <= set(CASES)
    failing = len(THIRD_PARTY) + len(KNOWN_FAILURES)
    assert 1 - failing / len(SUPPORTED_OPS) >= REQUIRED_PASS_RATE


class _Forwards(torch.nn.Module):
    """The named cases' functions side by side: inputs and outputs flattened in case order."""

    def __init__(self, names):
        super().__init__()
        self.names = names
        self.fns = torch.nn.ModuleList(f if isinstance(f, torch.nn.Module) else _Fn(f) for f in self._fns())

    def _fns(self):
        return [CASES[n].fn for n in self.names]

    def forward(self, *flat):
        outputs, at = [], 0
        for name, fn in zip(self.names, self.fns):
            k = len(CASES[name].inputs)
            outputs.append(fn(*flat[at : at + k]))
            at += k
        return tuple(outputs)


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _inputs(names):
    return [t for n in names for t in CASES[n].inputs]


def _compare_forward(names, device, eager):
    for name, d, e in zip(names, device, eager, strict=True):
        if CASES[name].random:
            flat_d, flat_e = (d if isinstance(d, tuple) else (d,)), (e if isinstance(e, tuple) else (e,))
            assert [t.shape for t in flat_d] == [t.shape for t in flat_e], name
            assert all(torch.isfinite(t.float()).all() for t in flat_d), name
        else:
            assert_matches(d, e)


def _run_forward(names):
    module = _Forwards(names).eval()
    with torch.no_grad():
        eager = module(*_inputs(names))
    model = poptorch.inferenceModel(module, options())
    try:
        _compare_forward(names, model(*_inputs(names)), eager)
    finally:
        model.destroy()


class _Gradients(torch.nn.Module):
    """Each case's checked input as a parameter; one loss weighs every output element of every case."""

    def __init__(self, names):
        super().__init__()
        self.names = names
        self.fns = _Forwards(names).fns
        self.params = torch.nn.ParameterList(CASES[n].inputs[CASES[n].grad].detach().clone() for n in names)
        with torch.no_grad():
            outs = self._outputs()
        for i, out in enumerate(outs):
            self.register_buffer(f"w{i}", torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape).to(out.dtype))

    def _outputs(self):
        outs = []
        for name, fn, p in zip(self.names, self.fns, self.params):
            case = CASES[name]
            args = list(case.inputs)
            args[case.grad] = p
            out = fn(*args)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return outs

    def forward(self):
        total = sum((out * getattr(self, f"w{i}")).float().sum() for i, out in enumerate(self._outputs()))
        return poptorch.identity_loss(total, "sum")


def _run_gradient(names):
    model = _Gradients(names).train()  # as trainingModel runs it (a forward check may have left it in eval)
    eager = copy.deepcopy(model)
    eager().backward()
    before = [p.detach().clone() for p in model.params]
    training = poptorch.trainingModel(model, options(), torch.optim.SGD(model.params.parameters(), lr=1.0))
    try:
        training()
        training.copyWeightsToHost()
    finally:
        training.destroy()
    for name, b, p, e in zip(names, before, model.params, eager.params, strict=True):
        torch.testing.assert_close(b - p.detach(), e.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def _each_alone(run, names):
    failures = {}
    for name in names:
        try:
            run([name])
        except Exception as exc:  # noqa: BLE001 - any failure is reported by op name
            failures[name] = str(exc).strip().splitlines()[0][:300]
    return failures


def _check_all(run, names):
    try:
        run(names)
    except Exception as bundle_exc:  # noqa: BLE001
        failures = _each_alone(run, names)
        details = "\n".join(f"  {n}: {reason}" for n, reason in failures.items())
        raise AssertionError(f"supported ops that differ from eager ({len(failures)}):\n{details}") from bundle_exc


def test_supported_ops_forward_match_eager():
    _check_all(_run_forward, CHECKED)


def test_supported_ops_gradients_match_eager():
    _check_all(_run_gradient, [n for n in CHECKED if CASES[n].grad is not None])


@pytest.mark.parametrize("name", sorted(KNOWN_FAILURES))
def test_known_failures_still_fail(name):
    """A listed failure that starts passing must leave KNOWN_FAILURES (and the README's list)."""
    with pytest.raises(Exception):  # noqa: B017, PT011 - any failure
        _run_forward([name])
        if CASES[name].grad is not None:
            _run_gradient([name])
