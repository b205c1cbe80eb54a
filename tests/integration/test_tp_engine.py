"""A TP-2 `llm` group on the CPU with gloo, without workers: rank 0's engine in this process
(`leader.lead`), its follower a child process (`LocalRanks`). Greedy tokens equal Hugging Face
`generate` (and so TP-1), also when the prompt's pages come back from the host tier or the disk
tier after being evicted there, and after a restart that recovers the disk tier (a page corrupt
on a follower's disk tier then is a miss from that page on, computed again, the group intact); a prompt with
an image's embeddings spliced in equals a TP-1 engine and `generate` over `inputs_embeds`, and
its repeat hits its pages (another picture does not); a TP-2 prefill's
pages gathered whole feed a TP-1 decode; rank 0 never pickles; followers exit when their driver
is killed; and a killed follower fails rank 0's step within the group timeout instead of hanging.

A process holds one `torch.distributed` group at a time: the tests with groups of their own run
first, then one group with a host tier serves the rest of the module (starting ranks costs
seconds); the killed-rank test runs last and ends it. Every process a test starts, it stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing.reduction
import os
import pickle
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from engine.compute.llm.config import EngineConfig
from engine.compute.llm.engine import LLMEngine
from engine.compute.llm.transfer import KVHandoff
from engine.compute.models.loader import LoadedModel, load_builtin
from engine.compute.prefix import MultimodalItem, content_hash
from engine.compute.sampling import SamplingParams
from engine.compute.tp import TPRankError
from engine.compute.tp.cache import MirroredCache
from engine.compute.tp.leader import Leader, lead
from engine.compute.tp.local import LocalRanks
from engine.compute.tp.serve import gather_into
from engine.data.kv.disk import DiskTier
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout
from engine.data.kv.store import Capacity, KVStore, KVStoreConfig
from engine.data.kv.tier import Tier
from engine.spec.graph import RoleSpec
from tests.integration.deployments import hf_greedy, text_ids

MODEL = "tiny-llama"  # 4 query heads over 2 KV heads: one KV head per rank
PAGE = 4
NEW = 8
TIMEOUT_S = 5.0
HOST = {"page_size": PAGE, "device_pages": 24, "host_pages": 64, "max_running": 4, "tp_timeout_s": TIMEOUT_S}
"""Room for two prompts of 10 pages on the device: a third pushes the first's pages to the host."""


def role(params: dict) -> RoleSpec:
    return RoleSpec(name="lm", kind="llm", model=MODEL, tp_size=2, params=params)


@contextlib.contextmanager
def group(loaded: LoadedModel, params: dict) -> Iterator[tuple[Leader, LocalRanks]]:
    spec = role(params)
    with LocalRanks(spec) as ranks:
        leader = lead(spec, loaded, EngineConfig.from_params(params), ranks.seat)
        try:
            yield leader, ranks
        finally:
            leader.close()


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_builtin(MODEL)


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel) -> PreTrainedModel:
    return loaded.model


@pytest.fixture(scope="module")
def tp2(loaded: LoadedModel) -> Iterator[tuple[Leader, LocalRanks]]:
    with group(loaded, HOST) as both:
        yield both


def greedy(engine: LLMEngine, prompts: list[list[int]], new: int = NEW) -> list[tuple[list[int], int]]:
    """Each prompt's greedy tokens and cached prompt tokens."""
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))
    return [(list(o.output_ids), o.cached_tokens) for o in outs]


IMAGE_AT, IMAGE_ROWS = 5, 6


def image_prompt(seed: int, picture: int) -> tuple[list[int], MultimodalItem]:
    """A prompt of 4 pages and a token, whose positions 5..10 are an image item's embedding rows."""
    hidden = load_builtin(MODEL).model.config.hidden_size
    embeds = torch.randn(IMAGE_ROWS, hidden, generator=torch.Generator().manual_seed(picture))
    prompt = text_ids(seed, IMAGE_AT) + [259] * IMAGE_ROWS + text_ids(seed + 1, 4 * PAGE + 1 - IMAGE_AT - IMAGE_ROWS)
    return prompt, MultimodalItem("image", content_hash("image", embeds), IMAGE_AT, IMAGE_ROWS, embeds)


def hf_greedy_embeds(model: PreTrainedModel, prompt: list[int], item: MultimodalItem, new: int) -> list[int]:
    """Hugging Face `generate` over the prompt's token embeddings with the item's rows in place."""
    assert item.embeds is not None
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor([prompt])).clone()
        embeds[0, item.start : item.end] = item.embeds
        out = model.generate(inputs_embeds=embeds, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=new, do_sample=False)
    return out[0, -new:].tolist()


def evict_and_hit(engine: LLMEngine, reference: PreTrainedModel, tier: str, seed: int) -> None:
    """A prompt of 10 pages, two others of 10 pages that push its pages down to `tier`, then the
    first again: a prefix hit served from `tier`, with Hugging Face's tokens every time."""
    first, *others = [text_ids(seed + i, 10 * PAGE + 1) for i in range(3)]
    for prompt in (first, *others):
        ((tokens, cached),) = greedy(engine, [prompt])
        assert tokens == hf_greedy(reference, prompt, NEW) and cached == 0
    before = engine.metrics()[f"{tier}.hit_pages"]
    ((tokens, cached),) = greedy(engine, [first])
    assert tokens == hf_greedy(reference, first, NEW)
    assert cached == 10 * PAGE
    assert engine.metrics()[f"{tier}.hit_pages"] > before  # the pages came back from `tier`


def test_pages_evicted_to_the_disk_tier_hit_again_also_after_a_restart(loaded, reference, tmp_path: Path) -> None:
    # Write-through: every page is on the disk as soon as it is computed, so a restart finds them.
    params = {"page_size": PAGE, "device_pages": 24, "disk_path": str(tmp_path), "disk_pages": 64,
              "write_policy": "write_through", "max_running": 4, "tp_timeout_s": TIMEOUT_S}
    prompt = text_ids(30, 6 * PAGE + 2)
    with group(loaded, params) as (leader, _):
        evict_and_hit(leader.engine, reference, "disk", seed=20)
        greedy(leader.engine, [prompt])
    # A new group over the same disk slots: every rank recovered the prompt's pages.
    with group(loaded, params) as (leader, _):
        ((tokens, cached),) = greedy(leader.engine, [prompt])
        assert tokens == hf_greedy(reference, prompt, NEW)
        assert cached == 6 * PAGE


def corrupt_on_disk(directory: Path, layout: KVLayout, capacity: int, page: PageHash) -> None:
    """Flip a byte of `page`'s bytes in the disk tier file under `directory` (no process holds it)."""
    assert DiskTier.file(directory, layout).exists()
    tier = DiskTier(layout, capacity, directory)
    try:
        offset = tier.payload_offset(page)
    finally:
        tier.close()
    with open(DiskTier.file(directory, layout), "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))


@dataclasses.dataclass(frozen=True)
class CorruptedRun:
    """A TP-2 group's clean run of `prompt` written through to its disk tiers, whose third page then
    lost a byte on rank 1's disk (rank 0's stays intact; tiny-llama at TP-2: one KV head a rank, so
    both ranks' pages have rank 0's layout)."""

    params: dict
    prompt: list[int]
    clean: list[int]
    pages: list[PageHash]


def corrupted_after_a_clean_run(loaded: LoadedModel, tmp_path: Path, seed: int) -> CorruptedRun:
    params = {"page_size": PAGE, "device_pages": 24, "disk_path": str(tmp_path), "disk_pages": 64,
              "write_policy": "write_through", "max_running": 4, "tp_timeout_s": TIMEOUT_S}
    prompt = text_ids(seed, 6 * PAGE + 2)
    with group(loaded, params) as (leader, _):
        (out,) = leader.engine.generate([prompt], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        clean, pages, layout = list(out.output_ids), [PageHash(p) for p in out.kv_pages[:6]], leader.store.layout
    corrupt_on_disk(tmp_path / "rank-1" / "slot-0", layout, 64, pages[2])
    return CorruptedRun(params, prompt, clean, pages)


def test_a_page_corrupt_on_a_followers_disk_tier_is_a_miss_not_a_failed_group(loaded, reference,
                                                                               tmp_path: Path) -> None:
    run = corrupted_after_a_clean_run(loaded, tmp_path, 31)
    params, prompt, clean, pages = run.params, run.prompt, run.clean, run.pages
    assert clean == hf_greedy(reference, prompt, NEW)
    with group(loaded, params) as (leader, ranks):
        ((tokens, cached),) = greedy(leader.engine, [prompt])
        assert tokens == clean
        assert cached == 2 * PAGE  # the pages before the corrupt one; the rest are computed again
        cache = leader.engine.cache
        assert isinstance(cache, MirroredCache) and cache.corrupt_pages == 1
        assert PageHash(pages[2]) in leader.store.resident_pages()  # computed again, on every rank
        ((tokens, cached),) = greedy(leader.engine, [prompt])
        assert tokens == clean and cached == 6 * PAGE
        assert all(proc.poll() is None for proc in ranks.procs)


def test_the_group_serves_pages_from_the_disk_tier_whole_up_to_one_corrupt_on_a_follower(loaded, reference,
                                                                                           tmp_path: Path) -> None:
    """What a page request asks of the engine thread (`serve.gather_into`): pages only on the disk
    tier, read there on every rank, merged whole; a page corrupt on a follower's disk ends the run
    and is dropped on every rank, and the group goes on."""
    run = corrupted_after_a_clean_run(loaded, tmp_path, 32)
    params, prompt, clean, pages = run.params, run.prompt, run.clean, run.pages
    local = LLMEngine(loaded, EngineConfig(page_size=PAGE))
    try:
        local.generate([prompt], SamplingParams(max_new_tokens=1))
        expected = torch.stack([local.store.get(p) for p in pages[:2]])
    finally:
        local.close()
    with group(loaded, params) as (leader, ranks):
        assert all(leader.store.tiers_of(p) == (Tier.DISK,) for p in pages)  # recovered, on the disk only
        whole = KVStore(KVStoreConfig(layout=leader.whole, device_capacity=Capacity(pages=8), device="cpu"))
        try:
            assert gather_into(leader.engine, whole, pages) == 2
            # Up to float summation order: the group adds its ranks' partial sums in another order.
            torch.testing.assert_close(torch.stack([whole.get(p) for p in pages[:2]]), expected,
                                       rtol=1e-5, atol=1e-5)
        finally:
            whole.close()
        cache = leader.engine.cache
        assert isinstance(cache, MirroredCache) and cache.corrupt_pages == 1
        assert pages[2] not in leader.store.resident_pages() and pages[1] in leader.store.resident_pages()
        ((tokens, cached),) = greedy(leader.engine, [prompt])
        assert tokens == clean == hf_greedy(reference, prompt, NEW)
        assert cached == 2 * PAGE
        assert all(proc.poll() is None for proc in ranks.procs)


def test_rank_0_never_pickles(monkeypatch, loaded, reference) -> None:
    """A whole TP-2 group's life (start, generate, gather a handoff, stop) with every pickle entry
    point of rank 0's process raising."""

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used on the TP path")

    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(multiprocessing.reduction.ForkingPickler, "dumps", refuse)
    monkeypatch.setattr(multiprocessing.reduction.ForkingPickler, "loads", refuse)
    monkeypatch.setattr(multiprocessing.reduction, "dump", refuse)
    prompt = text_ids(50, 11)
    pictured, item = image_prompt(52, picture=3)
    with group(loaded, {"page_size": PAGE, "tp_timeout_s": TIMEOUT_S}) as (leader, ranks):
        assert greedy(leader.engine, [prompt])[0][0] == hf_greedy(reference, prompt, NEW)
        ((tokens, _),) = greedy_items(leader.engine, pictured, item)  # embedding rows on the link too
        assert tokens == hf_greedy_embeds(reference, pictured, item, NEW)
        (out,) = leader.engine.generate([prompt], SamplingParams(max_new_tokens=2), prefill_only=True)
        assert out.handoff is not None
        pages, tail = leader.forward.gather(leader.store, out.handoff.page_hashes, out.handoff.tail, 2)
        assert pages is not None and tail is not None and pages.shape[-2] == 2
        leader.engine.release_handoff(out.handoff.handoff_id)
    assert all(proc.poll() is not None for proc in ranks.procs)


def test_tp2_greedy_tokens_equal_hf_generate(tp2, reference) -> None:
    leader, _ = tp2
    prompts = [text_ids(1, 3), text_ids(2, 17), text_ids(3, 30)]
    assert leader.engine.layout.num_kv_heads == 1  # rank 0's pages hold its head only
    got = greedy(leader.engine, prompts)
    assert [tokens for tokens, _ in got] == [hf_greedy(reference, p, NEW) for p in prompts]


def greedy_items(engine: LLMEngine, prompt: list[int], item: MultimodalItem) -> list[tuple[list[int], int]]:
    outs = engine.generate([prompt], SamplingParams(max_new_tokens=NEW, ignore_eos=True), mm_items=[item])
    return [(list(o.output_ids), o.cached_tokens) for o in outs]


def test_a_tp2_image_prompt_equals_tp1_and_its_repeat_hits_its_pages(tp2, loaded, reference) -> None:
    leader, _ = tp2
    prompt, item = image_prompt(70, picture=1)
    expected = hf_greedy_embeds(reference, prompt, item, NEW)
    assert expected != hf_greedy(reference, prompt, NEW)  # the picture matters
    tp1 = LLMEngine(loaded, EngineConfig(page_size=PAGE))
    try:
        assert greedy_items(tp1, prompt, item) == [(expected, 0)]
    finally:
        tp1.close()
    assert greedy_items(leader.engine, prompt, item) == [(expected, 0)]
    # The repeat finds every full page, the picture's included; another picture only the page before it.
    assert greedy_items(leader.engine, prompt, item) == [(expected, 4 * PAGE)]
    _, other = image_prompt(70, picture=2)
    ((tokens, cached),) = greedy_items(leader.engine, prompt, other)
    assert cached == PAGE and tokens == hf_greedy_embeds(reference, prompt, other, NEW)


def test_pages_evicted_to_the_host_tier_hit_again(tp2, reference) -> None:
    evict_and_hit(tp2[0].engine, reference, "host", seed=10)


def test_a_tp2_prefill_gathered_whole_feeds_a_tp1_decode(tp2, loaded, reference) -> None:
    leader, _ = tp2
    prompt = text_ids(40, 4 * PAGE + 3)
    (out,) = leader.engine.generate([prompt], SamplingParams(max_new_tokens=NEW, ignore_eos=True),
                                    prefill_only=True)
    handoff = out.handoff
    assert handoff is not None and len(handoff.page_hashes) == 4 and handoff.tail_len == 3
    pages, tail = leader.forward.gather(leader.store, handoff.page_hashes, handoff.tail, 2)
    leader.engine.release_handoff(handoff.handoff_id)
    assert pages is not None and tail is not None
    decode = LLMEngine(loaded, EngineConfig(page_size=PAGE))
    try:
        (local,) = decode.generate([prompt], SamplingParams(max_new_tokens=NEW, ignore_eos=True), prefill_only=True)
        assert local.handoff is not None
        # The whole model's KV as a TP-1 engine computes it (up to float summation order).
        torch.testing.assert_close(pages, torch.stack([decode.store.get(p) for p in handoff.page_hashes]),
                                   rtol=0, atol=1e-5)
        decode.release_handoff(local.handoff.handoff_id)
        for page in handoff.page_hashes:
            decode.store.remove(page)
        decode.store.put_many(list(handoff.page_hashes), pages)
        whole = KVHandoff(handoff_id="h1", model_id=handoff.model_id, layout=decode.layout.to_dict(),
                          tenant_salt=handoff.tenant_salt, prompt_ids=handoff.prompt_ids, key_ids=handoff.key_ids,
                          page_hashes=handoff.page_hashes, tail_len=handoff.tail_len, tail=tail,
                          first_token=handoff.first_token)
        rid = decode.add_request(params=SamplingParams(max_new_tokens=NEW, ignore_eos=True), handoff=whole)
        (done,) = decode.run_until_finished([rid])
    finally:
        decode.close()
    assert done.error is None and list(done.output_ids) == hf_greedy(reference, prompt, NEW)


DRIVER = """
import json, sys
from engine.compute.llm.config import EngineConfig
from engine.compute.models.loader import load_builtin
from engine.compute.tp.leader import lead
from engine.compute.tp.local import LocalRanks
from engine.data.kv.disk import DiskTier
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout
from engine.data.kv.store import Capacity, KVStore, KVStoreConfig
from engine.data.kv.tier import Tier
from engine.spec.graph import RoleSpec
role = RoleSpec(name="lm", kind="llm", model="tiny-llama", tp_size=2, params={"tp_timeout_s": 5.0})
ranks = LocalRanks(role)
leader = lead(role, load_builtin("tiny-llama"), EngineConfig(), ranks.seat)
print(json.dumps(ranks.pids), flush=True)
sys.stdin.read()
"""


def test_followers_exit_when_their_driver_is_killed() -> None:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    watches: list[int] = []
    try:
        assert driver.stdout is not None
        pids = json.loads(driver.stdout.readline())  # the group is up
        watches = [os.pidfd_open(pid) for pid in pids]
        driver.kill()
        driver.wait(10)
        for pid, fd in zip(pids, watches, strict=True):
            assert select.select([fd], [], [], 10.0)[0], f"rank {pid} outlived its driver"
    finally:
        driver.kill()
        driver.wait(10)
        for fd in watches:
            if not select.select([fd], [], [], 0)[0]:  # a rank that outlived its driver: end it
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
        for pipe in (driver.stdin, driver.stdout):
            if pipe is not None:
                pipe.close()


def test_a_killed_follower_fails_rank_0s_step_within_the_timeout(tp2) -> None:
    leader, ranks = tp2
    os.kill(ranks.pids[0], signal.SIGKILL)
    ranks.procs[0].wait(10)
    started = time.monotonic()
    with pytest.raises(TPRankError):
        leader.engine.generate([text_ids(60, 9)], SamplingParams(max_new_tokens=4))
    assert time.monotonic() - started < TIMEOUT_S + 6.0
