"""Stream edges in the executor: the frames of one edge, held for its reader.

A `StreamChannel` holds at most `capacity` frames while its reader runs, from `attach()` to
`detach()`: `put` waits for room, and so does the node producing the frames (back-pressure,
which the worker links' credit windows carry on to the unit making them; the producer's
`timeout_s` counts the wait). It holds any number before its reader runs (the reader may not
start before this very producer finished, or may wait for a slot the producer holds), and
while its reader waits on another, empty channel of its `StreamGroup` (the channels one node
reads): a node reading its ports in turn would otherwise wait forever for a producer held back
by the port it is not reading. A *relayed* channel, read by the dispatcher on behalf of a
node on a worker, takes no part in that: the worker sees what its node waits on, and grants
credit by it. Once detached, a channel drops what it holds and what comes: nobody is left to
read it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class StreamGroup:
    """The stream channels one node reads."""

    __slots__ = ("channels",)

    def __init__(self) -> None:
        self.channels: list[StreamChannel] = []

    def starving(self, besides: StreamChannel) -> bool:
        """Whether the reader waits on another channel than `besides`, an empty one."""
        return any(c is not besides and c._waiting() for c in self.channels)


class StreamChannel:
    """Frames of one stream edge, read by one consumer as an async iterator (see the module)."""

    __slots__ = ("capacity", "_frames", "_group", "_closed", "_attached", "_detached", "_relayed", "_reader",
                 "_putter")

    def __init__(self, capacity: int = 0, group: StreamGroup | None = None) -> None:
        self.capacity = capacity
        self._frames: deque[Any] = deque()
        self._group = group if group is not None else StreamGroup()
        self._group.channels.append(self)
        self._closed = False
        self._attached = False
        self._detached = False
        self._relayed = False
        self._reader: asyncio.Future[None] | None = None
        self._putter: asyncio.Future[None] | None = None

    @property
    def held(self) -> int:
        """Frames put and not yet taken."""
        return len(self._frames)

    def _waiting(self) -> bool:
        return not self._relayed and self._reader is not None and not self._reader.done() and not self._frames

    def _full(self) -> bool:
        return (self.capacity > 0 and self._attached and not self._detached
                and len(self._frames) >= self.capacity and not self._group.starving(self))

    async def put(self, value: Any) -> None:
        while self._full():
            putter = self._putter = asyncio.get_running_loop().create_future()
            try:
                await putter
            finally:
                self._putter = None
        if not self._detached:
            self._frames.append(value)
            _wake(self._reader)

    def close(self) -> None:
        """The producer is done."""
        self._closed = True
        _wake(self._reader)

    def attach(self) -> None:
        """The reader runs: hold at most `capacity` frames from now on."""
        self._attached = True

    def relay(self) -> None:
        """The reader relays the frames to a worker, which decides when its node starves."""
        self._relayed = True

    def detach(self) -> None:
        """The reader ended: drop what it left and what comes, and end a read still waiting
        (a thread blocked in one, say)."""
        self._detached = True
        self._frames.clear()
        if self in self._group.channels:
            self._group.channels.remove(self)
        _wake(self._putter)
        _wake(self._reader)

    def __aiter__(self) -> StreamChannel:
        return self

    async def __anext__(self) -> Any:
        while not self._frames:
            if self._closed or self._detached:
                if self in self._group.channels:
                    self._group.channels.remove(self)
                raise StopAsyncIteration
            reader = self._reader = asyncio.get_running_loop().create_future()
            for channel in self._group.channels:  # they may hold more now that the reader waits here
                _wake(channel._putter)
            try:
                await reader
            finally:
                if self._reader is reader:
                    self._reader = None
        value = self._frames.popleft()
        _wake(self._putter)
        return value


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)
