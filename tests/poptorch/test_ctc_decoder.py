"""poptorch.ctc_beam_search_decoder: PopTorch's three outputs (log-probabilities, lengths, paths), checked
against an exhaustive sum over every CTC alignment of a small input, where a wide beam is exact."""

import collections
import itertools
import math

import pytest
import torch

import poptorch


def _collapse(alignment, blank):
    merged = [label for i, label in enumerate(alignment) if i == 0 or label != alignment[i - 1]]
    return tuple(label for label in merged if label != blank)


def _exact_ranking(log_probs, blank):
    """Every label sequence's log-probability (summed over its alignments), most likely first."""
    totals = collections.defaultdict(float)
    steps, classes = log_probs.shape
    for alignment in itertools.product(range(classes), repeat=steps):
        score = sum(log_probs[t, c].item() for t, c in enumerate(alignment))
        totals[_collapse(alignment, blank)] += math.exp(score)
    return sorted(((math.log(p), seq) for seq, p in totals.items()), key=lambda item: -item[0])


@pytest.mark.parametrize("blank", [0, 2])
def test_a_wide_beam_finds_the_exact_most_likely_paths(blank):
    torch.manual_seed(3)
    log_probs = (2.0 * torch.randn(5, 3, 3)).log_softmax(2)
    lengths = torch.tensor([5, 3, 4], dtype=torch.int32)
    top_paths = 3
    scores, path_lengths, paths = poptorch.ctc_beam_search_decoder(log_probs, lengths, blank, 50, top_paths)
    assert (scores.shape, path_lengths.shape, paths.shape) == ((3, top_paths), (3, top_paths), (3, top_paths, 5))
    assert (scores.dtype, path_lengths.dtype, paths.dtype) == (torch.float32, torch.int32, torch.int32)
    for b, length in enumerate(lengths.tolist()):
        expected = _exact_ranking(log_probs[:length, b], blank)[:top_paths]
        for k, (score, sequence) in enumerate(expected):
            assert scores[b, k].item() == pytest.approx(score, abs=1e-5)
            assert path_lengths[b, k].item() == len(sequence)
            assert paths[b, k, : len(sequence)].tolist() == list(sequence)
            assert not paths[b, k, len(sequence) :].any()


def test_the_beam_keeps_a_path_greedy_decoding_misses():
    # Greedy picks the best class per step (blank, blank: the empty path, probability 0.36), but label 1
    # sums over its alignments (1 1, 1 blank, blank 1) to 0.4 * 0.4 + 0.4 * 0.6 + 0.6 * 0.4 = 0.64.
    probs = torch.tensor([[0.6, 0.4], [0.6, 0.4]]).log().reshape(2, 1, 2)
    scores, path_lengths, paths = poptorch.ctc_beam_search_decoder(probs, torch.tensor([2]), 0, 2, 2)
    torch.testing.assert_close(scores.exp(), torch.tensor([[0.64, 0.36]]))
    assert path_lengths.tolist() == [[1, 0]] and paths[0, 0].tolist() == [1, 0]


def test_paths_that_cannot_exist_have_no_probability():
    scores, path_lengths, _ = poptorch.ctc_beam_search_decoder(torch.zeros(1, 1, 2), torch.tensor([1]), 0, 4, 3)
    assert scores[0, 2].item() == -math.inf and path_lengths[0, 2].item() == 0


class _Decoding(torch.nn.Module):
    def forward(self, log_probs, lengths):
        return poptorch.ctc_beam_search_decoder(log_probs.log_softmax(2), lengths, beam_width=4)


def test_decoding_inside_a_model_runs_on_the_host_between_device_transfers():
    torch.manual_seed(0)
    log_probs, lengths = torch.randn(4, 2, 3), torch.tensor([4, 3])
    executor = poptorch.inferenceModel(_Decoding(), poptorch.Options().showCompilationProgressBar(False))
    ours, eager = executor(log_probs, lengths), _Decoding()(log_probs, lengths)
    torch.testing.assert_close(ours[0], eager[0], rtol=1e-5, atol=1e-5)
    for got, want in zip(ours[1:], eager[1:]):
        assert torch.equal(got, want)
    steps = [s["name"] for s in executor.profile.programs["inference"]["steps"] if s["kind"] == "host"]
    assert [name.split(" ")[0] for name in steps] == ["stream-out"] * 2 + ["host-call"] + ["stream-in"] * 3
    with pytest.raises(poptorch.Error, match="lengths must be from 0 to input_length"):
        executor(log_probs, torch.tensor([4, 5]))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p, n: poptorch.ctc_beam_search_decoder(p, [5, 4]), "lengths must be a torch.tensor"),
        (lambda p, n: poptorch.ctc_beam_search_decoder(p[0], n), "probs must be a float"),
        (lambda p, n: poptorch.ctc_beam_search_decoder(p, n.float()), "lengths must be an integer tensor"),
        (lambda p, n: poptorch.ctc_beam_search_decoder(p, n + 1), "lengths must be from 0 to input_length"),
        (lambda p, n: poptorch.ctc_beam_search_decoder(p, n, blank=4), "blank must be an integer from 0 to 3"),
        (lambda p, n: poptorch.ctc_beam_search_decoder(p, n, beam_width=0), "beam_width must be an integer"),
        (lambda p, n: poptorch.ctc_beam_search_decoder(p, n, 0, 2, 3), "top_paths must be an integer from 1 to 2"),
    ],
)
def test_bad_arguments_are_refused_clearly(call, message):
    with pytest.raises(poptorch.Error, match=message):
        call(torch.randn(5, 2, 4).log_softmax(2), torch.tensor([5, 4]))
