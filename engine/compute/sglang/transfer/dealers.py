"""The DEALER sockets a transfer manager keeps to one kind of peer: one per endpoint, made on first use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq

from engine.compute.sglang.transfer.config import KVTransferConfigError
from engine.compute.sglang.transfer.loop import IOLoop
from engine.compute.sglang.transfer.messages import TransferMessage


class Dealers:
    """DEALERs by endpoint (bootstrap servers, or prefill control endpoints), with their replies
    read by `IOLoop.on_reply`. Loop thread only; the loop owns each socket once it is made and
    closes it with itself."""

    def __init__(self, loop: IOLoop) -> None:
        self._loop = loop
        self._sockets: dict[str, zmq.Socket] = {}

    def socket(self, endpoint: str) -> zmq.Socket:
        """The DEALER connected to `endpoint`; KVTransferConfigError if ZeroMQ refuses the endpoint
        (a host it cannot parse: raised out of a loop callback, it would end the I/O thread)."""
        socket = self._sockets.get(endpoint)
        if socket is None:
            socket = self._loop.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            try:
                socket.connect(endpoint)
            except zmq.ZMQError as exc:
                socket.close(linger=0)
                raise KVTransferConfigError(f"cannot connect to {endpoint}: {exc}") from exc
            self._sockets[endpoint] = socket
            self._loop.add_reader(socket, self._loop.on_reply)
        return socket

    def request(self, endpoint: str, message: Any, timeout_s: float,
                on_reply: Callable[[TransferMessage | None], None]) -> None:
        """`IOLoop.request` on the DEALER of `endpoint`; KVTransferConfigError as `socket`."""
        self._loop.request(self.socket(endpoint), message, timeout_s, on_reply)
