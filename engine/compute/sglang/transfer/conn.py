"""The sender (prefill side) and receiver (decode side) of one request's KV."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import (
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)

from engine.compute.sglang.transfer.config import KVTransferConfigError, KVTransferError
from engine.compute.sglang.transfer.manager import OmniFlowKVManager
from engine.data.channel import TransferState


class OmniFlowKVSender(BaseKVSender):
    """The prefill side of one request (room)."""

    def __init__(self, mgr: BaseKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        if not isinstance(mgr, OmniFlowKVManager):
            raise KVTransferConfigError(f"an omniflow sender needs an omniflow manager, not {type(mgr).__name__}")
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self._rooms = mgr.prefill_rooms()
        self._outgoing = self._rooms.open(self.bootstrap_room)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self._outgoing.num_pages = int(num_kv_indices)
        self._outgoing.aux_index = aux_index

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # A zero-page last chunk still completes the transfer.
        return num_pages > 0 or last_chunk

    def send(self, kv_indices: np.ndarray, state_indices: list | None = None, num_kv_tokens: int | None = None) -> None:
        outgoing = self._outgoing
        if outgoing.progress.done:
            return
        if state_indices:
            self._rooms.abort(outgoing, "state buffers (Mamba/SWA/DSA) are not supported by this backend")
            return
        if outgoing.num_pages is None:
            self._rooms.abort(outgoing, "send() before init()")
            return
        try:
            outgoing.chunks.append(self.kv_mgr.kv.gather(kv_indices))
        except KVTransferError as exc:
            self._rooms.abort(outgoing, str(exc))
            return
        outgoing.pages_sent += len(kv_indices)
        if outgoing.pages_sent < outgoing.num_pages:
            return
        # The payload is buffer after buffer (each buffer's pages of every chunk), then aux.
        parts = [part for buffer in zip(*outgoing.chunks, strict=True) for part in buffer]
        if outgoing.aux_index is not None:
            parts += self.kv_mgr.aux.gather(np.array([outgoing.aux_index]))
        outgoing.chunks = []
        self._rooms.complete(outgoing, torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8))

    def poll(self) -> int:
        failure = self.kv_mgr.check_alive()
        if failure is not None:
            self._outgoing.progress.fail(failure)
        return self._outgoing.progress.current()

    def failure_exception(self) -> None:
        raise KVTransferError(f"KV send of room {self.bootstrap_room} failed: {self._outgoing.progress.reason}")

    def get_transfer_metric(self) -> KVTransferMetric:
        outgoing = self._outgoing
        latency = None
        if outgoing.started is not None and outgoing.finished is not None:
            latency = outgoing.finished - outgoing.started
        return KVTransferMetric(transfer_latency_s=latency,
                                transfer_total_bytes=self.kv_mgr.kv.nbytes(outgoing.pages_sent))

    def abort(self) -> None:
        self._rooms.abort(self._outgoing, "aborted by the prefill scheduler")

    def clear(self) -> None:
        self._rooms.clear(self._outgoing)


class OmniFlowKVReceiver(BaseKVReceiver):
    """The decode side of one request (room)."""

    def __init__(self, mgr: BaseKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        if not isinstance(mgr, OmniFlowKVManager):
            raise KVTransferConfigError(f"an omniflow receiver needs an omniflow manager, not {type(mgr).__name__}")
        if bootstrap_room is None:
            raise KVTransferConfigError("an omniflow receiver needs a bootstrap room")
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        # Read by SGLang's decode scheduler (it expects its Common* receivers' fields).
        self.require_staging = False
        self.abort_notified = False
        self.bootstrap_infos: list[Any] = []
        self._rooms = mgr.decode_rooms()
        self._incoming = self._rooms.open(self.bootstrap_room, bootstrap_addr)

    @property
    def conclude_state(self) -> int | None:
        progress = self._incoming.progress
        return progress.state if progress.done else None

    def init(self, prefill_dp_rank: int) -> None:
        self._rooms.resolve(self._incoming, int(prefill_dp_rank or 0))

    def send_metadata(self, kv_indices: np.ndarray, aux_index: int | None = None, state_indices: list | None = None,
                      decode_prefix_len: int | None = None,
                      destination: KVTransferDestination = KVTransferDestination.DEVICE) -> None:
        if state_indices:
            self._rooms.abort(self._incoming, "state buffers (Mamba/SWA/DSA) are not supported by this backend")
            return
        if destination != KVTransferDestination.DEVICE or decode_prefix_len:
            self._rooms.abort(self._incoming, "only whole transfers to device pages are supported")
            return
        self._rooms.ask(self._incoming, kv_indices, aux_index)

    def poll(self) -> int:
        incoming = self._incoming
        failure = self.kv_mgr.check_alive()
        if failure is not None:
            incoming.progress.fail(failure)
        state = incoming.progress.current()
        transfer = incoming.transfer
        if state == KVPoll.Transferring and transfer is not None:
            pulled = transfer.poll()
            if pulled is TransferState.DONE:
                self._rooms.finish(incoming)
            elif pulled is TransferState.FAILED:
                self._rooms.abort(incoming, f"pulling the pages failed: {transfer.error}")
            state = incoming.progress.current()
        return state

    def failure_exception(self) -> None:
        raise KVTransferError(f"KV receive of room {self.bootstrap_room} failed: {self._incoming.progress.reason}")

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """The prefill learns of an abort through `KVDoneRequest`; nothing waits on an ack."""

    def abort(self) -> None:
        self._rooms.abort(self._incoming, "aborted by the decode scheduler")

    def clear(self) -> None:
        self._rooms.clear(self._incoming)
