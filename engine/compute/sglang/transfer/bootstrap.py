"""The bootstrap server: where each prefill rank's control endpoint is."""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq
from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer

from engine.compute.sglang.transfer.loop import MAX_CONTROL_BYTES, POLL_MS
from engine.compute.sglang.transfer.messages import (
    TRANSFER_PROTOCOL_VERSION,
    BootstrapLookupReply,
    BootstrapLookupRequest,
    BootstrapMessage,
    BootstrapRegisterReply,
    BootstrapRegisterRequest,
    PrefillTopology,
)
from engine.data.codec import WireCodec, WireError

log = logging.getLogger(__name__)


class OmniFlowKVBootstrapServer(BaseKVBootstrapServer):
    """Maps (dp rank, tp rank) to the prefill managers' control endpoints; SGLang runs one per
    prefill server at `host:disaggregation_bootstrap_port`."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._codec = WireCodec(MAX_CONTROL_BYTES, BootstrapMessage)
        self._context = zmq.Context(io_threads=1)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{host}:{port}")
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._managers: dict[tuple[int, int], str] = {}
        self._topology: PrefillTopology | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="omniflow-kv-bootstrap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(POLL_MS):
                continue
            identity, *_, data = self._socket.recv_multipart()
            try:
                message = self._codec.decode(data)
            except WireError as exc:
                log.warning("bootstrap server: unreadable message: %s", exc)
                continue
            reply = self._answer(message)
            if reply is not None:
                self._socket.send_multipart([identity, self._codec.encode(reply)])

    def _answer(self, message: Any) -> Any:
        if isinstance(message, BootstrapRegisterRequest):
            if message.protocol_version != TRANSFER_PROTOCOL_VERSION:
                return BootstrapRegisterReply(message.request_id, False, "protocol version mismatch")
            if self._topology is not None and self._topology != message.topology:
                return BootstrapRegisterReply(
                    message.request_id, False, f"topology {message.topology} differs from {self._topology}"
                )
            self._topology = message.topology
            self._managers[(message.dp_rank, message.engine_rank)] = message.address
            return BootstrapRegisterReply(message.request_id, True)
        if isinstance(message, BootstrapLookupRequest):
            address = self._managers.get((message.dp_rank, message.engine_rank))
            if message.engine_rank < 0 and self._topology is not None:
                address = ""
            return BootstrapLookupReply(message.request_id, address, self._topology)
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._socket.close(linger=0)
        self._context.term()
