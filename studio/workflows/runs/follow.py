"""Follow a run's events from inside the studio (the chat views): `follow_run` yields every
event in sequence order from `since`, without gaps or duplicates, and ends after
`run_finished`. The same protocol as the `/ws/runs/<id>/` consumer: subscribe to live
events first, then read the stored ones, then take live events, reading any gap (a
dropped message) back from the database.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from channels.layers import get_channel_layer

from studio.dbcalls import orm
from studio.workflows.models import RunEvent
from studio.workflows.runs.bus import ChannelLayerRunEventBus, RunEventBus

PAGE = 500


def _stored_sync(run_id: str, first: int, last: int | None) -> list[dict[str, Any]]:
    qs = RunEvent.objects.filter(run_id=run_id, seq__gte=first).order_by("seq")
    if last is not None:
        qs = qs.filter(seq__lte=last)
    return [e.data for e in qs[:PAGE]]


_stored = orm(_stored_sync, thread_sensitive=False)  # read-only: any thread


class _Subscriber:
    """A bus subscriber; on the channel layer it reads its own channel."""

    def __init__(self) -> None:
        self.channel_name = ""
        self.batches: asyncio.Queue[list[dict[str, Any]]] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None

    def deliver(self, events: list[dict[str, Any]]) -> None:
        self.batches.put_nowait(events)

    async def open(self, bus: RunEventBus) -> None:
        if isinstance(bus, ChannelLayerRunEventBus):
            layer = get_channel_layer()
            self.channel_name = await layer.new_channel()
            self._reader = asyncio.get_running_loop().create_task(self._read(layer))

    async def _read(self, layer: Any) -> None:
        while True:
            message = await layer.receive(self.channel_name)
            if message.get("type") == "run.events":
                self.deliver(message["events"])

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


async def follow_run(run_id: str, bus: RunEventBus, since: int = 0) -> AsyncIterator[dict[str, Any]]:
    subscriber = _Subscriber()
    await subscriber.open(bus)
    await bus.subscribe(run_id, subscriber)
    try:
        next_seq = since
        while True:  # stored events first (live ones are buffered meanwhile)
            page = await _stored(run_id, next_seq, None)
            for event in page:
                yield event
                if event.get("type") == "run_finished":
                    return
                next_seq = event["seq"] + 1
            if len(page) < PAGE:
                break
        while True:
            for event in await subscriber.batches.get():
                seq = event["seq"]
                if seq < next_seq:
                    continue
                while seq > next_seq:  # a live message was lost: read the gap back
                    gap = await _stored(run_id, next_seq, seq - 1)
                    if not gap:
                        raise RuntimeError(f"run {run_id}: events {next_seq}..{seq - 1} are missing from the store")
                    for missed in gap:
                        yield missed
                        next_seq = missed["seq"] + 1
                yield event
                if event.get("type") == "run_finished":
                    return
                next_seq = seq + 1
    finally:
        await bus.unsubscribe(run_id, subscriber)
        await subscriber.close()
