"""A prefill rank's registration at its bootstrap server."""

from __future__ import annotations

import logging
import threading
import time

from engine.compute.sglang.transfer.config import KVTransferConfigError
from engine.compute.sglang.transfer.dealers import Dealers
from engine.compute.sglang.transfer.loop import IOLoop
from engine.compute.sglang.transfer.messages import (
    TRANSFER_PROTOCOL_VERSION,
    BootstrapRegisterReply,
    BootstrapRegisterRequest,
    PrefillTopology,
    TransferMessage,
)

log = logging.getLogger(__name__)


class BootstrapRegistration:
    """Registers a prefill rank's control endpoint under its (dp rank, tp rank), retrying until
    `timeout_s`. `registered` is set on success; `error` says why it failed, and every sender of
    the rank then fails with it. Both are written on the loop thread and read by any thread."""

    def __init__(self, loop: IOLoop, bootstraps: Dealers, timeout_s: float) -> None:
        self._loop = loop
        self._bootstraps = bootstraps
        self._timeout_s = timeout_s
        self.registered = threading.Event()
        self.error: str | None = None

    def start(self, endpoint: str, dp_rank: int, engine_rank: int, address: str, topology: PrefillTopology) -> None:
        """Register `address` at the bootstrap server on `endpoint` (a ZeroMQ endpoint); the
        attempts run on the loop thread."""
        deadline = time.monotonic() + self._timeout_s

        def attempt() -> None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail(f"no bootstrap server answered at {endpoint} within {self._timeout_s}s")
                return
            request = BootstrapRegisterRequest(
                self._loop.next_id(), TRANSFER_PROTOCOL_VERSION, dp_rank, engine_rank, address, topology,
            )
            try:
                self._bootstraps.request(endpoint, request, min(remaining, 1.0), on_reply)
            except KVTransferConfigError as exc:
                self._fail(f"registering at the bootstrap server: {exc}")

        def on_reply(reply: TransferMessage | None) -> None:
            if isinstance(reply, BootstrapRegisterReply) and reply.accepted:
                self.registered.set()
            elif isinstance(reply, BootstrapRegisterReply):
                self._fail(f"bootstrap server refused the registration: {reply.reason}")
            else:
                attempt()

        self._loop.call(attempt)

    def _fail(self, error: str) -> None:
        self.error = error
        log.error("%s", error)
