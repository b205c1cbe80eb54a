"""The sampling step: filters, penalties, processors, per-request seeds."""

from __future__ import annotations

import pytest
import torch

from engine.compute.sampling import (
    Sampler,
    SamplingParams,
    SamplingParamsError,
    SamplingRow,
    apply_penalties,
    filter_logits,
)


def row(params: SamplingParams, prompt=(), output=()) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output))


LOGITS = torch.tensor([1.0, 3.0, 2.0, -1.0, 0.5])


def test_greedy_is_argmax_per_row():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    assert Sampler(0).sample(logits, [row(SamplingParams()), row(SamplingParams())]) == [1, 3]


def test_top_k_one_and_tiny_top_p_reduce_to_argmax():
    for params in (SamplingParams(temperature=1.0, top_k=1, seed=1), SamplingParams(temperature=5.0, top_p=1e-6, seed=2)):
        tokens = {Sampler(0).sample(LOGITS[None], [row(params, output=[0] * step)])[0] for step in range(20)}
        assert tokens == {1}


def test_filters_keep_exactly_the_expected_tokens():
    kept = lambda p: torch.isfinite(filter_logits(LOGITS, p)).nonzero().flatten().tolist()  # noqa: E731
    assert kept(SamplingParams(temperature=1.0, top_k=2)) == [1, 2]
    probs = LOGITS.softmax(-1)  # sorted: 1 (.61), 2 (.22), 0 (.08), 4 (.05), 3 (.03)
    assert kept(SamplingParams(temperature=1.0, top_p=float(probs[1] + 0.01))) == [1, 2]
    assert kept(SamplingParams(temperature=1.0, top_p=float(probs[1]))) == [1]
    assert kept(SamplingParams(temperature=1.0, min_p=float(probs[0] / probs[1]) + 0.01)) == [1, 2]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    out = apply_penalties(LOGITS, row(SamplingParams(repetition_penalty=2.0), prompt=[1], output=[3]))
    assert out.tolist() == [1.0, 1.5, 2.0, -2.0, 0.5]
    assert LOGITS.tolist() == [1.0, 3.0, 2.0, -1.0, 0.5]  # input untouched


def test_frequency_and_presence_penalties_count_output_tokens_only():
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(LOGITS, row(params, prompt=[0, 0, 0], output=[1, 1, 2]))
    assert out.tolist() == pytest.approx([1.0, 3.0 - 1.0 - 0.25, 2.0 - 0.5 - 0.25, -1.0, 0.5])


def test_logits_processor_runs_after_penalties_and_steers_greedy():
    seen = []

    def ban_one(output_ids, logits):
        seen.append(list(output_ids))
        logits = logits.clone()
        logits[1] = float("-inf")
        return logits

    params = SamplingParams(logits_processors=(ban_one,))
    assert Sampler(0).sample(LOGITS[None], [row(params, output=[4])]) == [2]
    assert seen == [[4]]


def test_seeded_draws_do_not_depend_on_the_batch():
    params = SamplingParams(temperature=3.0, seed=1234)
    vocab = torch.randn(50, generator=torch.Generator().manual_seed(0))
    alone = [Sampler(0).sample(vocab[None], [row(params, output=[0] * step)])[0] for step in range(30)]
    noisy = SamplingParams(temperature=3.0)
    batched = []
    sampler = Sampler(99)
    for step in range(30):
        logits = torch.stack([torch.randn(50), vocab, torch.randn(50)])
        rows = [row(noisy), row(params, output=[0] * step), row(SamplingParams(temperature=1.0, seed=step))]
        batched.append(sampler.sample(logits, rows)[1])
    assert alone == batched
    assert len(set(alone)) > 3  # the draws are actually random
    other = [Sampler(0).sample(vocab[None], [row(SamplingParams(temperature=3.0, seed=4321), output=[0] * s)])[0]
             for s in range(30)]
    assert other != alone


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0.0}, "top_p"),
     ({"top_k": -1}, "top_k"), ({"min_p": 2.0}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
     ({"stop": ("",)}, "stop"), ({"seed": -1}, "seed")],
)
def test_bad_params_raise_naming_the_parameter(kwargs, name):
    with pytest.raises(SamplingParamsError, match=name):
        SamplingParams(**kwargs)
