"""Which path a process's pulls took: counts and bytes per transport (`Transport`: local, shm,
cuda_ipc, tcp, inline), so a worker's metrics say whether its inputs and KV pages came over
shared memory on its host or over TCP from another one.

    tally = TransferTally()
    tally.record(data)                  # each completed pull (`TensorData.transport`, `.nbytes`)
    tally.metrics()                     # {"transfer.tcp.pulls": 3.0, "transfer.tcp.bytes": ...}

Thread-safe: pulls complete on the event loop and on the client's I/O thread alike.
"""

from __future__ import annotations

import threading

from engine.data.codec import TensorData
from engine.data.wire import Transport


class TransferTally:
    """Pulls and bytes per transport, since the process started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pulls = dict.fromkeys(Transport, 0)
        self._bytes = dict.fromkeys(Transport, 0)

    def record(self, data: TensorData) -> None:
        self.add(data.transport, data.nbytes)

    def add(self, transport: Transport, nbytes: int, pulls: int = 1) -> None:
        with self._lock:
            self._pulls[transport] += pulls
            self._bytes[transport] += nbytes

    def pulls(self, transport: Transport) -> int:
        with self._lock:
            return self._pulls[transport]

    def metrics(self, prefix: str = "transfer") -> dict[str, float]:
        """`<prefix>.<transport>.pulls` and `.bytes` for every transport used so far."""
        with self._lock:
            return {f"{prefix}.{t.value}.{what}": float(counts[t]) for t in Transport if self._pulls[t]
                    for what, counts in (("pulls", self._pulls), ("bytes", self._bytes))}
