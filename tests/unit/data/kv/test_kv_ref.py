"""`KVRef`, the `kv` value of llm nodes: across a worker's wire as itself, as JSON for the studio,
and its one validator."""

from __future__ import annotations

import msgspec
import pytest

from engine.data.codec import WireCodec
from engine.data.kv.keys import ExtraKeys, page_hashes
from engine.data.kv.layout import KVLayout
from engine.data.kv.ref import KVHold, KVHolder, KVRef, KVRefError
from engine.data.values import ValueTransportError, decode_value, encode_value
from engine.data.wire import ExecuteResult, PortValue, RefId, TensorRef, ValueKind, WorkerMessage
from engine.flow.events import preview

LAYOUT = KVLayout(page_size=4, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
IDS = tuple(range(100, 111))
PAGES = tuple(page_hashes(list(IDS[:8]), 4, extra_keys=ExtraKeys(model_id="m", tenant_salt="t")))
TOKEN = TensorRef(owner="tcp://127.0.0.1:5555", id=RefId("h.1"), dtype="float32", shape=(2, 2, 2, 4, 8),
                  nbytes=2048, host="host-a", lease_expires_at=1e9)


def handoff() -> KVRef:
    return KVRef(
        model_id="m", page_size=4, layout=LAYOUT.to_dict(), page_hashes=PAGES, prompt_ids=IDS, key_ids=IDS,
        tokens=11, prompt_tokens=11, cached_tokens=4, tenant_salt="t",
        holder=KVHolder("tcp://127.0.0.1:5555", "w1"),
        hold=KVHold(handoff_id="r:p:0:0:1", first_token=7, tail_len=3, token=TOKEN, sampling={"max_new_tokens": 6}),
    )


def generated() -> KVRef:
    return KVRef(model_id="m", page_size=4, page_hashes=PAGES, prompt_ids=IDS[:9], output_ids=IDS[9:], tokens=11,
                 prompt_tokens=9,
                 cached_tokens_details={"device": 4}, pulled_pages=2, pulled_from=KVHolder("tcp://127.0.0.1:1"))


@pytest.mark.parametrize("ref", [handoff(), generated()], ids=["handoff", "generated"])
def test_a_kv_ref_crosses_the_worker_wire_as_itself(ref: KVRef) -> None:
    value = encode_value(ref, peer=None, where="kv")  # type: ignore[arg-type]  # a KVRef needs no tensor store
    assert value.kind == ValueKind.KV
    codec = WireCodec(1 << 20, WorkerMessage)
    message = codec.decode(codec.encode(ExecuteResult(1, {"kv": value})))
    assert isinstance(message, ExecuteResult)
    back = decode_value(message.outputs["kv"], peer=None, timeout=0.0)  # type: ignore[arg-type]
    assert isinstance(back, KVRef) and back == ref


def test_a_malformed_kv_value_on_the_wire_is_a_typed_error() -> None:
    with pytest.raises(ValueTransportError, match="malformed KV reference"):
        decode_value(PortValue(ValueKind.KV, data={"type": "kv", "model_id": 3}), peer=None,  # type: ignore[arg-type]
                     timeout=0.0)


def test_the_studio_sees_json_that_reads_back_as_the_same_ref() -> None:
    ref = handoff()
    shown = preview(ref)
    assert shown == ref.to_json()
    assert shown["type"] == "kv" and shown["prompt_tokens"] == 11 and shown["tokens"] == 11
    assert shown["holder"] == {"address": "tcp://127.0.0.1:5555", "worker_id": "w1"}
    assert shown["hold"]["token"]["id"] == "h.1"
    assert KVRef.of(shown) == ref


def test_a_long_contexts_preview_keeps_its_counts_and_gives_its_id_lists_as_lengths() -> None:
    ids = tuple(range(4000))
    ref = msgspec.structs.replace(handoff(), prompt_ids=ids, key_ids=ids, page_hashes=PAGES * 500,
                                  tokens=4000, prompt_tokens=4000)
    shown = preview(ref)
    assert len(msgspec.json.encode(shown)) < 2000
    assert shown == {**ref.to_json(), "page_hashes": {"count": 1000}, "prompt_ids": {"count": 4000},
                     "output_ids": {"count": 0}, "key_ids": {"count": 4000}}


def test_of_accepts_only_kv_refs() -> None:
    assert KVRef.of(generated()) == generated()
    for value in ({"model_id": "m", "pages": []}, {"type": "llm.handoff"}, [1], None):
        with pytest.raises(KVRefError, match="not a KV reference"):
            KVRef.of(value)
    with pytest.raises(KVRefError, match="malformed KV reference"):
        KVRef.of({"type": "kv", "model_id": "m"})  # no page_size


def test_for_role_checks_the_model_and_the_layout() -> None:
    assert KVRef.for_role(handoff(), "m", LAYOUT) == handoff()
    with pytest.raises(KVRefError, match="KV of model 'm', this role runs 'other'"):
        KVRef.for_role(handoff(), "other", LAYOUT)
    wide = KVLayout(page_size=4, num_layers=2, num_kv_heads=4, head_dim=8, dtype="float32")
    with pytest.raises(KVRefError, match="layout"):
        KVRef.for_role(handoff(), "m", wide)
    # Without a layout (SGLang's pages): the page size must match, or the page keys name other pages.
    assert KVRef.for_role(generated(), "m", wide) == generated()
    with pytest.raises(KVRefError, match="pages of 4 tokens, this role's hold 8"):
        KVRef.for_role(generated(), "m", KVLayout(page_size=8, num_layers=2, num_kv_heads=2, head_dim=8,
                                                  dtype="float32"))


def test_handoff_is_the_hold_or_a_typed_error() -> None:
    assert handoff().handoff.first_token == 7
    with pytest.raises(KVRefError, match="not a prefill handoff"):
        _ = generated().handoff
    with pytest.raises(KVRefError, match="a prefill handoff without its KV layout"):
        _ = msgspec.structs.replace(handoff(), layout=None).handoff
    assert msgspec.structs.replace(handoff(), hold=None).hold is None


def test_pages_for_gives_the_page_keys_only_when_they_are_the_refs_own_contexts() -> None:
    """The keys are the chain over the ref's token ids (key ids, else prompt ids, then output ids)
    under its model and the reader's tenant (a reader without one: the ref's salt)."""
    assert handoff().pages_for("t") == PAGES and handoff().pages_for(None) == PAGES
    assert generated().pages_for("t") == PAGES  # prompt ids then output ids: 11 ids, two full pages
    refused = {
        r"page_hashes\[0\] is not the key of page 0 of its token ids under model 'm' and this run's tenant":
            (handoff(), "u"),
        r"page_hashes\[0\] is not the key of page 0": (generated(), None),  # no salt of its own: keyed under none
        r"page_hashes\[1\] is not the key of page 1": (
            msgspec.structs.replace(handoff(), page_hashes=(PAGES[0], PAGES[0])), "t"),
        r"page_hashes names 3 pages of 4 tokens, more than its 11 token ids": (
            msgspec.structs.replace(handoff(), page_hashes=(*PAGES, PAGES[0])), "t"),
        r"its token ids cannot be keyed": (msgspec.structs.replace(handoff(), key_ids=(-1, *IDS[1:])), "t"),
        r"page_hashes\[0\] is not the key of page 0 ": (msgspec.structs.replace(handoff(), model_id="n"), "t"),
    }
    for message, (ref, tenant) in refused.items():
        with pytest.raises(KVRefError, match=f"^{message}"):
            ref.pages_for(tenant)
    assert msgspec.structs.replace(handoff(), page_hashes=()).pages_for("anyone") == ()
