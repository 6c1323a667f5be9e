"""What capture's bookkeeping of source files and no-grad blocks relies on: the user/library verdict of a
source file is remembered per absolute path and per set of excluded fragments (a relative path is resolved
afresh, against the working directory of the moment), and a graph without a no-grad block keeps the code
export generated for it."""

import os

import torch
from torch import nn

from poptorch import _capture
from poptorch._capture import _detach_grad_disabled_regions, _is_user_file, _TensorOutputs, excluding_sources

_TORCH_FILE = os.path.join(os.path.dirname(torch.__file__), "nn", "functional.py")
_LIBRARY_FILE = os.path.join(os.sep, "site", "mylib", "layers.py")


def test_a_remembered_verdict_follows_the_excluded_fragments():
    assert _is_user_file(_LIBRARY_FILE)
    with excluding_sources(["mylib"]):
        assert not _is_user_file(_LIBRARY_FILE)
        assert _is_user_file(os.path.join(os.sep, "site", "other", "layers.py"))
    assert _is_user_file(_LIBRARY_FILE)  # the verdict without the fragment, kept from the first call
    assert not _is_user_file(_TORCH_FILE)
    assert not _is_user_file("<eval_with_key>.3")


def test_the_verdict_of_an_absolute_path_is_kept():
    _is_user_file(_LIBRARY_FILE)
    hits = _capture._is_user_path.cache_info().hits
    assert _is_user_file(_LIBRARY_FILE)
    assert _capture._is_user_path.cache_info().hits == hits + 1


def test_a_relative_path_is_resolved_against_the_working_directory_of_each_call(monkeypatch, tmp_path):
    relative = os.path.join("nn", "functional.py")
    monkeypatch.chdir(os.path.dirname(torch.__file__))
    assert not _is_user_file(relative)  # torch's own file, from inside torch's directory
    monkeypatch.chdir(tmp_path)
    assert _is_user_file(relative)  # the same name elsewhere is the user's


class _Plain(nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2


class _NoGrad(nn.Module):
    def forward(self, x):
        with torch.no_grad():
            y = x * 3
        return torch.relu(x) + y


def _program(model):
    return torch.export.export(_TensorOutputs(model), (torch.randn(2, 3),), strict=False)


def test_a_graph_without_a_no_grad_block_keeps_its_generated_code():
    program = _program(_Plain())
    forward = type(program.graph_module).forward
    _detach_grad_disabled_regions(program)
    assert type(program.graph_module).forward is forward


def test_a_no_grad_block_is_still_inlined_and_detached():
    program = _program(_NoGrad())
    hop = torch.ops.higher_order.wrap_with_set_grad_enabled
    _detach_grad_disabled_regions(program)
    targets = [n.target for n in program.graph_module.graph.nodes]
    assert hop not in targets and torch.ops.aten.detach.default in targets
    assert torch.equal(program.module()(torch.ones(2, 3))[0], torch.full((2, 3), 4.0))
