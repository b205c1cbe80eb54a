"""Node values on the worker wire: what travels inline, what is refused (and how the refusal
names the value), checked against msgpack itself, the reference of what can travel inline."""

from __future__ import annotations

import msgspec
import pytest

from engine.data.codec import WireCodec
from engine.data.values import ValueTransportError, carries_value, decode_value, encode_value, port_naming
from engine.data.wire import ExecuteResult, PortValue, ValueKind, WorkerMessage

INT64_MIN = -(1 << 63)
UINT64_MAX = (1 << 64) - 1

# No value here is a tensor or a large blob: no tensor store is needed.
NO_PEER = None


def round_trip(value: PortValue) -> PortValue:
    codec = WireCodec(1 << 20, WorkerMessage)
    message = codec.decode(codec.encode(ExecuteResult(1, {"out": value})))
    assert isinstance(message, ExecuteResult)
    return message.outputs["out"]


@pytest.mark.parametrize("value", [
    0, -1, INT64_MIN, UINT64_MAX, 2.5, float("inf"), True, False, None, "", "text", "ü" * 1000,
    b"bytes", [1, "a", None], {"k": [1.5, {"n": None}]},
], ids=repr)
def test_a_value_msgpack_encodes_travels_inline_as_itself(value: object) -> None:
    msgspec.msgpack.encode(value)  # the reference: msgpack takes it
    encoded = encode_value(value, NO_PEER, where="x")  # type: ignore[arg-type]
    assert (encoded.kind, encoded.data) == (ValueKind.INLINE, value)
    assert carries_value(encoded)
    back = decode_value(round_trip(encoded), NO_PEER, timeout=0.0)  # type: ignore[arg-type]
    assert back == value and type(back) is type(value)


@pytest.mark.parametrize("value", [INT64_MIN - 1, UINT64_MAX + 1, -(10 ** 30), [UINT64_MAX + 1], object(), {1j: 1}],
                         ids=repr)
def test_a_value_msgpack_refuses_is_refused_naming_where_it_was(value: object) -> None:
    with pytest.raises((TypeError, OverflowError)):
        msgspec.msgpack.encode(value)  # the reference: msgpack refuses it
    with pytest.raises(ValueTransportError, match=r"^node 'n' output 'out': a \w+ cannot cross processes"):
        encode_value(value, NO_PEER, where="node 'n' output 'out'")  # type: ignore[arg-type]
    with pytest.raises(ValueTransportError, match=r"^node 'n' input 'x': a \w+ cannot cross processes"):
        encode_value(value, NO_PEER, where=port_naming("n", "input", "x"))  # type: ignore[arg-type]


def test_a_lazy_name_is_made_only_for_a_refusal() -> None:
    made: list[str] = []

    def where() -> str:
        made.append("where")
        return "here"

    for value in (1, "s", [1, 2], {"a": b"b"}):
        encode_value(value, NO_PEER, where=where)  # type: ignore[arg-type]
    assert made == []
    with pytest.raises(ValueTransportError, match="^here: "):
        encode_value(object(), NO_PEER, where=where)  # type: ignore[arg-type]
    assert made == ["where"]


def test_a_subclass_of_a_plain_type_is_checked_as_before() -> None:
    """Only the exact builtin types skip the check: a subclass goes to msgpack, which refuses it."""

    class Count(int):
        pass

    with pytest.raises(TypeError):
        msgspec.msgpack.encode(Count(3))
    with pytest.raises(ValueTransportError, match="^x: a Count cannot cross processes"):
        encode_value(Count(3), NO_PEER, where="x")  # type: ignore[arg-type]
