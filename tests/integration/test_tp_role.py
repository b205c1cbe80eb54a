"""Tensor parallelism on the CPU with gloo: a TP-2 role (two rank processes) against TP-1 in this
process — greedy tokens, agreed prefix hits, a TP-2 -> TP-1 KV pull, diffusion over reused
prompt KV — a driver that never pickles, and a killed rank failing the role's call instead
of hanging it.

One TP-2 role serves the whole module (starting ranks costs seconds); the killed-rank test
runs last and ends it.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing.reduction
import os
import pickle
import select
import signal
import subprocess
import sys
import time

import pytest
import torch

from engine.compute.diffusion import DiffusionConfig, DiffusionRunner, Prompt
from engine.compute.llm.config import EngineConfig
from engine.compute.llm.engine import LLMEngine
from engine.compute.llm.transfer import KVHandoff
from engine.compute.models.loader import load_builtin
from engine.compute.sampling import SamplingParams
from engine.compute.tp import TPRankError, merge_pages, split_page
from engine.compute.tp.role import RankSpec, TPRole

MODEL = "tiny-llama"  # 4 query heads over 2 KV heads: one KV head per rank
ENGINE = EngineConfig(page_size=4, device_pages=256, max_running=4)
DIFFUSION = DiffusionConfig(page_size=4, latent_size=8, steps=3, guidance_scale=3.0)
PROMPTS = ["Hello there, tensor parallel world!", "abc" * 11, "a third prompt, to batch"]


@pytest.fixture(scope="module")
def role():
    spec = RankSpec(model=MODEL, engine=ENGINE, diffusion=DIFFUSION, timeout_s=5.0)
    with TPRole(spec, 2) as tp:
        yield tp


@pytest.fixture(scope="module")
def loaded():
    return load_builtin(MODEL)


def _tp1_tokens(loaded, prompts, n=12) -> list[list[int]]:
    engine = LLMEngine(loaded, ENGINE)
    try:
        return [list(o.output_ids) for o in engine.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))]
    finally:
        engine.close()


def test_tp2_greedy_tokens_equal_tp1(role, loaded) -> None:
    info = role.call(("info",))
    assert [r["layout"]["num_kv_heads"] for r in info["ranks"]] == [1, 1]
    assert role.call(("generate", PROMPTS, 12)) == _tp1_tokens(loaded, PROMPTS)


def test_prefix_hit_is_agreed_by_all_ranks(role, loaded) -> None:
    prompt = ["shared prefix " * 3 + "tail one"]
    want = _tp1_tokens(loaded, prompt)
    first = role.call(("generate_stats", prompt, 12))
    again = role.call(("generate_stats", prompt, 12))
    assert first["tokens"] == again["tokens"] == want
    assert again["cached"][0] > 0
    # Rank 1 loses its pages: every rank must recompute (the smallest hit wins), in step.
    assert role.call(("drop_pages", 1)) > 0
    third = role.call(("generate_stats", prompt, 12))
    assert third == {"tokens": want, "cached": [0]}


def test_tp2_prefill_feeds_a_tp1_decode_bit_exactly(role, loaded) -> None:
    prompt = list(loaded.tokenizer("Disaggregated: prefill on TP-2, decode on TP-1.").input_ids)
    got = role.call(("prefill", prompt))
    handoff: KVHandoff = got["handoff"]
    assert handoff.page_hashes and handoff.layout["num_kv_heads"] == 1
    pages = merge_pages(got["pages"], 2)
    # Re-sharding only copies head slices: splitting again gives each rank's bytes back.
    assert all(torch.equal(a, b) for a, b in zip(split_page(pages, 2, 2), got["pages"], strict=True))
    assert torch.equal(pages, torch.cat(got["pages"], dim=-2))
    tail = merge_pages(got["tails"], 2) if handoff.tail_len else None
    decode = LLMEngine(loaded, ENGINE)
    try:
        for key, page in zip(handoff.page_hashes, pages, strict=True):
            decode.store.put(key, page)
        whole = KVHandoff(handoff_id="h1", model_id=handoff.model_id, layout=decode.layout.to_dict(),
                          tenant_salt=handoff.tenant_salt, prompt_ids=handoff.prompt_ids, key_ids=handoff.key_ids,
                          page_hashes=handoff.page_hashes, tail_len=handoff.tail_len, tail=tail,
                          first_token=handoff.first_token)
        rid = decode.add_request(params=SamplingParams(max_new_tokens=12, ignore_eos=True), handoff=whole)
        out = decode.run_until_finished([rid])[0]
        assert out.error is None and out.cached_tokens == 0
        assert decode.metrics()["llm.computed_prompt_tokens"] == 0  # nothing recomputed
    finally:
        decode.close()
    assert list(out.output_ids) == _tp1_tokens(loaded, [prompt])[0]


def test_tp2_diffusion_with_reused_prompt_kv_matches_tp1(role, loaded) -> None:
    prompt = list(range(40, 70))
    negative = list(range(90, 101))
    got = role.call(("diffuse", prompt, negative, 7, DIFFUSION.steps))
    want = DiffusionRunner(loaded, DIFFUSION).generate(Prompt.of(prompt), Prompt.of(negative), seed=7)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5


def test_the_driver_never_pickles(monkeypatch, loaded) -> None:
    """A whole TP-2 role's life (start, tensors and a KV handoff back, close) with every pickle
    entry point of the driver's process raising."""

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used on the TP driver path")

    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(multiprocessing.reduction.ForkingPickler, "dumps", refuse)
    monkeypatch.setattr(multiprocessing.reduction.ForkingPickler, "loads", refuse)
    monkeypatch.setattr(multiprocessing.reduction, "dump", refuse)
    spec = RankSpec(model=MODEL, engine=ENGINE, diffusion=DIFFUSION, timeout_s=5.0)
    with TPRole(spec, 2) as tp:
        assert tp.call(("generate", PROMPTS[:1], 4)) == _tp1_tokens(loaded, PROMPTS[:1], 4)
        got = tp.call(("prefill", list(range(3, 14))))
        assert isinstance(got["handoff"], KVHandoff) and got["handoff"].tail_len == 3
        assert [p.shape for p in got["pages"]] == [got["pages"][0].shape] * 2
        image = tp.call(("diffuse", [5, 6, 7], None, 1, 1))
        assert isinstance(image, torch.Tensor) and image.dtype == torch.float32
    assert not any(p.is_alive() for p in tp.procs)


DRIVER = """
import json, sys
from engine.compute.tp.role import RankSpec, TPRole
role = TPRole(RankSpec(model="tiny-llama", timeout_s=5.0), 2)
print(json.dumps(role.pids), flush=True)
sys.stdin.read()
"""


def _exit_watch(pid: int) -> int | None:
    """A pidfd that turns readable when `pid` exits (None: it is gone already)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def test_ranks_exit_when_their_driver_is_killed() -> None:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    watches: list[int | None] = []
    try:
        assert driver.stdout is not None
        pids = json.loads(driver.stdout.readline())  # the ranks are up
        watches = [_exit_watch(pid) for pid in pids]
        assert len(pids) == 2 and None not in watches
        driver.kill()
        driver.wait(10)
        for pid, fd in zip(pids, watches, strict=True):
            assert select.select([fd], [], [], 10.0)[0], f"rank {pid} outlived its driver"
    finally:
        driver.kill()
        driver.wait(10)
        for fd in watches:
            if fd is None:
                continue
            if not select.select([fd], [], [], 0)[0]:  # a rank that outlived its driver: end it
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
        for pipe in (driver.stdin, driver.stdout):
            if pipe is not None:
                pipe.close()


def test_a_killed_rank_fails_the_call_within_the_timeout(role) -> None:
    os.kill(role.pids[1], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(TPRankError, match=r"rank\(s\) \[1\] died|rank 0"):
        role.call(("generate", PROMPTS[:1], 4))
    assert time.monotonic() - started < role.spec.timeout_s + 6.0
    with pytest.raises(TPRankError, match="has failed"):
        role.call(("info",))
    assert not any(p.is_alive() for p in role.procs)
