"""How a run's stored events reach the WebSocket consumers following it.

A subscriber is a consumer: it has a `channel_name` and a `deliver(events)` method that
must be called on its own event loop. Publishing happens on the engine's loop (or in a
Celery worker), so buses hop loops safely:

* `LocalRunEventBus` — in one process (the embedded mode): `call_soon_threadsafe` onto
  each subscriber's loop.
* `ChannelLayerRunEventBus` — through the channel layer (channels-redis): one group per
  run; the consumer's `run_events` handler calls `deliver`. Works across processes.

Delivery is best effort (a full channel drops messages): consumers detect a gap by
sequence number and read the missing events from the database.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Protocol

from channels.layers import get_channel_layer

log = logging.getLogger(__name__)

EventDicts = list[dict[str, Any]]


class RunSubscriber(Protocol):
    channel_name: str

    def deliver(self, events: EventDicts) -> None:
        """Called on the subscriber's event loop with events in sequence order."""
        ...


class RunEventBus(Protocol):
    async def publish(self, run_id: str, events: EventDicts) -> None: ...

    async def subscribe(self, run_id: str, subscriber: RunSubscriber) -> None: ...

    async def unsubscribe(self, run_id: str, subscriber: RunSubscriber) -> None: ...


def group_name(run_id: str) -> str:
    return f"omniflow.run.{run_id}"


class LocalRunEventBus:
    """Subscribers of this process; safe to publish from any thread's loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscribers: dict[str, dict[int, tuple[asyncio.AbstractEventLoop, RunSubscriber]]] = {}

    async def publish(self, run_id: str, events: EventDicts) -> None:
        with self._lock:
            targets = list(self._subscribers.get(run_id, {}).items())
        for key, (loop, subscriber) in targets:
            try:
                loop.call_soon_threadsafe(subscriber.deliver, events)
            except RuntimeError:  # its loop has closed: the consumer is gone
                with self._lock:
                    self._subscribers.get(run_id, {}).pop(key, None)

    async def subscribe(self, run_id: str, subscriber: RunSubscriber) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            self._subscribers.setdefault(run_id, {})[id(subscriber)] = (loop, subscriber)

    async def unsubscribe(self, run_id: str, subscriber: RunSubscriber) -> None:
        with self._lock:
            subs = self._subscribers.get(run_id)
            if subs is not None:
                subs.pop(id(subscriber), None)
                if not subs:
                    del self._subscribers[run_id]

    def subscriber_count(self, run_id: str) -> int:
        with self._lock:
            return len(self._subscribers.get(run_id, {}))


class ChannelLayerRunEventBus:
    """One channel-layer group per run; messages of type `run.events`."""

    def __init__(self, alias: str = "default") -> None:
        self._alias = alias

    def _layer(self) -> Any:
        layer = get_channel_layer(self._alias)
        if layer is None:
            raise RuntimeError(f"no channel layer {self._alias!r} is configured")
        return layer

    async def publish(self, run_id: str, events: EventDicts) -> None:
        await self._layer().group_send(group_name(run_id), {"type": "run.events", "events": events})

    async def subscribe(self, run_id: str, subscriber: RunSubscriber) -> None:
        await self._layer().group_add(group_name(run_id), subscriber.channel_name)

    async def unsubscribe(self, run_id: str, subscriber: RunSubscriber) -> None:
        await self._layer().group_discard(group_name(run_id), subscriber.channel_name)
