"""A GraphSpec role with `tp_size = 2` on real worker processes (`LocalCluster`, gloo on the CPU).

One cluster for the module, in-process registry: role `one` (tiny-llama, TP-1, also a prefill
role), role `two` (the same model, TP-2: two rank processes per replica, rank 0 the one
endpoint) and role `decode` (TP-1, decoding TP-2 prefills). Greedy tokens of TP-2 equal those
of TP-1 and of Hugging Face `generate` (with an image item's `items`/`embeds` inputs, those of
TP-1; the repeat hits its pages), and so do prefill -> decode across TP sizes: a TP-1
prefill's pages pulled by the TP-2 ranks, each keeping its KV heads (checked bit-exact against
the bytes the prefill worker serves), and a TP-2 prefill's pages merged on its rank 0 and pulled
by a TP-1 decode (checked against a TP-1 engine's pages). A process with a key of its own gets
nothing from the TP-2 replica's link or its rank 0's transfer seat, and the worker counts it in
`plane.refused`. A killed follower rank fails the replica's in-flight node with a clear error,
and rank 0 then stops itself. The killed-rank test runs last; every process the module starts
is stopped.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable
from datetime import timedelta

import msgspec
import psutil
import pytest
import pytest_asyncio
import torch
import torch.distributed as dist
import zmq
import zmq.asyncio
from transformers import PreTrainedModel

from engine.compute.llm.config import EngineConfig
from engine.compute.llm.engine import LLMEngine
from engine.compute.models.loader import load_builtin
from engine.compute.prefix import content_hash
from engine.compute.sampling import SamplingParams
from engine.compute.tp.kv import merge_pages, pull_whole, split_page
from engine.compute.tp.link import LEADER_KEY
from engine.compute.tp.messages import TPHello
from engine.data.curve import PlaneKeys
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout
from engine.data.kv.pull import fetch_pages
from engine.data.kv.ref import KVRef
from engine.data.kv.store import Capacity, KVStore, KVStoreConfig
from engine.data.wire import PROTOCOL_VERSION, HelloRequest, ReleaseRequest
from engine.flow.dsl import Workflow
from engine.flow.remote import RemoteNodeError, WorkerLost
from engine.spec.graph import GraphSpec
from engine.worker.announce import REFUSED_METRIC
from engine.worker.launcher import LaunchError, LocalCluster, rank_worker_id
from tests.integration.deployments import Deployment, deployed, equals, hf_greedy, text_ids
from tests.integration.workerfns import wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny-llama"  # 4 query heads over 2 KV heads: one KV head per rank at TP-2
PAGE = 4
NEW = 10
HB = 0.25
TP_TIMEOUT_S = 3.0


def tp_spec() -> GraphSpec:
    """A token prompt through `llm` on TP-1 and on TP-2, and through prefill -> decode from TP-1 to TP-2,
TP-2 to TP-1 (a decode role of its own, so that it has none of the prompt's pages) and TP-2 to TP-2."""
    wf = Workflow("tp")
    params = {"page_size": PAGE, "tp_timeout_s": TP_TIMEOUT_S}
    one = wf.role("one", kind="llm", model=MODEL, params={"page_size": PAGE})
    two = wf.role("two", kind="llm", model=MODEL, tp_size=2, params=params)
    decode = wf.role("decode", kind="llm", model=MODEL, params={"page_size": PAGE})  # TP-1, computes no prompt
    tokens = wf.input("prompt", "tokens")
    gen1 = wf.node("gen1", "llm", role=one, params={"max_new_tokens": NEW})
    gen2 = wf.node("gen2", "llm", role=two, params={"max_new_tokens": NEW})
    pre = wf.node("pre", "llm.prefill", role=one, params={"max_new_tokens": NEW})
    dec = wf.node("dec", "llm.decode", role=two)
    pre2 = wf.node("pre2", "llm.prefill", role=two, params={"max_new_tokens": NEW})
    dec21 = wf.node("dec21", "llm.decode", role=decode)
    pre22 = wf.node("pre22", "llm.prefill", role=two, params={"max_new_tokens": NEW})
    dec22 = wf.node("dec22", "llm.decode", role=two)
    for node in (gen1, gen2, pre, pre2, pre22):
        wf.edge(tokens, node.inp("tokens"))
    wf.edge(pre, dec)
    wf.edge(pre2, dec21)
    wf.edge(pre22, dec22)
    wf.output("tp1", gen1.out("tokens"), "tokens")
    wf.output("tp2", gen2.out("tokens"), "tokens")
    wf.output("pd", dec.out("tokens"), "tokens")
    wf.output("pd_kv", dec.out("kv"), "kv")
    wf.output("pd21", dec21.out("tokens"), "tokens")
    wf.output("pd21_kv", dec21.out("kv"), "kv")
    wf.output("pd22", dec22.out("tokens"), "tokens")
    return wf.to_spec()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def deployment() -> AsyncIterator[Deployment]:
    async with deployed(tp_spec(), heartbeat_s=HB, check_processes_stop=True,
                        ready_timeout_s=120.0) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def reference() -> PreTrainedModel:
    return load_builtin(MODEL).model


async def test_a_tp2_replica_is_two_rank_processes_behind_one_endpoint(deployment: Deployment):
    two = deployment.replica("two")
    assert [r.tp_rank for r in two.processes] == [0, 1]
    assert two.ranks[0].worker_id == rank_worker_id(two.worker_id, 1)
    assert two.ranks[0].details["leader_pid"] == two.pid
    registered = await deployment.cluster.registry.workers("two")
    assert [s.info.worker_id for s in registered] == [two.worker_id]  # followers are not endpoints
    assert all(psutil.pid_exists(w.pid) for w in two.processes)


async def test_tp2_greedy_tokens_equal_tp1_and_hf_generate(deployment: Deployment, reference):
    prompts = [text_ids(1, 3), text_ids(2, 16), text_ids(3, 29)]
    runs = [await deployment.executor.submit(deployment.spec, {"prompt": p}) for p in prompts]
    results = await asyncio.wait_for(asyncio.gather(*(run.wait() for run in runs)), 120.0)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.status == "done", result.error
        expected = hf_greedy(reference, prompt, NEW)
        assert result.outputs["tp1"] == expected
        assert result.outputs["tp2"] == expected
        # TP-1 prefill -> TP-2 decode: the ranks pulled the full pages of the prompt that role two
        # did not hold yet (its gen2, pre2 and pre22 compute the same prompt at the same time, so
        # how many it held is a race; `test_a_tp1_handoff_pulled_whole_splits_by_head_bit_exact`
        # pulls every page of a handoff).
        assert result.outputs["pd"] == expected
        assert 0 <= result.outputs["pd_kv"].pulled_pages <= len(prompt) // PAGE
        # TP-2 prefill -> TP-1 decode: the TP-1 worker pulled rank 0's merged pages; and TP-2 -> TP-2.
        assert result.outputs["pd21"] == expected
        assert result.outputs["pd21_kv"].pulled_pages == len(prompt) // PAGE
        assert result.outputs["pd21_kv"].pulled_from.worker_id == deployment.replica("two").worker_id
        assert result.outputs["pd22"] == expected
    # The TP-2 decodes let go of every handoff: the prefill worker holds no page locked.
    one = deployment.replica("one").worker_id

    async def locked() -> float:
        (snapshot,) = [s for s in await deployment.cluster.registry.workers("one") if s.info.worker_id == one]
        return snapshot.load.metrics.get("kv.device.locked_pages", -1.0)

    await wait_until(lambda: equals(locked(), 0.0), 10.0, "the prefill worker to release its handoffs")
    # And the TP-2 prefill let its ranks' holds and its whole copies go.
    two = deployment.replica("two").worker_id

    async def exported() -> float:
        (snapshot,) = [s for s in await deployment.cluster.registry.workers("two") if s.info.worker_id == two]
        return snapshot.load.metrics.get("llm.exported_pages", -1.0)

    await wait_until(lambda: equals(exported(), 0.0), 10.0, "the TP-2 prefill to drop its exported pages")


async def test_tp2_text_prompt_streams_like_tp1(deployment: Deployment):
    params = {"max_new_tokens": 6, "temperature": 0.8, "seed": 7}
    one = await deployment.execute("one", {"prompt": "tensor parallel"}, ("text", "tokens"), params)
    two = await deployment.execute("two", {"prompt": "tensor parallel"}, ("text", "tokens"), params)
    assert two == one


async def test_a_tp2_image_prompt_equals_tp1_and_its_repeat_hits_its_pages(deployment: Deployment):
    """An `llm` node with `items`/`embeds` inputs (an encoder's outputs) on TP-2 and on TP-1: the
    item spliced at its marker in the text prompt; the repeat on TP-2 finds every full page."""
    embeds = torch.randn(6, load_builtin(MODEL).model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    item = {"kind": "image", "hash": content_hash("image", embeds), "length": 6, "hidden": embeds.shape[1]}
    inputs = {"prompt": "a picture: <|image|> shows", "items": item, "embeds": embeds}
    params = {"max_new_tokens": NEW, "ignore_eos": True}
    two = await deployment.execute("two", inputs, ("tokens", "usage"), params)
    one = await deployment.execute("one", inputs, ("tokens", "usage"), params)
    plain = await deployment.execute("one", {"prompt": "a picture: <|image|> shows"}, ("tokens",), params)
    assert two["tokens"] == one["tokens"] != plain["tokens"]
    prompt_tokens = two["usage"]["prompt_tokens"]
    assert prompt_tokens == one["usage"]["prompt_tokens"] > 6 and two["usage"]["cached_tokens"] == 0
    again = await deployment.execute("two", inputs, ("tokens", "usage"), params)
    assert again["tokens"] == one["tokens"]
    assert again["usage"]["cached_tokens"] == (prompt_tokens - 1) // PAGE * PAGE


async def test_a_tp2_session_with_a_stale_copy_is_replaced_on_every_rank(deployment: Deployment, reference):
    """The client's history holds more turns than the ranks' copy (the session moved away and
    back): every rank closes its copy and reopens it with the history."""
    first, second, third = text_ids(4, 9), text_ids(5, 6), text_ids(6, 5)
    params = {"max_new_tokens": NEW, "session": "tp-moved"}
    out1 = (await deployment.execute("two", {"tokens": first}, ("tokens",), params))["tokens"]
    assert out1 == hf_greedy(reference, first, NEW)
    history = first + out1 + second + hf_greedy(reference, first + out1 + second, NEW)  # a turn served elsewhere
    resumed = {**params, "session_history": history, "session_turns": 2}
    out3 = (await deployment.execute("two", {"tokens": third}, ("tokens",), resumed))["tokens"]
    assert out3 == hf_greedy(reference, history + third, NEW)


async def test_a_tp1_handoff_pulled_whole_splits_by_head_bit_exact(deployment: Deployment):
    """What rank 0 of the TP-2 role does with a decode's handoff (`pull_whole`, then `split_page`),
    against the real TP-1 prefill worker: split and merged again, the pages and the partial last
    page are the holder's bytes, and each rank's shard is its KV head."""
    prompt = text_ids(5, 4 * PAGE + 3)
    out = await deployment.execute("one", {"tokens": prompt}, ("kv",), {"max_new_tokens": NEW})
    ref = out["kv"]
    assert isinstance(ref, KVRef) and ref.hold is not None and ref.hold.token is not None and ref.holder is not None
    hold = ref.hold.token
    whole = KVLayout(**ref.layout)
    pages = [PageHash(p) for p in ref.page_hashes]
    assert len(pages) == 4 and ref.hold.tail_len == 3

    def pull_all() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        holder = KVStore(KVStoreConfig(layout=whole, device_capacity=Capacity(pages=8), device="cpu"))
        try:
            assert len(fetch_pages(holder, deployment.peer, ref.holder.address, pages, 10.0).pages) == 4
            served = torch.stack([holder.get(p) for p in pages])
            pulled = torch.stack(pull_whole(deployment.peer, ref.holder.address, pages, whole, 10.0))
            return served, pulled, deployment.peer.pull(hold, 10.0).torch().clone()
        finally:
            holder.close()

    try:
        served, pulled, tail = await asyncio.to_thread(pull_all)
    finally:
        # Let the prefill worker go of the handoff (nobody decodes it).
        await asyncio.to_thread(deployment.peer.client.call, hold.owner,
                                lambda rid: ReleaseRequest(rid, hold.id), 5.0)
    assert torch.equal(pulled, served)
    for data in (pulled, tail):
        shards = split_page(data, whole.num_kv_heads, 2)
        assert [s.shape[-2] for s in shards] == [1, 1]
        assert all(torch.equal(shard, data[..., r : r + 1, :]) for r, shard in enumerate(shards))
        assert torch.equal(merge_pages(shards, whole.num_kv_heads), data)


async def test_a_tp2_prefill_serves_whole_pages_matching_tp1(deployment: Deployment):
    """The pages a TP-2 prefill serves are its ranks' heads merged: the whole model's KV, as a TP-1
    engine computes it (up to float summation order) and in the layout a TP-1 decode reads."""
    prompt = text_ids(9, 3 * PAGE + 2)
    out = await deployment.execute("two", {"tokens": prompt}, ("kv",), {"max_new_tokens": NEW})
    ref = out["kv"]
    assert isinstance(ref, KVRef) and ref.hold is not None and ref.hold.token is not None and ref.holder is not None
    hold = ref.hold.token
    whole = KVLayout(**ref.layout)
    assert whole.num_kv_heads == 2 and len(ref.page_hashes) == 3 and ref.hold.tail_len == 2
    pages = [PageHash(p) for p in ref.page_hashes]

    def fetch() -> tuple[torch.Tensor, torch.Tensor]:
        store = KVStore(KVStoreConfig(layout=whole, device_capacity=Capacity(pages=4), device="cpu"))
        try:
            assert len(fetch_pages(store, deployment.peer, ref.holder.address, pages, 10.0).pages) == 3
            return torch.stack([store.get(p) for p in pages]), deployment.peer.pull(hold, 10.0).torch().clone()
        finally:
            store.close()

    try:
        served, tail = await asyncio.to_thread(fetch)
    finally:
        await asyncio.to_thread(deployment.peer.client.call, hold.owner,
                                lambda rid: ReleaseRequest(rid, hold.id), 5.0)
    engine = LLMEngine(load_builtin(MODEL), EngineConfig(page_size=PAGE))
    try:
        (local,) = engine.generate([prompt], SamplingParams(max_new_tokens=NEW), prefill_only=True)
        handoff = local.handoff
        assert handoff is not None and list(handoff.page_hashes) == pages
        expected = torch.stack([engine.store.get(p) for p in pages])
        torch.testing.assert_close(served, expected, rtol=0, atol=1e-5)
        tail_len = ref.hold.tail_len
        torch.testing.assert_close(tail[..., :tail_len, :, :], handoff.tail[..., :tail_len, :, :],
                                   rtol=0, atol=1e-5)
        engine.release_handoff(handoff.handoff_id)
    finally:
        engine.close()


async def refusals(deployment: Deployment, role: str) -> float:
    """The `plane.refused` metric the role's one replica last reported (its first report once it came)."""
    worker_id = deployment.replica(role).worker_id

    async def reported() -> float | None:
        (snapshot,) = [s for s in await deployment.cluster.registry.workers(role) if s.info.worker_id == worker_id]
        return snapshot.load.metrics.get(REFUSED_METRIC)

    count = await wait_until(lambda: _is_reported(reported()), 10.0, f"role {role!r} to report its metrics")
    return count[0]


async def _is_reported(value: Awaitable[float | None]) -> tuple[float] | None:
    got = await value
    return None if got is None else (got,)


def link_address(tp_address: str) -> str:
    """Rank 0's link, as any process that reaches the host can learn it: from the replica's
    rendezvous store (torch's TCPStore, which does not authenticate)."""
    host, _, port = tp_address.removeprefix("tcp://").rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)
    return store.get(f"omniflow/{LEADER_KEY}").decode()


async def intrude(deployment: Deployment, address: str, payload: bytes, server_key: str) -> None:
    """A process with a CURVE key of its own (it knows the plane's public key: public keys are no
    secret) says `payload` at `address` until the TP-2 worker counts one more refusal; it never
    gets an answer."""
    expected = await refusals(deployment, "two") + 1
    own = PlaneKeys.generate()
    context = zmq.asyncio.Context()
    try:
        deadline = time.monotonic() + 20.0
        while True:
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.curve_publickey, sock.curve_secretkey = own.public.encode(), own.secret.encode()
            sock.curve_serverkey = server_key.encode()
            sock.connect(address)
            try:
                await sock.send(payload)
                assert await sock.poll(300) == 0, f"{address} answered a process without the plane's key"
            finally:
                sock.close()
            # A key not authorised is refused by the ZAP handler, always counted; until the count
            # shows (the worker reports each heartbeat), the intruder knocks again.
            if await _counted(deployment, expected):
                return
            assert time.monotonic() < deadline, f"the worker never counted a refusal on {address}"
    finally:
        context.term()


async def _counted(deployment: Deployment, expected: float) -> bool:
    """Whether the TP-2 worker's reports reach `expected` refusals within a few heartbeats."""
    deadline = time.monotonic() + 4 * HB
    while time.monotonic() < deadline:
        if await refusals(deployment, "two") >= expected:
            return True
        await asyncio.sleep(HB / 5)
    return False


async def test_a_foreign_key_gets_nothing_from_a_tp_link_or_seat_and_is_counted(deployment: Deployment,
                                                                                 reference):
    """A process without the plane's key knocks at the TP-2 replica's own sockets: rank 0's link
    to its follower (a follower's hello) and rank 0's transfer seat, which serves its prefills'
    pages (a hello). Neither answers, rank 0's worker counts each in `plane.refused`, and the
    replica still serves: its link to the real follower carries a whole generation."""
    two = deployment.replica("two")
    assert two.tp_address is not None
    keys = deployment.cluster.keys
    assert keys is not None
    link = await asyncio.to_thread(link_address, two.tp_address)
    await intrude(deployment, link, msgspec.msgpack.encode(TPHello(1, os.getpid())), keys.public)
    # Rank 0's transfer seat: where its prefills' pages are served from (the kv output's holder).
    prompt = text_ids(10, 2 * PAGE + 1)
    ref = (await deployment.execute("two", {"tokens": prompt}, ("kv",), {"max_new_tokens": 2}))["kv"]
    assert isinstance(ref, KVRef) and ref.holder is not None and ref.hold is not None and ref.hold.token is not None
    hold = ref.hold.token
    await asyncio.to_thread(deployment.peer.client.call, hold.owner, lambda rid: ReleaseRequest(rid, hold.id), 5.0)
    hello = msgspec.msgpack.encode(HelloRequest(PROTOCOL_VERSION, "intruder", "127.0.0.1"))
    await intrude(deployment, ref.holder.address, hello, keys.public)
    # The real follower still follows rank 0 over the link: the TP-2 tokens are Hugging Face's.
    prompt = text_ids(11, 7)
    out = await deployment.execute("two", {"tokens": prompt}, ("tokens",), {"max_new_tokens": NEW})
    assert out["tokens"] == hf_greedy(reference, prompt, NEW)


async def test_killed_follower_rank_fails_the_in_flight_node_quickly(deployment: Deployment):
    two = deployment.replica("two")
    follower = two.ranks[0]
    started = asyncio.Event()
    long_call = asyncio.create_task(deployment.execute(
        "two", {"tokens": text_ids(7, 8)}, ("tokens",), {"max_new_tokens": 4000, "ignore_eos": True},
        started=started))
    await asyncio.wait_for(started.wait(), 30.0)
    killed_at = time.monotonic()
    os.kill(follower.pid, signal.SIGKILL)
    with pytest.raises(RemoteNodeError, match="tensor-parallel group failed") as caught:
        await asyncio.wait_for(long_call, TP_TIMEOUT_S + 4 * HB + 5.0)
    failed_after = time.monotonic() - killed_at
    # Within the heartbeat timeout (the registry TTL the launcher gives workers): gloo sees the closed
    # connection at the next collective, long before the group's own timeout.
    assert failed_after < 4 * HB, f"the node failed only {failed_after:.2f}s after the kill"
    assert "rank" in str(caught.value)
    # Rank 0's unit reports the broken group, so at its next heartbeat the worker stops itself
    # (status 4: it cannot go on serving) instead of failing every later call; a supervising
    # cluster would replace the replica (tests/integration/test_supervision.py).
    assert await asyncio.wait_for(two.process.wait(), 20.0) == 4
    with pytest.raises(WorkerLost, match="no live worker of role 'two'"):
        await asyncio.wait_for(deployment.execute("two", {"tokens": text_ids(8, 3)}, ("tokens",),
                                                  {"max_new_tokens": 2}), 5.0)


async def test_a_tp_replica_whose_ranks_cannot_start_fails_and_leaves_nothing_running():
    wf = Workflow("tpbad")
    wf.role("bad", kind="llm", model="no-such-model", tp_size=2)
    wf.input("x", "json")
    cluster = LocalCluster(wf.to_spec(), allow_module_ops=True, heartbeat_s=HB, ready_timeout_s=60.0)
    started = time.monotonic()
    with pytest.raises(LaunchError, match="before it was ready"):
        await cluster.start()
    assert time.monotonic() - started < 30.0  # not the ready timeout: the first failure ends the replica
    assert cluster.workers == []

