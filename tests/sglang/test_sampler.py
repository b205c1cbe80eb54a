"""The omniflow sampling backend, created through SGLang's registry, against our sampler directly."""

from __future__ import annotations

import torch
from sglang.srt.layers import sampler as sglang_sampler_module
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.server_args import SAMPLING_BACKEND_CHOICES

from engine.compute.sampling import Sampler, SamplingParams, SamplingRow
from engine.compute.sglang import sampler as sgl_sampler

VOCAB = 64
TOP_K_ALL = 1 << 30


def create_registered() -> sgl_sampler.OmniFlowSampler:
    """What `create_sampler("omniflow")` does once server args exist (they need a model here)."""
    sgl_sampler.register()
    assert sgl_sampler.BACKEND_NAME in SAMPLING_BACKEND_CHOICES  # --sampling-backend omniflow is accepted
    sampler = sglang_sampler_module._CUSTOM_SAMPLER_FACTORIES[sgl_sampler.BACKEND_NAME]()
    assert isinstance(sampler, sglang_sampler_module.Sampler)  # create_sampler's own check
    assert isinstance(sampler, sgl_sampler.OmniFlowSampler)
    return sampler


def batch_info(temps, top_ks, top_ps, min_ps, seeds=None) -> SamplingBatchInfo:
    return SamplingBatchInfo(
        temperatures=torch.tensor(temps, dtype=torch.float32).view(-1, 1),
        top_ps=torch.tensor(top_ps, dtype=torch.float32),
        top_ks=torch.tensor(top_ks, dtype=torch.int32),
        min_ps=torch.tensor(min_ps, dtype=torch.float32),
        is_all_greedy=all(k <= 1 for k in top_ks),
        is_any_greedy=any(k <= 1 for k in top_ks),
        need_top_p_sampling=any(p != 1.0 for p in top_ps),
        need_top_k_sampling=any(k != TOP_K_ALL for k in top_ks),
        need_min_p_sampling=any(p > 0 for p in min_ps),
        vocab_size=VOCAB,
        sampling_seed=torch.tensor(seeds, dtype=torch.int64) if seeds is not None else None,
        device="cpu",
    )


def test_registered_backend_matches_our_sampler() -> None:
    sampler = create_registered()
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    info = batch_info(
        temps=[1.0, 0.7, 1.3, 0.9],
        top_ks=[1, 20, TOP_K_ALL, 8],
        top_ps=[1.0, 0.9, 1.0, 0.8],
        min_ps=[0.0, 0.0, 0.05, 0.0],
        seeds=[11, 12, 13, 14],
    )
    positions = torch.tensor([5, 9, 17, 3])
    got = sampler(LogitsProcessorOutput(next_token_logits=logits.clone()), info, False, [], [], positions)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0), (), range(5)),
        SamplingRow(SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=12), (), range(9)),
        SamplingRow(SamplingParams(temperature=1.3, min_p=0.05, seed=13), (), range(17)),
        SamplingRow(SamplingParams(temperature=0.9, top_k=8, top_p=0.8, seed=14), (), range(3)),
    ]
    assert got.tolist() == Sampler().sample(logits, rows)
    assert got[0].item() == int(logits[0].argmax())
    # Same seeds and positions: same tokens, whatever else is in the batch.
    again = sampler(LogitsProcessorOutput(next_token_logits=logits.clone()), info, False, [], [], positions)
    assert again.tolist() == got.tolist()


def test_greedy_batch_with_logprobs() -> None:
    sampler = create_registered()
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    info = batch_info([1.0] * 3, [1] * 3, [1.0] * 3, [0.0] * 3)
    output = LogitsProcessorOutput(next_token_logits=logits.clone())
    ids = sampler(output, info, True, [2, 2, 2], [None, None, None], torch.zeros(3, dtype=torch.int64))
    assert ids.tolist() == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, ids.view(-1, 1)).view(-1)
    assert torch.allclose(output.next_token_logprobs, expected)
