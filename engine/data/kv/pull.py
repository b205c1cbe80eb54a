"""Cross-worker KV page pulls: a worker fetches the pages it lacks straight from the worker
that holds them, over the transfer plane (shared memory on one host, ZeroMQ across hosts).

    KVPageServer(store, peer.server)                        # every worker: serve its pages
    result = pull_missing(store, peer, index, pages, 2.0)   # find a holder in Redis, fetch
    result = fetch_pages(store, peer, address, pages, 2.0)  # or fetch from a known holder

One fetch is one `KVFetchRequest` -> `KVFetchReply` round trip to the holder's
`TensorServer`, then an ordinary pull of the reply's ref (across hosts on a plane with bulk
channels, the reply carries the one-time bulk grant a `PullRequest` would have got, so the
chunks are asked at once: `engine.data.bulk`). The holder answers with the
longest leading run of the asked pages that it holds intact (a page after a gap is useless
to a prefix cache), read where they are (serving a peer does not reshuffle its tiers). For a
puller on the same host they are copied into one `[n, *page_shape]` buffer of the holder's
tensor store, in shared memory once it is larger than the store's inline limit, which the
puller maps and copies each page from once, into its own store. Across hosts (or with
`transport=Transport.TCP`) the holder copies nothing where it can: the ref reads the pages in
their slots (`KVStore.lend`, pinned until the ref is freed), and the bytes come as ZeroMQ
frames of whole pages (chunks of whole pages, `CHUNK_BYTES` or so, a frame per run of adjacent slots),
each put into the store straight from the received frame as it arrives, while the next ones
are on the wire (`Peer.pull_to`): one copy in all, on the puller's side. The puller then
releases the ref; its short lease frees it anyway if the puller dies first.

Every fetch has a deadline and ends by it: a dead or silent holder, a refusal (another
layout) or a reply that describes other pages raise `KVTransferError`, and the store's pull
metrics (`KVStore.record_pull`) count pages, bytes, seconds and failures.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.data.channel import Transfer, TransferError
from engine.data.codec import TensorData
from engine.data.kv.errors import KVTransferError
from engine.data.kv.keys import PageHash
from engine.data.kv.store import KVStore
from engine.data.server import RequestRefused, TensorServer
from engine.data.wire import ErrorCode, KVFetchReply, KVFetchRequest, ReleaseRequest, TensorRef, Transport

if TYPE_CHECKING:
    from engine.data.kv.index import WorkerPrefix
    from engine.data.peer import Peer

log = logging.getLogger(__name__)

# Page keys per request: 256 keys are ~17 KiB of msgpack, well inside the default 64 KiB request
# limit, and bound how long one request holds the holder's serving thread.
MAX_PAGES_PER_REQUEST = 256
FIRST_BATCH_BYTES = 8 << 20
BATCH_BYTES = 16 << 20
"""A run of pages is asked for in requests of about this many bytes (at least a page, at most
`max_pages`; the first of about `FIRST_BATCH_BYTES`, so that bytes move while the holder gathers
the rest; once the holder lends its pages in place, the rest at once: `_Batches`), each asked
for while the one before is on the wire."""
CHUNK_BYTES = 2 << 20
"""TCP chunks of a pull are about this big (rounded down to whole pages, at least one; at most the
client's `chunk_bytes`), with as many bytes asked ahead as a tensor pull's larger chunks
(`ZmqClient._chunks`): the puller stores each page while the next ones travel, and the last
chunk, stored with nothing left on the wire, is small (`omniflow bench hosts`: `kv_auth_vs_raw`)."""
REPLY_LEASE_S = 10.0  # the puller releases at once; the lease only bounds a puller that died
RELEASE_TIMEOUT_S = 5.0


# --- the holder ----------------------------------------------------------------------------------


class KVPageServer:
    """Answers `KVFetchRequest`s on `server` from `store`: the pages another worker lacks.

    Registers itself as the server's handler on construction; `close()` unregisters it (the
    store and the server stay open: they belong to the worker). Serving runs on the server's
    thread (see `TensorServer.register_handler`). To a puller that takes the bytes over TCP
    (`KVFetchRequest.bulk` or `tcp`), pages held in host memory are lent (`KVStore.lend`): the
    reply's ref reads them in their slots, sent as one frame per run of adjacent slots, and
    they stay pinned (not evicted, their slots not reused) until the ref is released or its
    lease ends and no send reads them. Otherwise (a puller on this host, pages on a GPU or the
    disk) they are copied into one buffer, which holds the thread for that copy. Does not
    promote or otherwise move pages; counts one lookup and one read per page served in the
    store's tier metrics.
    """

    def __init__(
        self,
        store: KVStore,
        server: TensorServer,
        *,
        lease_s: float = REPLY_LEASE_S,
        max_pages: int = MAX_PAGES_PER_REQUEST,
    ) -> None:
        if lease_s <= 0 or max_pages <= 0:
            raise ValueError("lease_s and max_pages must be positive")
        self.store = store
        self.server = server
        self.lease_s = lease_s
        self.max_pages = max_pages
        self._fingerprint = store.layout.fingerprint()
        self._inline_max = server.store.config.inline_max_bytes
        server.register_handler(KVFetchRequest, self.serve)

    def serve(self, request: KVFetchRequest) -> KVFetchReply:
        """The leading run of `request.pages` this store holds, as one ref (None if no page)."""
        if request.layout != self._fingerprint:
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                f"KV layout mismatch: this worker holds {self._fingerprint} pages, asked for {request.layout}",
            )
        if len(request.pages) > self.max_pages:
            raise RequestRefused(
                ErrorCode.OVERSIZED, f"{len(request.pages)} pages asked, at most {self.max_pages} per request"
            )
        pages = [PageHash(page) for page in request.pages]
        held = self.store.resident_run(pages)
        if held == 0:
            return KVFetchReply(request.request_id, ())
        ref = None
        if (request.bulk or request.tcp) and held * self.store.layout.page_nbytes > self._inline_max:
            ref = self._lend(pages[:held])
        lent = ref is not None
        read = held
        if ref is None:
            ref, read = self._gather(pages[:held])
        grant = self.server.grant_bulk(ref) if request.bulk and ref is not None else None
        return KVFetchReply(request.request_id, request.pages[:read], ref, grant, lent)

    def _lend(self, pages: list[PageHash]) -> TensorRef | None:
        """The pages as a ref over their own slots (TCP pullers: no copy here); None unless all
        of them are in host memory (a GPU's or the disk's must be copied: `_gather`)."""
        loan = self.store.lend(pages)
        if loan is None:
            return None
        layout = self.store.layout
        lent = None
        try:
            lent = self.server.store.lend(layout.dtype, (len(pages), *layout.page_shape), loan.runs, loan.release,
                                          self.lease_s)
        finally:
            if lent is None:  # the tensor store took no hold of the loan: give the pages back now
                loan.release()
        return lent

    def _gather(self, pages: list[PageHash]) -> tuple[TensorRef | None, int]:
        """The leading run of `pages` still held, copied into one buffer of the tensor store (in
        shared memory when large, for pullers on this host): its ref and length."""
        layout = self.store.layout
        tensors = self.server.store
        held = len(pages)
        reservation = tensors.reserve((held, *layout.page_shape), layout.dtype)
        ref: TensorRef | None = None
        read = 0
        try:
            buffer = reservation.torch()
            # The worker's compute may evict a page between `contains` and here: stop there.
            while read < held and self.store.get(pages[read], out=buffer[read], promote=False) is not None:
                read += 1
            if read == held:
                ref = tensors.commit(reservation, self.lease_s)
            elif read:
                ref = tensors.put(buffer[:read], self.lease_s)
        finally:
            if not reservation.committed:
                tensors.abort(reservation)
        return ref, read

    def close(self) -> None:
        """Stop serving pages (later requests are refused as UNSUPPORTED)."""
        self.server.unregister_handler(KVFetchRequest)


# --- the puller ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PullResult:
    """What a pull brought into the local store.

    `pages` are the pages fetched, in order: a leading run of those asked (empty when the
    holder had none, or nobody did). `holder` is the address they came from and `worker_id`
    its id in the index (`pull_missing` only). `transports` holds how each request's bytes
    came (SHM, TCP, INLINE for small replies, LOCAL from this very process). `local_pages` is
    how many leading pages the local store held already (`pull_missing` only).
    """

    pages: tuple[PageHash, ...]
    holder: str | None
    nbytes: int
    seconds: float
    transports: tuple[Transport, ...] = ()
    worker_id: str | None = None
    local_pages: int = 0


@dataclass(frozen=True, slots=True)
class HolderChoice:
    """The worker to pull from: the one holding the longest run, fastest tiers first."""

    worker_id: str
    address: str
    pages: int


class KVHolderIndex(Protocol):
    """What `pull_missing` needs of the distributed index (`RedisKVIndex` provides it)."""

    def lookup_detailed(self, pages: Sequence[PageHash]) -> Mapping[str, WorkerPrefix]: ...

    def alive_workers(self) -> Mapping[str, str]: ...


def choose_holder(
    prefixes: Mapping[str, WorkerPrefix], addresses: Mapping[str, str], exclude: str | None = None
) -> HolderChoice | None:
    """The live worker with an address (other than `exclude`, this worker's own) that holds the
    longest run; ties go to the faster tiers (device before host before disk), then to the
    lowest worker id. None when no worker qualifies."""
    candidates = [
        prefix
        for worker, prefix in prefixes.items()
        if prefix.pages > 0 and addresses.get(worker) and addresses[worker] != exclude
    ]
    if not candidates:
        return None
    best = min(candidates, key=lambda p: (-p.pages, sum(int(t) for t in p.tiers), p.worker_id))
    return HolderChoice(best.worker_id, addresses[best.worker_id], best.pages)


def fetch_pages(
    store: KVStore,
    peer: Peer,
    holder: str,
    pages: Sequence[PageHash],
    timeout: float,
    *,
    transport: Transport | None = None,
    max_pages: int = MAX_PAGES_PER_REQUEST,
) -> PullResult:
    """Fetch `pages` (in chain order) from the worker serving them at `holder` into `store`.

    Brings the longest leading run of `pages` the holder has (possibly none: not an error),
    in requests of at most `max_pages`, and returns by `timeout` seconds or raises
    `KVTransferError` (holder dead or silent, layout mismatch, a reply that describes other
    pages). Pages stored before a failure stay in the store. `transport` None takes the
    cheapest channel (this process, this host's shared memory, then TCP); `Transport.TCP`
    forces ZeroMQ frames even on one host, `Transport.SHM` refuses anything else.
    Local errors of the store (e.g. `KVCapacityError`: every device page locked) pass through.
    """
    if timeout <= 0 or max_pages <= 0:
        raise ValueError("timeout and max_pages must be positive")
    if transport not in (None, Transport.SHM, Transport.TCP):
        raise ValueError(f"transport must be None, SHM or TCP, got {transport}")
    started = time.perf_counter()
    deadline = time.monotonic() + timeout
    fetched: list[PageHash] = []
    used: list[Transport] = []
    paths: Counter[str] = Counter()
    pulled = False
    try:
        try:
            batches = _Batches(pages, store.layout.page_nbytes, max_pages)
            if batches.left:
                _fetch_run(store, peer, holder, batches, deadline, transport, fetched, used, paths)
        except TransferError as exc:
            raise KVTransferError(f"pulling KV pages from {holder} failed: {exc}") from exc
        pulled = True
    finally:
        if not pulled:  # any failure, cancellation included: the pages stored so far, then a failed pull
            seconds = time.perf_counter() - started
            if fetched:
                store.record_pull(len(fetched), len(fetched) * store.layout.page_nbytes, 0.0, paths=paths)
            store.record_pull(0, 0, seconds, failed=True)
    seconds = time.perf_counter() - started
    nbytes = len(fetched) * store.layout.page_nbytes
    store.record_pull(len(fetched), nbytes, seconds, paths=paths)
    log.debug("pulled %d KV pages (%d bytes) from %s in %.4fs", len(fetched), nbytes, holder, seconds)
    return PullResult(tuple(fetched), holder, nbytes, seconds, tuple(used))


def pull_missing(
    store: KVStore,
    peer: Peer,
    index: KVHolderIndex,
    pages: Sequence[PageHash],
    timeout: float,
    *,
    transport: Transport | None = None,
    max_pages: int = MAX_PAGES_PER_REQUEST,
) -> PullResult:
    """Complete the local run of `pages` from the worker that holds most of the rest.

    The pages after the local store's leading run are looked up in the index; the live worker
    holding the longest run of them (see `choose_holder`) is asked for that run with
    `fetch_pages`. Returns an empty result (`holder` None) when no other worker holds the next
    page. `timeout` covers the index calls too (each also bounded by the index client's socket
    timeout); index failures raise `KVIndexError`, transfer failures `KVTransferError`.
    """
    if timeout <= 0:
        raise ValueError("timeout must be positive")
    started = time.perf_counter()
    deadline = time.monotonic() + timeout
    local = store.lookup(pages).prefix_pages
    missing = list(pages[local:])
    choice = None
    if missing:
        choice = choose_holder(index.lookup_detailed(missing), index.alive_workers(), exclude=peer.address)
    if choice is None:
        return PullResult((), None, 0, time.perf_counter() - started, local_pages=local)
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        store.record_pull(0, 0, time.perf_counter() - started, failed=True)
        raise KVTransferError(f"the index lookup used up the {timeout}s timeout of a KV pull")
    result = fetch_pages(
        store,
        peer,
        choice.address,
        missing[: choice.pages],
        remaining,
        transport=transport,
        max_pages=max_pages,
    )
    return dataclasses.replace(
        result, worker_id=choice.worker_id, local_pages=local, seconds=time.perf_counter() - started
    )


def _remaining(deadline: float, holder: str) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise KVTransferError(f"KV pull from {holder} timed out")
    return remaining


@dataclass(slots=True)
class _Batches:
    """A run of pages cut into requests: the first of about `FIRST_BATCH_BYTES`, each next one of
    about `BATCH_BYTES` while the holder copies the pages it serves (bytes move while it gathers
    the next), or the rest (up to `max_pages`) once it lends them in place: nothing to gather,
    and a request less is one wait less between the end of one pull and the start of the next."""

    pages: Sequence[PageHash]
    page_nbytes: int
    max_pages: int
    taken: int = 0

    @property
    def left(self) -> int:
        return len(self.pages) - self.taken

    def take(self, *, lent: bool | None) -> tuple[PageHash, ...]:
        """The next request's pages; `lent`: whether the holder lent the last one (None: first)."""
        size = FIRST_BATCH_BYTES if lent is None else BATCH_BYTES
        step = self.max_pages if lent else max(1, min(self.max_pages, size // self.page_nbytes))
        batch = tuple(self.pages[self.taken : self.taken + step])
        self.taken += len(batch)
        return batch


def _ask(peer: Peer, holder: str, batch: tuple[PageHash, ...], fingerprint: str, tcp: bool,
         deadline: float) -> Transfer:
    """Ask `holder` for `batch` on the client's I/O thread: the answer comes while this thread
    pulls the batch before."""
    return peer.client.call(holder, lambda rid: _request(rid, peer, batch, fingerprint, tcp),
                            _remaining(deadline, holder))


def _request(request_id: int, peer: Peer, batch: tuple[PageHash, ...], fingerprint: str,
             tcp: bool) -> KVFetchRequest:
    """`tcp`: the bytes will come over TCP; then a plane with bulk channels takes a bulk grant
    with the pages."""
    return KVFetchRequest(request_id, batch, fingerprint, bulk=tcp and peer.client.bulk_mode is not None, tcp=tcp)


def _over_tcp(peer: Peer, transport: Transport | None, holder_host: str | None) -> bool:
    """Whether the bytes will come over TCP: forced, or the holder is known to be on another host."""
    if transport is Transport.SHM:
        return False
    return transport is Transport.TCP or (holder_host is not None and holder_host != peer.host)


def _fetch_run(
    store: KVStore,
    peer: Peer,
    holder: str,
    batches: _Batches,
    deadline: float,
    transport: Transport | None,
    fetched: list[PageHash],
    used: list[Transport],
    paths: Counter[str],
) -> None:
    """Pull `batches` in order into `store` until the holder's run ends, each batch asked for
    while the one before is on the wire: the holder gathers batch n + 1 into its reply buffer
    (or lends it) while the bytes of batch n travel, and this side stores them. An answer left
    unused by a failure is freed by its lease (`REPLY_LEASE_S`)."""
    layout = store.layout
    fingerprint = layout.fingerprint()
    chunk = max(1, CHUNK_BYTES // layout.page_nbytes) * layout.page_nbytes
    batch = batches.take(lent=None)
    tcp = _over_tcp(peer, transport, peer.client.owner_host(holder))
    reply = peer.client.request(holder, lambda rid: _request(rid, peer, batch, fingerprint, tcp),
                                _remaining(deadline, holder))
    while True:
        if not isinstance(reply, KVFetchReply) or reply.found != batch[: len(reply.found)]:
            raise KVTransferError(f"{holder} answered a KV fetch with other pages than a prefix of those asked")
        found = batch[: len(reply.found)]
        if not found:
            return
        ref = reply.ref
        if ref is None or ref.dtype != layout.dtype or tuple(ref.shape) != (len(found), *layout.page_shape):
            raise KVTransferError(f"{holder} described {len(found)} pages of layout {fingerprint} wrongly: {ref}")
        following = batches.take(lent=reply.lent) if len(found) == len(batch) and batches.left else None
        tcp = _over_tcp(peer, transport, ref.host)
        asked: list[Transfer] = []

        def ask_next(following: tuple[PageHash, ...] | None = following, asked: list[Transfer] = asked,
                     tcp: bool = tcp) -> None:
            if following is not None and not asked:
                asked.append(_ask(peer, holder, following, fingerprint, tcp, deadline))

        try:
            timeout = _remaining(deadline, holder)
            sink = _PageSink(store, found, ask_next)
            if transport is Transport.SHM:
                data: TensorData | None = peer.shm.fetch(ref, timeout)
            elif reply.bulk is not None:  # granted with the pages: the chunks are asked at once
                data = peer.pull_granted(ref, reply.bulk, timeout, sink, align=layout.page_nbytes, chunk_bytes=chunk)
            else:  # TCP chunks go straight into the store, page by page, as they arrive
                data = peer.pull_to(ref, timeout, sink, align=layout.page_nbytes, tcp=transport is Transport.TCP,
                                    chunk_bytes=chunk)
            ask_next()
            if data is not None:
                store.put_many(found, data.torch())  # copies: a shared-memory view is the holder's
        finally:
            _release(peer, ref)
        how = Transport.TCP if data is None else data.transport
        fetched.extend(found)
        used.append(how)
        paths[how.value] += len(found)
        if not asked or following is None:
            return  # the holder's run ends here, or every batch came
        reply = asked[0].wait(_remaining(deadline, holder))
        batch = following


class _PageSink:
    """Puts the pages of a TCP pull's chunks into `store` as they arrive: a page wholly inside a
    chunk straight from the received frame (its only copy on this side); the pieces of a page
    split over chunks (an owner whose chunk limit is not a multiple of a page) are gathered first."""

    def __init__(self, store: KVStore, pages: tuple[PageHash, ...], first: Callable[[], None]) -> None:
        """`first` is called when the first bytes arrive (before they are stored)."""
        self._store = store
        self._pages = pages
        self._first: Callable[[], None] | None = first
        self._size = store.layout.page_nbytes
        self._partial: dict[int, tuple[torch.Tensor, list[int]]] = {}

    def __call__(self, offset: int, data: memoryview) -> None:
        if self._first is not None:
            first, self._first = self._first, None
            first()
        size, end = self._size, offset + len(data)
        for index in range(offset // size, (end - 1) // size + 1):
            lo, hi = max(offset, index * size), min(end, (index + 1) * size)
            piece = torch.frombuffer(data, dtype=torch.uint8, count=hi - lo, offset=lo - offset)
            if hi - lo == size:
                self._store.put(self._pages[index], piece)
                continue
            page, filled = self._partial.setdefault(index, (torch.empty(size, dtype=torch.uint8), [0]))
            page[lo - index * size : hi - index * size] = piece
            filled[0] += hi - lo
            if filled[0] == size:
                del self._partial[index]
                self._store.put(self._pages[index], page)


def _release(peer: Peer, ref: TensorRef) -> None:
    """Free the reply's buffer at the holder without waiting for the answer (its lease frees it
    anyway): requests on one connection are served in order, so a later request to the holder
    from this client's I/O thread finds it released."""
    if ref.owner == peer.address:
        peer.store.release(ref.id)
        return
    peer.client.call(ref.owner, lambda rid: ReleaseRequest(rid, ref.id), RELEASE_TIMEOUT_S)
