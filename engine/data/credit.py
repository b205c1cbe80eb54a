"""Credit-based flow control for the frames of one stream.

A receiver grants its sender a window of frames; the sender sends frame `n` only once
`n < granted`, and the receiver grants more as its reader takes frames (`Taken`), in
batches of half a window so that credits cost one message per half window, not one per
frame. A fast producer thus runs at most a window ahead of a slow reader, however far
apart they are, and waits instead of filling the memory between them.

The executor grants credit for a stream node's output frames (`FrameCredit`), a worker
for each stream-mode input port it reads (`InputCredit`); see `engine.data.wire`.
"""

from __future__ import annotations

import asyncio


class CreditWindow:
    """The sender's side: how many frames it may have sent by now (`granted`). One sender
    waits at a time. `close()` ends every wait (the peer is gone: the next send fails)."""

    __slots__ = ("granted", "closed", "_waiter")

    def __init__(self, frames: int) -> None:
        if frames <= 0:
            raise ValueError(f"a credit window needs at least one frame, not {frames}")
        self.granted = frames
        self.closed = False
        self._waiter: asyncio.Future[None] | None = None

    def grant(self, frames: int) -> None:
        if frames > 0:
            self.granted += frames
            self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def exhausted(self, sent: int) -> bool:
        return sent >= self.granted and not self.closed

    async def wait(self, sent: int) -> None:
        """Return once frame number `sent` (counting from 0) may go out, or the window closed."""
        while self.exhausted(sent):
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Taken:
    """The receiver's side: counts the frames its reader took and says when to grant them
    back (`take` returns the frames to grant, 0 while the batch is not full)."""

    __slots__ = ("window", "_batch", "_owed")

    def __init__(self, window: int) -> None:
        self.window = window
        self._batch = max(1, window // 2)
        self._owed = 0

    def take(self) -> int:
        self._owed += 1
        if self._owed < self._batch:
            return 0
        owed, self._owed = self._owed, 0
        return owed
