"""Wire messages of the SGLang KV transfer plug-in (`engine.compute.sglang.transfer`), and nothing else.

Every message is an `engine.data.wire.Exchange` (tag field `"type"`, and a `request_id`), encoded as
msgpack with `engine.data.codec.WireCodec` over the unions below. KV bytes never travel inside these
messages: the prefill side puts them in its tensor store and hands out a `TensorRef`, which the
decode side pulls over `engine.data` (shared memory on one host, TCP otherwise).

Bootstrap server (a ROUTER; prefill managers and decode managers are DEALERs):

    BootstrapRegisterRequest -> BootstrapRegisterReply
    BootstrapLookupRequest   -> BootstrapLookupReply      (address None: not registered yet)

Prefill manager's control endpoint (a ROUTER; decode managers are DEALERs):

    KVReceiveRequest -> KVReadyEvent | KVFailedEvent      (deferred until the prefill has sent)
    KVStatusRequest  -> KVStatusReply                     (the decode's liveness probe while it waits)
    KVDoneRequest    -> KVDoneReply

Bump `TRANSFER_PROTOCOL_VERSION` on any incompatible change.
"""

from __future__ import annotations

import msgspec

from engine.data.wire import Exchange, TensorRef

TRANSFER_PROTOCOL_VERSION = 1


class PrefillTopology(msgspec.Struct, frozen=True):
    """What a decode side needs to know of the prefill servers behind a bootstrap address."""

    attn_tp_size: int
    dp_size: int
    page_size: int
    kv_cache_dtype: str


class BootstrapRegisterRequest(Exchange):
    """A prefill manager (one per dp rank and tp rank) announces its control endpoint."""

    protocol_version: int
    dp_rank: int
    engine_rank: int
    address: str
    topology: PrefillTopology


class BootstrapRegisterReply(Exchange):
    accepted: bool
    reason: str = ""


class BootstrapLookupRequest(Exchange):
    """Where is the prefill manager of (`dp_rank`, `engine_rank`)? `engine_rank` -1: topology only."""

    dp_rank: int
    engine_rank: int


class BootstrapLookupReply(Exchange):
    address: str | None
    topology: PrefillTopology | None


class KVReceiveRequest(Exchange):
    """A decode receiver is ready for `room`: `num_pages` pages of the given per-buffer sizes
    (bytes of one page in each KV buffer) and, when `aux` is set, one aux row."""

    protocol_version: int
    room: int
    num_pages: int
    kv_item_lens: tuple[int, ...]
    aux_item_lens: tuple[int, ...]
    aux: bool


class KVReadyEvent(Exchange):
    """The answer to a `KVReceiveRequest` once the prefill has sent every page of `room`.

    `ref` is one uint8 tensor: for each KV buffer in order its `num_pages` pages, then (when
    asked for) the aux row of each aux buffer in order. It lives under a lease as long as
    the transfer's timeout; the decode side answers with a `KVDoneRequest`."""

    room: int
    num_pages: int
    ref: TensorRef


class KVFailedEvent(Exchange):
    room: int
    reason: str


class KVStatusRequest(Exchange):
    room: int


class KVStatusReply(Exchange):
    """`alive` is False when the prefill holds no live transfer for `room` (never had one,
    failed, aborted or cleared): the decode side fails at once instead of waiting."""

    room: int
    alive: bool
    reason: str = ""


class KVDoneRequest(Exchange):
    """The decode side has written `room`'s pages (`ok`) or given up on them."""

    room: int
    ok: bool
    reason: str = ""


class KVDoneReply(Exchange):
    pass


BootstrapMessage = (
    BootstrapRegisterRequest | BootstrapRegisterReply | BootstrapLookupRequest | BootstrapLookupReply
)

TransferMessage = (
    BootstrapRegisterReply
    | BootstrapLookupReply
    | KVReceiveRequest
    | KVReadyEvent
    | KVFailedEvent
    | KVStatusRequest
    | KVStatusReply
    | KVDoneRequest
    | KVDoneReply
)
