"""`OwnerSockets`: the sockets a client opens to owners, the same for both of its paths.

Any thread may open one (a ZeroMQ context is thread-safe); the socket then belongs to the
thread that opened it: the I/O thread (`loop`) or a blocking caller holding a link (`direct`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import zmq

from engine.data.curve import PlaneKeys, connect_as_client


@dataclass(frozen=True, slots=True)
class OwnerSockets:
    context: zmq.Context
    max_message_bytes: int
    keys: PlaneKeys | None  # None: plaintext

    def owner(self, address: str) -> zmq.Socket:
        """A DEALER to the owner at `address`, a CURVE client of the plane when it has keys."""
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTING_ID, secrets.token_bytes(12))
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        connect_as_client(socket, self.keys)
        socket.connect(address)
        return socket

    def bulk(self, address: str) -> zmq.Socket:
        """A plain connection to an owner's bulk channel: what it admits is each request's
        grant, which only the CURVE connection handed out (`engine.data.bulk`)."""
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        socket.connect(address)
        return socket
