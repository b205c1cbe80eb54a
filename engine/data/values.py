"""Node values across processes: `PortValue`s on the wire, Python values at the ends.

Small msgpack-native values (None, bool, numbers, str, bytes, lists, dicts) travel
inline; a `KVRef` (an llm node's `kv`) travels as a msgpack map and is decoded back into one; numpy arrays and torch tensors stay in the producer's tensor store and travel
as `TensorRef`s, which the consumer pulls straight from the producer; large bytes go
the same way as a uint8 blob. A `TensorRef` handed on unchanged is passed through, so
a value crosses the network only to the node that reads it. Anything else is refused
with a `ValueTransportError` naming its type: nothing is pickled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from engine.data.kv.ref import KVRef
from engine.data.wire import PortValue, TensorRef, ValueKind

if TYPE_CHECKING:
    from engine.data.codec import TensorData
    from engine.data.peer import Peer

INLINE_LIMIT = 256 * 1024
"""Bytes of encoded msgpack above which bytes values go by reference."""

_ENCODER = msgspec.msgpack.Encoder()


class ValueTransportError(TypeError):
    """A value that cannot cross a process boundary."""


def _is_tensor(value: object) -> bool:
    if isinstance(value, np.ndarray):
        return True
    module = type(value).__module__
    return module.startswith("torch") and type(value).__name__ in ("Tensor", "Parameter")


_SCALARS = frozenset({str, float, bool, type(None)})
"""Types whose values msgpack always encodes (a str of any length, a float, a bool, None)."""
_INT_MIN, _INT_END = -(1 << 63), 1 << 64
"""The integers msgpack encodes: int64 and uint64."""


def encode_value(value: Any, peer: Peer, *, where: str | Callable[[], str] = "value",
                 lease_s: float | None = None) -> PortValue:
    """A PortValue for `value`; tensors are put into `peer`'s store (not copied again). `where`
    names the value in the error a value that cannot travel raises (or makes that name, called
    only then)."""
    kind = type(value)
    if kind in _SCALARS or (kind is int and _INT_MIN <= value < _INT_END):
        return PortValue(ValueKind.INLINE, data=value)  # nothing to check: it encodes
    if isinstance(value, TensorRef):
        return PortValue(ValueKind.TENSOR, ref=value)
    if isinstance(value, KVRef):
        return PortValue(ValueKind.KV, data=value)
    if _is_tensor(value):
        return PortValue(ValueKind.TENSOR, ref=peer.put(value, lease_s))
    if isinstance(value, bytes | bytearray | memoryview) and len(value) > INLINE_LIMIT:
        return PortValue(ValueKind.BLOB, ref=peer.put(np.frombuffer(value, np.uint8), lease_s))
    try:
        _ENCODER.encode(value)
    except (TypeError, OverflowError) as exc:
        raise ValueTransportError(
            f"{where if isinstance(where, str) else where()}: a {type(value).__name__} cannot cross processes"
            f" ({exc}); return JSON-like data,"
            " bytes, numpy arrays or torch tensors"
        ) from None
    return PortValue(ValueKind.INLINE, data=value)


def port_naming(node_id: str, side: str, port: str) -> Callable[[], str]:
    """A lazy `where` for `encode_value`: node `node_id`'s `side` ("input", "output") port `port`."""
    return lambda: f"node {node_id!r} {side} {port!r}"


def carries_value(value: PortValue) -> bool:
    """Whether `value` travels in the PortValue itself: `decode_value` has nothing to pull, so it
    never waits."""
    return value.kind in _CARRIED


def decode_value(value: PortValue, peer: Peer, *, timeout: float, materialize: bool = True) -> Any:
    """The Python value of a PortValue. With `materialize`, tensors are pulled (a torch
    tensor; read-only when mapped from shared memory: clone before writing in place)
    and blobs become bytes; without, their `TensorRef` is returned as is."""
    if value.kind in _CARRIED:
        return _carried(value)
    ref = _ref_of(value)
    return _materialized(value.kind, peer.pull(ref, timeout)) if materialize else ref


async def decode_value_async(value: PortValue, peer: Peer, *, timeout: float) -> Any:
    """`decode_value(materialize=True)` without blocking the event loop."""
    if value.kind in _CARRIED:
        return _carried(value)
    return _materialized(value.kind, await peer.pull_async(_ref_of(value), timeout))


_CARRIED = (ValueKind.INLINE, ValueKind.KV)
"""Kinds whose value travels in the PortValue itself (nothing to pull)."""


def _carried(value: PortValue) -> Any:
    return value.data if value.kind == ValueKind.INLINE else _kv_ref(value)


def _ref_of(value: PortValue) -> TensorRef:
    if value.ref is None:
        raise ValueTransportError(f"a {value.kind} value without a ref")
    return value.ref


def _materialized(kind: ValueKind, data: TensorData) -> Any:
    """A pulled value as its port sees it: a blob's bytes, a tensor's torch tensor."""
    if kind == ValueKind.BLOB:
        return data.bytes_view().tobytes()
    return data.torch()


def _kv_ref(value: PortValue) -> KVRef:
    if isinstance(value.data, KVRef):  # never encoded (an in-process hand-over)
        return value.data
    try:
        return msgspec.convert(value.data, KVRef)
    except msgspec.ValidationError as exc:
        raise ValueTransportError(f"a malformed KV reference: {exc}") from None
