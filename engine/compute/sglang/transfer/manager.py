"""The transfer manager of one scheduler (tp rank): the endpoints and buffers its side's rooms share."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import torch
import zmq
from sglang.srt.disaggregation.base.conn import BaseKVManager, KVArgs
from sglang.srt.disaggregation.utils import DisaggregationMode

from engine.compute.sglang.transfer.buffers import KVBuffers, kv_device
from engine.compute.sglang.transfer.config import (
    KVTransferConfigError,
    KVTransferError,
    TransferConfig,
    split_bootstrap_addr,
)
from engine.compute.sglang.transfer.dealers import Dealers
from engine.compute.sglang.transfer.decode import DecodeRooms
from engine.compute.sglang.transfer.loop import IOLoop
from engine.compute.sglang.transfer.messages import PrefillTopology
from engine.compute.sglang.transfer.prefill import PrefillRooms
from engine.compute.sglang.transfer.registration import BootstrapRegistration
from engine.data.peer import Peer, PeerConfig, ServerConfig

log = logging.getLogger(__name__)


class OmniFlowKVManager(BaseKVManager):
    """Owns a side's transfer endpoints: the I/O thread and its sockets, a `Peer` for the KV bytes,
    and the views of SGLang's KV and aux buffers. One per scheduler (tp rank).

    The rooms of its side do the work: `PrefillRooms` (with the rank's `BootstrapRegistration`)
    in prefill mode, `DecodeRooms` in decode mode; senders and receivers reach them through
    `prefill_rooms()` and `decode_rooms()`."""

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
        *,
        config: TransferConfig | None = None,
    ) -> None:
        self.kv_args = args
        self.mode = DisaggregationMode(disaggregation_mode)
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.config = config or TransferConfig.from_env()
        if self.mode not in (DisaggregationMode.PREFILL, DisaggregationMode.DECODE):
            raise KVTransferConfigError(f"no KV transfer in disaggregation mode {self.mode}")
        if int(getattr(args, "pp_rank", 0) or 0) != 0:
            raise KVTransferConfigError("the omniflow transfer backend supports pipeline parallel size 1 only")
        self.engine_rank = int(args.engine_rank)
        self.dp_rank = int(getattr(args, "system_dp_rank", 0) or 0)
        self.kv = KVBuffers.of(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens, kv_device(server_args, args))
        self.aux = KVBuffers.of(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens, torch.device("cpu"))
        self.peer = Peer(PeerConfig(server=ServerConfig(bind=f"tcp://{self.config.host}:0"),
                                    default_timeout_s=self.config.timeout_s))
        with contextlib.ExitStack() as undo:
            undo.callback(self.peer.close)
            self.loop = IOLoop(f"omniflow-kv-{self.mode.value}-{self.engine_rank}")
            undo.pop_all()
        self.prefill_info_table: dict[str, Any] = {}
        self._closed = False
        bootstraps = Dealers(self.loop)
        # Started by register_to_bootstrap (prefill only); a decode manager keeps it unset and unfailed.
        self.registration = BootstrapRegistration(self.loop, bootstraps, self.config.timeout_s)
        self.rooms: PrefillRooms | DecodeRooms
        if self.mode == DisaggregationMode.PREFILL:
            self.rooms = PrefillRooms(self.loop, self.peer, self.kv, self.aux, self.config, self.registration)
        else:
            self.rooms = DecodeRooms(self.loop, self.peer, self.kv, self.aux, self.config, self.engine_rank,
                                     bootstraps)
        ready = threading.Event()
        failed: list[zmq.ZMQError] = []
        self.loop.call(lambda: self._serve(ready, failed))
        with contextlib.ExitStack() as undo:
            undo.callback(self.close)  # SGLang drops a manager that failed to build: its thread and sockets end here
            if not ready.wait(self.config.timeout_s):
                raise KVTransferError("the KV transfer I/O thread did not start"
                                      + (f": {self.loop.failure!r}" if self.loop.failure is not None else ""))
            if failed:
                raise KVTransferConfigError(f"cannot open the control endpoint on {self.config.host}: {failed[0]}")
            if self.mode == DisaggregationMode.PREFILL:
                self.register_to_bootstrap()
            undo.pop_all()

    def _serve(self, ready: threading.Event, failed: list[zmq.ZMQError]) -> None:
        """Loop thread: start the rooms; a bind ZeroMQ refuses is put in `failed`, and `ready` set
        either way."""
        try:
            self.rooms.serve()
        except zmq.ZMQError as exc:
            failed.append(exc)
        ready.set()

    def prefill_rooms(self) -> PrefillRooms:
        """The rooms senders work on; KVTransferConfigError unless this is a prefill manager."""
        if not isinstance(self.rooms, PrefillRooms):
            raise KVTransferConfigError(f"only a prefill manager sends KV; this one is {self.mode.value}")
        return self.rooms

    def decode_rooms(self) -> DecodeRooms:
        """The rooms receivers work on; KVTransferConfigError unless this is a decode manager."""
        if not isinstance(self.rooms, DecodeRooms):
            raise KVTransferConfigError(f"only a decode manager receives KV; this one is {self.mode.value}")
        return self.rooms

    def topology(self) -> PrefillTopology:
        return PrefillTopology(
            attn_tp_size=int(getattr(self.server_args, "tp_size", 1) or 1),
            dp_size=int(getattr(self.server_args, "dp_size", 1) or 1),
            page_size=int(self.kv_args.page_size),
            kv_cache_dtype=str(self.kv_args.kv_cache_dtype_str),
        )

    # -- prefill: bootstrap registration ----------------------------------------------------

    def register_to_bootstrap(self) -> None:
        """Register this prefill rank at `server_args.host:disaggregation_bootstrap_port`,
        retrying until `timeout_s`; `registered` is set on success, `registration_error` on
        failure (every sender then fails with it)."""
        host = str(getattr(self.server_args, "host", "127.0.0.1"))
        endpoint = split_bootstrap_addr(f"{host}:{int(self.server_args.disaggregation_bootstrap_port)}")
        address = self.prefill_rooms().address
        self.registration.start(endpoint, self.dp_rank, self.engine_rank, str(address), self.topology())

    @property
    def registered(self) -> threading.Event:
        return self.registration.registered

    @property
    def registration_error(self) -> str | None:
        return self.registration.error

    # -- decode: the prefill's topology -------------------------------------------------------

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's decode scheduler asks this before creating receivers for `bootstrap_addr`:
        one lookup of the prefill topology, at most `timeout_s` long."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        # As SGLang's own managers do, a failed attempt answers False: the decode scheduler
        # retries, then aborts the address's requests.
        topology = self.decode_rooms().lookup_topology(bootstrap_addr)
        if topology is None:
            return False
        if topology.page_size != int(self.kv_args.page_size):
            raise KVTransferConfigError(f"prefill page size {topology.page_size}, decode {self.kv_args.page_size}")
        from sglang.srt.disaggregation.common.conn import PrefillServerInfo

        self.prefill_info_table[bootstrap_addr] = PrefillServerInfo(
            attn_tp_size=topology.attn_tp_size, attn_cp_size=1, dp_size=topology.dp_size, pp_size=1,
            page_size=topology.page_size, kv_cache_dtype=topology.kv_cache_dtype, follow_bootstrap_room=True,
        )
        return True

    def check_alive(self) -> str | None:
        failure = self.loop.failure
        return None if failure is None else f"the KV transfer I/O thread died: {failure!r}"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.loop.close()
        self.peer.close()
