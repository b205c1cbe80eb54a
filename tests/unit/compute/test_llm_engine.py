"""The LLM runner in process: batching, prefix reuse, stops, streaming, tiers, sessions, handoff.

Greedy tokens are checked against the engine run alone (batch composition must not
matter) here; against `transformers` in tests/integration/test_llm_vs_hf.py.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from engine.compute.llm import (
    FinishReason,
    HandoffError,
    RequestError,
    SessionBusyError,
    SessionNotFoundError,
)
from engine.compute.prefix import MultimodalItem, content_hash
from engine.compute.sampling import SamplingParams
from engine.data.kv.source import StorePageSource
from tests.unit.compute.conftest import prompt_ids

GREEDY = SamplingParams(max_new_tokens=12)


def run_alone(make_engine, prompt, params=GREEDY, **config):
    return list(make_engine(**config).generate([prompt], params)[0].output_ids)


def locked(engine) -> int:
    return int(engine.store.metrics()["device.locked_pages"])


def test_requests_join_and_leave_the_running_batch_every_step(make_engine):
    engine = make_engine()
    a = engine.add_request(prompt_ids(1, 9), SamplingParams(max_new_tokens=4))
    per_step = [engine.step() for _ in range(2)]
    b = engine.add_request(prompt_ids(2, 13), SamplingParams(max_new_tokens=6))
    while engine.has_unfinished():
        per_step.append(engine.step())
    owners = [sorted({o.request_id for o in outs}) for outs in per_step]
    # a alone, then a and b together, then b alone after a finished.
    assert owners[:2] == [[a], [a]]
    assert owners[2] == sorted([a, b]) and owners[3] == sorted([a, b])
    assert all(o == [b] for o in owners[4:]) and len(owners) == 2 + 6
    outs = {o.request_id: o for step in per_step for o in step if o.finished}
    assert list(outs[a].output_ids) == run_alone(make_engine, prompt_ids(1, 9), SamplingParams(max_new_tokens=4))
    assert list(outs[b].output_ids) == run_alone(make_engine, prompt_ids(2, 13), SamplingParams(max_new_tokens=6))
    assert locked(engine) == 0


def test_prefill_reuses_the_cached_prefix_and_computes_only_the_rest(make_engine):
    engine = make_engine(page_size=4)
    prompt = prompt_ids(3, 22)
    first = engine.generate([prompt], GREEDY)[0]
    computed = engine.stats.computed_prompt_tokens
    second = engine.generate([prompt + [65, 66]], GREEDY)[0]
    assert first.cached_tokens == 0
    # Every full page of the first prompt (and of the first tokens it generated) is reused.
    assert second.cached_tokens == 20
    assert engine.stats.computed_prompt_tokens - computed == 24 - 20
    assert list(second.output_ids) == run_alone(make_engine, prompt + [65, 66])


def test_prefix_matches_count_as_lookups_in_the_tier_hit_rates(make_engine):
    engine = make_engine(page_size=4)
    prompt = prompt_ids(3, 22)  # 5 full pages before the last token
    engine.generate([prompt], GREEDY)
    m = engine.store.metrics()
    assert (m["device.lookups"], m["device.hit_pages"], m["device.hit_rate"]) == (1, 0, 0.0)  # the first page missed
    engine.generate([prompt], GREEDY)
    m = engine.store.metrics()
    assert (m["device.lookups"], m["device.hit_pages"]) == (6, 5)  # the whole prefix was held on the device
    assert m["device.hit_rate"] == 5 / 6


def test_eight_mixed_prompts_batched_equal_each_alone(make_engine):
    prompts = [prompt_ids(10 + i, n) for i, n in enumerate([1, 3, 4, 5, 17, 30, 9, 2])]
    together = make_engine(max_prefill_tokens=16).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, together, strict=True):
        assert list(out.output_ids) == run_alone(make_engine, prompt)


def test_stop_token_ids_eos_and_length(make_engine, tiny_llama):
    prompt = prompt_ids(4, 10)
    free = run_alone(make_engine, prompt, SamplingParams(max_new_tokens=12))
    stop_at = free[5]
    cut = free.index(stop_at) + 1
    engine = make_engine()
    out = engine.generate([prompt], SamplingParams(max_new_tokens=12, stop_token_ids=(stop_at,)))[0]
    assert (out.finish_reason, out.stop_reason, list(out.output_ids)) == (FinishReason.STOP, stop_at, free[:cut])
    eos_model = dataclasses.replace(tiny_llama, eos_token_ids=(stop_at,))
    out = make_engine(eos_model).generate([prompt], SamplingParams(max_new_tokens=12))[0]
    assert (out.finish_reason, list(out.output_ids)) == (FinishReason.STOP, free[:cut])
    out = make_engine(eos_model).generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert (out.finish_reason, list(out.output_ids)) == (FinishReason.LENGTH, free)


def test_stop_strings_truncate_the_text(make_engine):
    prompt = prompt_ids(5, 10)
    engine = make_engine()
    full = engine.generate([prompt], SamplingParams(max_new_tokens=16))[0]
    stop = full.text[6:8]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=16, stop=(stop,)))[0]
    index = full.text.find(stop)
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop
    assert out.text == full.text[:index]
    assert list(out.output_ids) == list(full.output_ids[: index + len(stop)])


def test_streaming_yields_one_token_per_step_and_the_deltas_add_up(make_engine):
    engine = make_engine()
    rid = engine.add_request(prompt_ids(6, 8), SamplingParams(max_new_tokens=10, stop=("~~~",)), stream_text=True)
    outs = list(engine.iter_outputs())
    assert [len(o.new_token_ids) for o in outs] == [1] * 10
    assert all(o.request_id == rid for o in outs)
    assert "".join(o.text_delta for o in outs) == outs[-1].text
    assert [t for o in outs for t in o.new_token_ids] == list(outs[-1].output_ids)


def test_abort_ends_a_running_request_and_frees_its_pages(make_engine):
    engine = make_engine()
    rid = engine.add_request(prompt_ids(7, 20), SamplingParams(max_new_tokens=50))
    other = engine.add_request(prompt_ids(8, 5), SamplingParams(max_new_tokens=5))
    engine.step()
    engine.step()
    assert locked(engine) > 0
    engine.abort(rid)
    finals = [o for o in engine.iter_outputs() if o.finished]
    assert [(o.request_id, o.finish_reason) for o in finals] == [(rid, FinishReason.ABORT), (other, FinishReason.LENGTH)]
    assert len(finals[0].output_ids) == 2
    assert locked(engine) == 0


def test_evicted_device_pages_are_demoted_and_promoted_on_hit(make_engine):
    prompt = prompt_ids(9, 40)
    engine = make_engine(device_pages=24, host_pages=64, max_running=2)
    first = engine.generate([prompt], GREEDY)[0]
    for i in range(3):  # push the first prompt's pages down to the host tier
        engine.generate([prompt_ids(100 + i, 40)], GREEDY)
    metrics = engine.store.metrics()
    assert metrics["device.evictions"] > 0 and metrics["host.demotions"] > 0
    again = engine.generate([prompt], GREEDY)[0]
    assert again.cached_tokens == 36
    assert engine.store.metrics()["device.promotions"] > 0
    assert again.output_ids == first.output_ids


def test_engines_sharing_a_disk_path_take_free_slots_and_a_successor_recovers_one(make_engine, tmp_path):
    prompt = prompt_ids(9, 40)
    tiers = {"device_pages": 24, "host_pages": 16, "disk_path": str(tmp_path), "disk_pages": 64,
             "write_policy": "write_through"}
    first = make_engine(**tiers)
    expected = first.generate([prompt], GREEDY)[0]
    second = make_engine(**tiers)  # the first holds slot-0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slot-0", "slot-1"]
    first.close()
    successor = make_engine(**tiers)  # takes over slot-0, with the first's pages
    assert successor.store.metrics()["disk.pages_used"] >= 10
    again = successor.generate([prompt], GREEDY)[0]
    assert again.cached_tokens == 36 and again.output_ids == expected.output_ids
    assert second.store.metrics()["disk.pages_used"] == 0


def test_admission_waits_for_room_and_a_request_that_cannot_fit_fails(make_engine):
    engine = make_engine(device_pages=14, max_running=4)
    a = engine.add_request(prompt_ids(11, 30), SamplingParams(max_new_tokens=10))  # needs 10 pages
    b = engine.add_request(prompt_ids(12, 30), SamplingParams(max_new_tokens=10))
    engine.step()
    assert engine.metrics()["llm.running"] == 1 and engine.metrics()["llm.waiting"] == 1
    finals = {o.request_id: o for o in engine.iter_outputs() if o.finished}
    assert finals[a].finish_reason is FinishReason.LENGTH and finals[b].finish_reason is FinishReason.LENGTH
    out = make_engine(device_pages=3).generate([prompt_ids(13, 30)], GREEDY)[0]
    assert out.finish_reason is FinishReason.ERROR and "device tier is full" in (out.error or "")


def test_pages_missing_locally_are_pulled_from_a_peer(make_engine, tiny_llama):
    prompt = prompt_ids(14, 33)
    owner = make_engine()
    computed = owner.generate([prompt], GREEDY)[0]
    puller = make_engine(peers=[StorePageSource(owner.store)])
    out = puller.generate([prompt], GREEDY)[0]
    assert out.cached_tokens == 32 and puller.cache.pulled_pages == 8
    assert puller.store.metrics()["pull.pages"] == 8
    assert out.output_ids == computed.output_ids


class GatedSource:
    """A peer that answers only once `gate` is set (a slow holder across the network)."""

    def __init__(self, store, gate: threading.Event) -> None:
        self._source = StorePageSource(store)
        self._gate = gate
        self.asked = threading.Event()

    def pull(self, store, pages, timeout_s):
        self.asked.set()
        assert self._gate.wait(10.0), "the test never opened the gate"
        return self._source.pull(store, pages, timeout_s)


def test_a_prompt_waits_for_a_peers_pages_while_the_batch_runs_on(make_engine):
    prompt = prompt_ids(14, 33)
    owner = make_engine()
    computed = owner.generate([prompt], GREEDY)[0]
    gate = threading.Event()
    source = GatedSource(owner.store, gate)
    engine = make_engine(peers=[source])
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    running = engine.add_request(prompt_ids(40, 4), params)
    engine.step()  # a prompt of one page: nothing to match, nobody asked
    waiting = engine.add_request(prompt, GREEDY)
    decoded = 0
    for _ in range(6):
        decoded += sum(len(o.new_token_ids) for o in engine.step() if o.request_id == running)
        assert source.asked.wait(10.0)
    # Six steps while the peer had not answered: the other request decoded a token each.
    assert decoded == 6 and engine.cache.pulling
    gate.set()
    out = {o.request_id: o for o in engine.run_until_finished([running, waiting])}
    assert out[waiting].cached_tokens == 32 and engine.cache.pulled_pages == 8
    assert out[waiting].output_ids == computed.output_ids
    assert list(out[running].output_ids) == run_alone(make_engine, prompt_ids(40, 4), params)
    assert not engine.cache.pulling


def test_a_request_aborted_while_it_waits_for_pages_ends_and_frees_its_hold(make_engine):
    owner = make_engine()
    prompt = prompt_ids(14, 33)
    owner.generate([prompt], GREEDY)
    gate = threading.Event()
    source = GatedSource(owner.store, gate)
    engine = make_engine(peers=[source])
    rid = engine.add_request(prompt, GREEDY)
    engine.step()
    assert source.asked.wait(10.0) and engine.cache.pulling
    engine.abort(rid)
    final = [o for o in engine.step() if o.request_id == rid]
    assert final and final[0].finished and not engine.cache.pulling
    gate.set()
    assert locked(engine) == 0 and not engine.has_unfinished()
    # What the pull brought stays for the next asker.
    again = engine.generate([prompt], GREEDY)[0]
    assert again.cached_tokens == 32


def test_without_prefix_cache_nothing_is_reused_or_kept(make_engine):
    engine = make_engine(prefix_cache=False)
    prompt = prompt_ids(15, 20)
    first, second = engine.generate([prompt, prompt], GREEDY)
    assert (first.cached_tokens, second.cached_tokens) == (0, 0)
    assert engine.generate([prompt], GREEDY)[0].cached_tokens == 0
    assert engine.store.metrics()["device.pages_used"] == 0
    assert first.output_ids == second.output_ids


def test_session_turn_computes_only_its_new_tokens_and_pins_expire(make_engine):
    now = [0.0]
    engine = make_engine(clock=lambda: now[0], session_ttl_s=30.0)
    sid = engine.open_session()
    engine.run_until_finished([engine.add_request(prompt_ids(16, 21), GREEDY, session_id=sid)])
    history = engine.session_history(sid)
    assert len(history) == 33 and locked(engine) == 8
    before = engine.stats.computed_prompt_tokens
    turn = engine.run_until_finished([engine.add_request(prompt_ids(17, 7), GREEDY, session_id=sid)])[0]
    assert turn.prompt_tokens == 40 and turn.cached_tokens == 32
    # Only the new message and the last token of the previous turn (never fed) are computed.
    assert engine.stats.computed_prompt_tokens - before == 8
    assert list(turn.output_ids) == run_alone(make_engine, history + prompt_ids(17, 7))
    engine.add_request([1], GREEDY, session_id=sid, request_id="in-flight")
    with pytest.raises(SessionBusyError):
        engine.add_request([2], GREEDY, session_id=sid)
    engine.abort("in-flight")  # an aborted turn leaves the history as it was
    assert [o.finish_reason for o in engine.iter_outputs()] == [FinishReason.ABORT]
    assert engine.session_history(sid) == history + prompt_ids(17, 7) + list(turn.output_ids)
    assert engine.session_info(sid).turns == 2 and engine.session_info(sid).pinned
    now[0] = 31.0
    assert engine.expire_sessions() == [sid]
    assert locked(engine) == 0 and not engine.session_info(sid).pinned
    late = engine.run_until_finished([engine.add_request([70, 71], GREEDY, session_id=sid)])[0]
    assert late.cached_tokens == 48  # unpinned pages were still cached
    engine.close_session(sid)
    with pytest.raises(SessionNotFoundError):
        engine.add_request([1], GREEDY, session_id=sid)


def test_prefill_handoff_continues_on_another_engine(make_engine, tiny_llama):
    prompt = prompt_ids(18, 23)
    single = run_alone(make_engine, prompt)
    prefill = make_engine()
    out = prefill.generate([prompt], GREEDY, prefill_only=True)[0]
    assert out.finish_reason is FinishReason.PREFILLED and len(out.output_ids) == 1
    handoff = out.handoff
    assert handoff is not None and len(handoff.page_hashes) == 5 and handoff.tail_len == 3
    assert locked(prefill) == 5  # held for the decode side
    decode = make_engine()
    final = decode.run_until_finished([decode.add_request(params=GREEDY, handoff=handoff,
                                                          source=StorePageSource(prefill.store))])[0]
    assert list(final.output_ids) == single
    prefill.release_handoff(handoff.handoff_id)
    assert locked(prefill) == 0
    with pytest.raises(HandoffError, match="model"):
        make_engine(dataclasses.replace(tiny_llama, model_id="other")).add_request(handoff=handoff)


def test_multimodal_embeddings_are_spliced_and_the_same_item_hits_later(make_engine, tiny_llama):
    embeds = torch.randn(6, tiny_llama.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    item = MultimodalItem("image", content_hash("image", embeds), start=4, length=6, embeds=embeds)
    prompt = prompt_ids(19, 4) + [259] * 6 + prompt_ids(20, 5)
    engine = make_engine()
    sid = engine.open_session()
    with_image = engine.run_until_finished([engine.add_request(prompt, GREEDY, session_id=sid, mm_items=[item])])[0]
    plain = make_engine().generate([prompt], GREEDY)[0]
    assert with_image.output_ids != plain.output_ids
    turn = engine.run_until_finished([engine.add_request([65, 66], GREEDY, session_id=sid)])[0]
    assert turn.cached_tokens == 15 + 11  # the history, picture included
    other = MultimodalItem("image", content_hash("image", embeds + 1), start=4, length=6, embeds=embeds + 1)
    miss = engine.generate([prompt], GREEDY, mm_items=[other])[0]
    assert miss.cached_tokens == 4


def test_bad_requests_are_rejected_with_typed_errors(make_engine):
    engine = make_engine()
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request([1, 100000], GREEDY)
    with pytest.raises(RequestError, match="positions"):
        engine.add_request([1], SamplingParams(max_new_tokens=10**6))
