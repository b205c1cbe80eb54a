"""Wire messages of the Data Flow transfer plane, and nothing else.

Every message is a `Tagged` struct (tag field `"type"`, tag value = class name), and every
message of one request an `Exchange`, which carries its `request_id`; all are encoded as
msgpack by `engine.data.codec`. Tensor bytes never travel inside a message:
they follow it as raw ZeroMQ frames, described by a `TensorHeader`.

A connection is a ZeroMQ DEALER (client) talking to a ROUTER (the owner of a tensor
store). Its first message must be a `HelloRequest` carrying `PROTOCOL_VERSION`; anything
else is answered with an `ErrorReply`. Then, per request id:

    PullRequest   -> PullReply (+1 raw frame when transport is INLINE)
                     | ErrorReply
    ChunkRequest  -> ChunkReply + 1 or more raw frames (TCP transport, one reply per chunk;
                     several frames when the owner sends the chunk from several buffers)
    LeaseRequest  -> LeaseReply        ReleaseRequest -> ReleaseReply
    StatsRequest  -> StatsReply        PingRequest    -> PingReply
    KVFetchRequest -> KVFetchReply     (only owners that serve a KV cache; see below)
                     | ErrorReply

On the authenticated plane a TCP pull may move its bytes over the owner's bulk channel
(`engine.data.bulk`): a `PullRequest` with `bulk` set gets a `PullReply` carrying a
`BulkGrant`, and the chunks are asked of the grant's address, another socket that speaks
only `BulkMessage`:

    BulkChunkRequest -> BulkChunkReply + 1 or more raw frames | ErrorReply (REFUSED: no valid grant)

The same messages serve role workers (`WorkerMessage`), over ZeroMQ or, within one network
namespace, a length-prefixed Unix stream (`engine.data.framed`): after the hello, the executor's
dispatcher sends `ExecuteRequest`s and the worker answers each with `ExecuteStarted`,
any number of `ExecuteProgress`/`ExecuteFrame`, then `ExecuteResult` or `ExecuteFailed`.
`CancelRequest` stops one; `InputFrame`/`InputEnd` feed a stream-mode input port. Stream
frames flow under credit (`engine.data.credit`): a request's `window` bounds the frames
either side sends ahead of the other's `FrameCredit` (output frames) or `InputCredit` (the
frames of one input port).
Node values travel as `PortValue`s: small msgpack-native values inline, tensors as refs, an llm
node's `KVRef` as itself (kind `KV`).

Bump `PROTOCOL_VERSION` on any incompatible change to a message below.
"""

from __future__ import annotations

import enum
from typing import NewType

import msgspec

from engine.spec.calls import CallHeader

PROTOCOL_VERSION = 6  # 4: a chunk may come in several frames; a node call's header is one struct;
# 5: an llm node's kv value travels as itself (`ValueKind.KV`); 6: a call carries its run's owner
# (`CallHeader.owner`: a worker that dropped it would write a run's files outside the owner's folder)

RefId = NewType("RefId", str)


class ErrorCode(enum.IntEnum):
    MALFORMED = 1  # not msgpack, wrong frame count, bad field types
    UNKNOWN_MESSAGE = 2  # a tag this version does not know
    OVERSIZED = 3  # a frame or a requested range above the peer's limits
    VERSION_MISMATCH = 4
    HANDSHAKE_REQUIRED = 5  # a request before HelloRequest on this connection
    NOT_FOUND = 6  # unknown ref id, or its lease expired / it was released
    BAD_REQUEST = 7  # well-formed but invalid (range outside the tensor, ...)
    UNSUPPORTED = 8  # no transport both sides accept (e.g. CUDA IPC from a host without CUDA)
    INTERNAL = 9
    DRAINING = 10  # the worker is shutting down and takes no new work
    WRONG_ROLE = 11  # the worker does not host the requested role
    REFUSED = 12  # the bulk channel admits no request without a live grant for its ref and range


class Transport(enum.StrEnum):
    INLINE = "inline"  # bytes in the reply's single raw frame (small tensors)
    SHM = "shm"  # consumer maps the owner's shared-memory segment (same host)
    TCP = "tcp"  # chunked raw frames over the ZeroMQ connection
    CUDA_IPC = "cuda_ipc"  # a CUDA tensor opened by a consumer on the owner's host (see CudaIpcHandle)
    LOCAL = "local"  # owner in the same process (never sent; marks in-process reads)


class TensorHeader(msgspec.Struct, frozen=True, array_like=True):
    """How to read raw bytes as a tensor.

    `strides` are in elements (torch convention), `offset` in bytes from the start of the
    buffer the header describes. Version 1 only ever sends C-contiguous tensors.
    """

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    nbytes: int
    offset: int = 0


class ShmLocation(msgspec.Struct, frozen=True, array_like=True):
    """Where a tensor sits in its owner's shared-memory segment, for consumers on its host.

    The segment's first 8 bytes hold the generation of the ref occupying it (0: none); a
    consumer that maps `segment` and reads `generation` there may read the tensor at
    `offset` without asking the owner. Any mismatch means: ask the owner (PullRequest)."""

    segment: str
    size: int
    offset: int
    generation: int


class CudaIpcHandle(msgspec.Struct, frozen=True, array_like=True):
    """A CUDA allocation shared with one consumer on the owner's host: torch's IPC memory handle
    of the block, the storage's place in it, and the shared reference counter (file and slot)
    that keeps the owner's block alive until the consumer's mapping is freed. Each handle
    counts one reference: the consumer opens it, or gives it back (`engine.data.cuda_ipc`)."""

    device: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


class TensorRef(msgspec.Struct, frozen=True):
    """A handle on a tensor kept by its producer's store; the executor passes these, never bytes.

    `owner` is the store's ZeroMQ address, `host` identifies the owner's machine (same host ->
    shared memory is tried first), `lease_expires_at` is a UNIX time after which the owner
    may drop the tensor unless the lease is extended. `device` is where the producer held
    it (a CUDA tensor stays there, served by CUDA IPC to consumers on its host and staged to
    host memory for the others, when one asks); `shm` lets a consumer
    on the same host read it without a round trip.
    """

    owner: str
    id: RefId
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    lease_expires_at: float
    host: str
    device: str = "cpu"
    shm: ShmLocation | None = None


class Tagged(msgspec.Struct, tag=True, tag_field="type", frozen=True):
    """A message: frozen, tagged with its class name in field `"type"` (subclasses inherit both)."""


class Exchange(Tagged):
    """A message of one request: the request and every answer to it carry its `request_id`."""

    request_id: int


class HelloRequest(Tagged):
    protocol_version: int
    peer: str
    host: str


class HelloReply(Tagged):
    protocol_version: int
    server: str
    host: str
    max_chunk_bytes: int
    max_request_bytes: int


class PullRequest(Exchange):
    """Ask for a ref's bytes; `transports` lists what the client accepts, best first. `bulk`:
    the client would take TCP bytes over the owner's bulk channel (`engine.data.bulk`)."""

    ref_id: RefId
    transports: tuple[Transport, ...]
    bulk: bool = False


class BulkGrant(msgspec.Struct, frozen=True, array_like=True):
    """The right to read one ref's bytes once over its owner's bulk channel, given in a
    `PullReply` on the CURVE connection and never sent in clear: `token` (16 random bytes)
    names the grant in each `BulkChunkRequest`; `key` (32 random bytes, or empty: no MACs)
    keys the chunks' MACs."""

    address: str
    token: bytes
    key: bytes


class PullReply(Exchange):
    """How to read the ref. SHM: map `segment` (`segment_size` bytes) and read at
    `header.offset`; TCP: fetch `header.nbytes` with ChunkRequests; INLINE: one raw frame
    follows; CUDA_IPC: open `cuda` and read at `header.offset`."""

    ref_id: RefId
    transport: Transport
    header: TensorHeader
    lease_expires_at: float
    segment: str | None = None
    segment_size: int = 0
    cuda: CudaIpcHandle | None = None
    """CUDA_IPC: the storage to open; `header.offset` is the tensor's byte offset in it."""
    bulk: BulkGrant | None = None
    """TCP, when the request asked for it and the owner has a bulk channel: ask the chunks of
    `bulk.address` with BulkChunkRequests instead of ChunkRequests on this connection."""


class ChunkRequest(Exchange):
    ref_id: RefId
    offset: int
    length: int


class ChunkReply(Exchange):
    """Followed by raw frames of `length` bytes in all (one, or one per buffer they come from)."""

    offset: int
    length: int


class LeaseRequest(Exchange):
    ref_id: RefId
    seconds: float


class LeaseReply(Exchange):
    lease_expires_at: float


class ReleaseRequest(Exchange):
    ref_id: RefId


class ReleaseReply(Exchange):
    released: bool


class StatsRequest(Exchange):
    pass


class StatsReply(Exchange):
    live_refs: int
    live_bytes: int
    segments: int
    pooled_segments: int
    pooled_bytes: int


class PingRequest(Exchange):
    pass


class PingReply(Exchange):
    pass


class KVFetchRequest(Exchange):
    """Ask a worker for KV cache pages, in chain order. `pages` are page keys (hex SHA-256,
    `engine.data.kv.keys.PageHash`); `layout` is the asker's `KVLayout.fingerprint()`: a holder
    with another layout refuses with BAD_REQUEST rather than hand out pages of another shape.
    `bulk`: the asker will pull the reply's ref over TCP and takes a bulk grant in the reply.
    `tcp`: the asker will pull the reply's ref over TCP (another host, or forced), so the holder
    may serve the pages from its own slots rather than copy them into shared memory (implied
    by `bulk`)."""

    pages: tuple[str, ...]
    layout: str
    bulk: bool = False
    tcp: bool = False


class KVFetchReply(Exchange):
    """The pages the holder hands out: always the longest leading run of the request's pages
    that it holds intact (a page after a gap is useless to a prefix cache), so `found` is a
    prefix of the request's `pages`. `ref` names them stacked as one tensor
    `[len(found), *page_shape]` in the holder's tensor store, under a short lease; pull it like
    any ref, then release it. `ref` is None when `found` is empty. `bulk`: asked for, and the
    holder has a bulk channel: a one-time grant to read `ref` there (as a `PullReply` would give),
    so the asker asks for the chunks at once. `lent`: `ref` reads the pages in the holder's own
    slots (no copy there), so the asker may ask for the rest of its run at once."""

    found: tuple[str, ...]
    ref: TensorRef | None = None
    bulk: BulkGrant | None = None
    lent: bool = False


class BulkChunkRequest(Exchange):
    """A range of a granted ref, asked of the owner's bulk channel (`engine.data.bulk`)."""

    token: bytes
    ref_id: RefId
    offset: int
    length: int


class BulkChunkReply(Exchange):
    """Followed by raw frames of `length` bytes in all (one, or one per buffer they come from);
    `tag` is their MAC under the grant's key (`engine.data.bulk.parts_tag`), empty when the
    grant has none."""

    offset: int
    length: int
    tag: bytes


class ErrorReply(Tagged):
    """The answer to any request that cannot be served; `request_id` is None when the
    request was too broken to read one."""

    request_id: int | None
    code: ErrorCode
    message: str


Message = (
    HelloRequest
    | HelloReply
    | PullRequest
    | PullReply
    | ChunkRequest
    | ChunkReply
    | LeaseRequest
    | LeaseReply
    | ReleaseRequest
    | ReleaseReply
    | StatsRequest
    | StatsReply
    | PingRequest
    | PingReply
    | KVFetchRequest
    | KVFetchReply
    | ErrorReply
)

BulkMessage = BulkChunkRequest | BulkChunkReply | ErrorReply
"""What the bulk channel carries: nothing else is read there."""


# --- role workers ----------------------------------------------------------------------------


class ValueKind(enum.StrEnum):
    INLINE = "inline"  # `data` is the value itself (msgpack-native: None, bool, numbers, str, bytes, lists, maps)
    TENSOR = "tensor"  # `ref` names a tensor in its producer's store; consumers pull it
    BLOB = "blob"  # `ref` names a uint8 tensor holding a large bytes value
    STREAM = "stream"  # frames follow as InputFrame messages for this port, then InputEnd
    KV = "kv"  # `data` is an `engine.data.kv.ref.KVRef` (a msgpack map), decoded back into one


class PortValue(msgspec.Struct, frozen=True, omit_defaults=True):
    kind: ValueKind
    data: object = None
    ref: TensorRef | None = None


class ExecuteRequest(Exchange):
    """Run one node execution of `role` on this worker: the call's header as it is
    (`engine.spec.calls.CallHeader`, its tenant included: the worker's unit namespaces its caches
    by it; and its owner: the worker resolves the node's output folder names under its own users
    root) and its input values as `PortValue`s."""

    role: str
    call: CallHeader
    inputs: dict[str, PortValue]
    window: int = 0
    """Stream frames a side may send ahead of the other's credit: output frames of a stream
    node, and the frames of each stream-mode input port. 0: no limit."""


class ExecuteStarted(Exchange):
    worker_id: str


class ExecuteProgress(Exchange):
    progress: float | None
    message: str


class ExecuteFrame(Exchange):
    index: int
    outputs: dict[str, PortValue]


class ExecuteResult(Exchange):
    outputs: dict[str, PortValue]
    route: tuple[str, ...] | None = None


class ExecuteFailed(Exchange):
    """The node's own code failed (`error` is its exception, rendered); not a transport error."""

    error: str
    retryable: bool = True


class CancelRequest(Exchange):
    pass


class InputFrame(Exchange):
    port: str
    value: PortValue


class InputEnd(Exchange):
    port: str


class FrameCredit(Exchange):
    """Executor to worker: the executor took `frames` more output frames of a stream node;
    the worker may send that many more."""

    frames: int


class InputCredit(Exchange):
    """Worker to executor: `frames` more frames of stream input `port` may be sent (the node
    took them, or it waits on another port and this one must not hold the sender back)."""

    port: str
    frames: int


class LoadRequest(Exchange):
    """Asked of a worker's liveness endpoint: its current load, as a heartbeat carries it."""


class LoadReply(Exchange):
    outstanding: int
    queue_depth: int
    busy: bool
    metrics: dict[str, float]


WorkerMessage = (
    HelloRequest
    | HelloReply
    | PingRequest
    | PingReply
    | LoadRequest
    | LoadReply
    | ErrorReply
    | ExecuteRequest
    | ExecuteStarted
    | ExecuteProgress
    | ExecuteFrame
    | ExecuteResult
    | ExecuteFailed
    | CancelRequest
    | InputFrame
    | InputEnd
    | FrameCredit
    | InputCredit
)
