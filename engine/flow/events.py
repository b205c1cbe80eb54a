"""Run events: what the executor reports, in order, with contiguous sequence numbers.

Every run's stream starts with `run_started` (seq 0) and ends with `run_finished`.
A client that saw events up to seq k resumes with `since=k + 1` and misses nothing.
"""

from __future__ import annotations

import asyncio
import enum
import math
import sys
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from engine.data.kv.ref import KVRef


class NodeState(enum.StrEnum):
    PENDING = "pending"
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL_NODE


_TERMINAL_NODE = frozenset({NodeState.DONE, NodeState.FAILED, NodeState.SKIPPED, NodeState.CANCELLED})


class RunStatus(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class RunStarted(msgspec.Struct, tag="run_started", kw_only=True):
    seq: int
    run_id: str
    time: float
    workflow: str
    nodes: list[str]


class NodeStateEvent(msgspec.Struct, tag="node_state", kw_only=True, omit_defaults=True):
    seq: int
    run_id: str
    time: float
    node: str
    state: NodeState
    attempt: int = 0
    iteration: int = 0
    error: str | None = None
    duration_ms: float | None = None
    """With a terminal state (`failed` also ends an attempt that is retried), once the node has run:
    the time it has run so far, over every iteration and attempt (`RunNode.busy_s`)."""
    busy_ms: float | None = None
    """With `running`: the time it ran before this attempt (earlier iterations and attempts). Its time
    while it runs is `busy_ms` plus the time since this event, and reaches `duration_ms` when it ends:
    live and final times agree."""
    worker: str | None = None
    """With `running`: the worker that runs this attempt (`RanOn`), and its host."""
    host: str | None = None


class NodeOutputEvent(msgspec.Struct, tag="node_output", kw_only=True, omit_defaults=True):
    seq: int
    run_id: str
    time: float
    node: str
    port: str
    value: Any
    frame: int | None = None
    """Sequence number of a streamed frame; None for a node's final output."""
    iteration: int = 0


class NodeProgressEvent(msgspec.Struct, tag="node_progress", kw_only=True, omit_defaults=True):
    seq: int
    run_id: str
    time: float
    node: str
    progress: float | None = None
    message: str = ""


class RunFinished(msgspec.Struct, tag="run_finished", kw_only=True, omit_defaults=True):
    seq: int
    run_id: str
    time: float
    status: RunStatus
    outputs: dict[str, Any] = {}
    error: str | None = None
    failed_node: str | None = None
    duration_ms: float = 0.0


RunEvent = RunStarted | NodeStateEvent | NodeOutputEvent | NodeProgressEvent | RunFinished

_JSON = msgspec.json.Encoder()


def event_to_dict(event: RunEvent) -> dict[str, Any]:
    return msgspec.to_builtins(event)


def encode_event(event: RunEvent) -> bytes:
    return _JSON.encode(event)


PREVIEW_CHARS = 2000

NESTED_ITEMS = 64
"""A list, tuple or dict of at most this many items that holds byte blobs is previewed item by
item (each blob as `{"bytes": n}` at its place), so a UI can show each one; a bigger one, or one
deeper than `NESTED_DEPTH`, is previewed whole."""
NESTED_DEPTH = 3

BlobPath = tuple[str | int, ...]
"""Where a blob sits in a port value: () for the value itself, else the dict keys and list indices
down to it (as in its preview)."""


class HeldBlob(msgspec.Struct, frozen=True):
    """A byte blob of a port value, and where in the value (and its preview) it sits."""

    path: BlobPath
    value: Any


def _items(value: Any) -> list[tuple[str | int, Any]]:
    return list(value.items()) if isinstance(value, dict) else list(enumerate(value))


def _opens(value: Any, depth: int) -> bool:
    """Whether `value` is a container previewed item by item: small, string keys, blobs within reach."""
    if depth >= NESTED_DEPTH or not isinstance(value, list | tuple | dict) or not 0 < len(value) <= NESTED_ITEMS:
        return False
    if isinstance(value, dict) and not all(isinstance(k, str) for k in value):
        return False
    return any(is_blob(item) or _opens(item, depth + 1) for _, item in _items(value))


def blobs_in(value: Any, depth: int = 0, at: BlobPath = ()) -> list[HeldBlob]:
    """The byte blobs of a port value, depth-first: the value itself when it is one, else those in
    the lists, tuples and dicts that `preview` shows item by item."""
    if is_blob(value):
        return [HeldBlob(at, value)]
    if not _opens(value, depth):
        return []
    return [blob for key, item in _items(value) for blob in blobs_in(item, depth + 1, (*at, key))]


_LOG10_2 = math.log10(2)
PRINTABLE_DEPTH = 32
"""How deep `preview` looks for integers too long to print in a value whose JSON encoding they
broke (deeper ones leave the value shown by its type alone)."""


def _int_fits(value: int, limit: int) -> bool:
    """Whether `value`'s decimal text (its sign included) is at most `limit` characters, found
    without printing a number Python would refuse to print (past `sys.get_int_max_str_digits()`)."""
    limit = min(limit, (sys.get_int_max_str_digits() or limit + 1) - 1) - (value < 0)
    bits = abs(value).bit_length()
    if math.floor(bits * _LOG10_2) + 1 <= limit:  # 2**bits has at most this many digits
        return True
    if bits and math.floor((bits - 1) * _LOG10_2) + 1 > limit:  # 2**(bits-1) has at least this many
        return False
    return len(str(abs(value))) <= limit


def _int_preview(value: int, limit: int) -> int | dict[str, Any]:
    """`value` itself, or `{"int": {"bits": n}}` when its text is longer than `limit`."""
    return value if _int_fits(value, limit) else {"int": {"bits": abs(value).bit_length()}}


def _printable(value: Any, depth: int = 0) -> Any:
    """`value` with every integer too long to print in its lists, tuples and dicts (down to
    `PRINTABLE_DEPTH`) as its size; other items as they are."""
    if isinstance(value, int) and not isinstance(value, bool):
        return _int_preview(value, sys.get_int_max_str_digits() or PREVIEW_CHARS)
    if depth >= PRINTABLE_DEPTH:
        return value
    if isinstance(value, dict):
        return {key: _printable(item, depth + 1) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_printable(item, depth + 1) for item in value]
    return value


def non_finite(value: float) -> dict[str, str]:
    """How a value shows a float JSON has no number for: `{"float": "inf"}`, `"-inf"` or `"nan"`
    (JSON encoders write null, or a literal that is not JSON and no database column takes)."""
    return {"float": "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"}


def finite_json(value: Any) -> Any:
    """`value` (JSON-shaped: dicts, lists, tuples, scalars) with each float that is not finite as
    `non_finite` shows it; the value itself when it holds none."""
    if isinstance(value, float):
        return value if math.isfinite(value) else non_finite(value)
    if isinstance(value, dict):
        items = {key: finite_json(item) for key, item in value.items()}
        return value if all(items[key] is value[key] for key in value) else items
    if isinstance(value, list | tuple):
        listed = [finite_json(item) for item in value]
        return value if all(a is b for a, b in zip(listed, value, strict=True)) else listed
    return value


_SHORT_INT = 1 << 63
_SHORT_INT_CHARS = 20
"""An integer of fewer than 64 bits prints in at most 20 characters, its sign included."""


def preview(value: Any, limit: int = PREVIEW_CHARS, depth: int = 0) -> Any:
    """A JSON-able, bounded rendering of a port value for events and UIs. An integer whose text is
    longer than `limit` (Python prints none of more than 4300 digits) is `{"int": {"bits": n}}`; a
    float that is not finite, `{"float": "inf"}` (`non_finite`)."""
    kind = type(value)
    if kind is str and len(value) <= limit:  # the common values first: nothing to bound
        return value
    if kind is int and -_SHORT_INT < value < _SHORT_INT and limit >= _SHORT_INT_CHARS:
        return value
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else non_finite(value)
    if isinstance(value, int):
        return _int_preview(value, limit)
    if _opens(value, depth):  # each blob at its place (`blobs_in`), the items sharing the bound
        share = max(64, limit // len(value))
        if isinstance(value, dict):
            return {key: preview(item, share, depth + 1) for key, item in value.items()}
        return [preview(item, share, depth + 1) for item in value]
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + f"… ({len(value)} chars)"
    if isinstance(value, bytes | bytearray | memoryview):
        return {"bytes": len(value)}
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return {"tensor": {"shape": list(shape), "dtype": str(dtype)}}
    try:
        encoded = _JSON.encode(finite_json(msgspec.to_builtins(value)))
    except (TypeError, msgspec.EncodeError):
        return {"repr": repr(value)[:limit]}
    except ValueError:  # an integer in it too long to print
        try:
            encoded = _JSON.encode(_printable(value))
        except (TypeError, ValueError, msgspec.EncodeError):
            return {"unprintable": type(value).__name__}
    if len(encoded) <= limit:
        return msgspec.json.decode(encoded)
    if isinstance(value, KVRef):  # its counts and holder stay readable (the studio's usage of older graphs)
        return value.brief()
    return {"truncated": encoded[:limit].decode("utf-8", "replace"), "bytes": len(encoded)}


def is_blob(value: Any) -> bool:
    """Whether a port value is a byte blob (an encoded image or audio clip, say): bytes, or a
    1-D uint8 tensor or reference to one, which is how a worker's bytes cross the wire."""
    if isinstance(value, bytes | bytearray | memoryview):
        return True
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) == 1 and str(getattr(value, "dtype", "")) in ("uint8", "torch.uint8")


class EventLog:
    """The ordered events of one run; any number of readers, each from any seq."""

    def __init__(self) -> None:
        self._events: list[RunEvent] = []
        self._changed = asyncio.Event()
        self._closed = False

    def __len__(self) -> int:
        return len(self._events)

    @property
    def next_seq(self) -> int:
        return len(self._events)

    @property
    def closed(self) -> bool:
        return self._closed

    def append(self, event: RunEvent) -> None:
        assert event.seq == len(self._events), "event sequence numbers are contiguous"
        self._events.append(event)
        self._changed.set()
        if isinstance(event, RunFinished):
            self._closed = True

    def snapshot(self, since: int = 0) -> list[RunEvent]:
        return self._events[since:]

    async def follow(self, since: int = 0) -> AsyncIterator[RunEvent]:
        """Events from `since` on, as they come; ends after `run_finished`."""
        position = max(0, since)
        while True:
            while position < len(self._events):
                event = self._events[position]
                position += 1
                yield event
            if self._closed:
                return
            self._changed.clear()
            await self._changed.wait()
