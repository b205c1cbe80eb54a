"""WebSocket consumers: `/ws/runs/<id>/` (a run's events) and `/ws/metrics/` (workers' metrics).

`/ws/runs/<id>/`: a run's events, resumable from a sequence number.

Protocol. Connect with `?since=N` (default 0). The server sends each event as one JSON
text message, exactly as stored (`{"type": "node_state", "seq": 7, ...}`), in sequence
order from N on, and closes (code 1000) after `run_finished`. A client that saw up to
seq k reconnects with `since=k+1`. Sending `{"since": N}` restarts the stream at N on
the same socket. Failures close the socket after one message
`{"type": "error", "status": 4xx, "error": ...}` with close code 4000 + status
(4400 bad request, 4401 not authenticated, 4404 no such run, 4413 a message over
OMNIFLOW_MAX_WS_MESSAGE_BYTES, 4429 the user holds their quota of open sockets,
OMNIFLOW_QUOTA_WEBSOCKETS, on this socket and on `/ws/metrics/`). Client messages are parsed with the limits of
`studio.jsonbody` (depth, size), on this socket and on `/ws/metrics/`.

No gaps, no duplicates: the consumer subscribes to the run's live events *before* it
reads the stored ones, and the executor side stores each event before publishing it;
so every event is either read from the database or arrives live (or both: live events
at or below the last seq sent are dropped). A live event beyond the next expected seq
(a dropped message) makes the consumer read the gap from the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from typing import Any
from urllib.parse import parse_qs

from channels.generic.websocket import AsyncWebsocketConsumer

from engine.client.cluster import RegistryError
from studio.dbcalls import orm
from studio.errors import BadRequest
from studio.jsonbody import JsonRefused, load_json
from studio.numbers import DB_INT_MAX, count
from studio.workflows.apps import engine
from studio.workflows.deployments.workers import (
    active_deployments,
    deployment_names,
    listing,
    recorded_statuses,
    snapshots,
)
from studio.workflows.history.query import RangeError, history, parse_range
from studio.workflows.history.store import HistoryUnavailable
from studio.workflows.models import Deployment, Run, RunEvent
from studio.workflows.runs.bus import RunEventBus
from studio.workflows.sockets import SocketSlots

log = logging.getLogger(__name__)

REPLAY_PAGE = 500


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _since(raw: Any) -> int:
    """A `since` from the query string (text) or a message (a JSON number or text)."""
    if isinstance(raw, bool) or not isinstance(raw, int | str):
        raise _Refused(400, f"since must be a whole number from 0 to {DB_INT_MAX}")
    try:
        return count(str(raw), "since", DB_INT_MAX)
    except BadRequest as exc:
        raise _Refused(400, exc.message) from None


class Slot:
    """One open socket of a user, counted against their quota (`studio.workflows.sockets`) from
    `take` until `give_back`."""

    def __init__(self, slots: SocketSlots, user: Any) -> None:
        self._slots, self._user = slots, user

    @classmethod
    def take(cls, user: Any) -> Slot:
        """The user's next slot; `_Refused` 429 when they hold their quota of open sockets."""
        slots = engine().sockets
        if not slots.take(user):
            raise _Refused(429, f"you have {slots.held(user)} WebSockets open on this server; your quota is"
                                f" {slots.limit} (OMNIFLOW_QUOTA_WEBSOCKETS): close one first")
        return cls(slots, user)

    def give_back(self) -> None:
        self._slots.give_back(self._user)


def client_message(text_data: str | None, bytes_data: bytes | None) -> Any:
    """A client's message, parsed with the limits of `studio.jsonbody` (`_Refused` 400 or 413)."""
    config = engine().config
    try:
        return load_json(text_data if text_data is not None else bytes_data or b"", max_depth=config.max_json_depth,
                         max_bytes=config.max_ws_message_bytes, what="the message")
    except JsonRefused as exc:
        raise _Refused(exc.status, exc.message) from None


def _visible_run_sync(user: Any, run_id: str) -> str | None:
    run = Run.objects.visible_to(user).filter(pk=run_id).values_list("pk", flat=True).first()
    return None if run is None else str(run)


def _stored_events_sync(run_id: str, first: int, last: int | None = None) -> list[dict[str, Any]]:
    qs = RunEvent.objects.filter(run_id=run_id, seq__gte=first).order_by("seq")
    if last is not None:
        qs = qs.filter(seq__lte=last)
    return [e.data for e in qs[:REPLAY_PAGE]]


# Read-only lookups, run off the one thread that sync views share (thread_sensitive=False): a
# burst of REST writes must not hold WebSocket handshakes and replays past their timeouts.
_visible_run = orm(_visible_run_sync, thread_sensitive=False)
_stored_events = orm(_stored_events_sync, thread_sensitive=False)


class RunEventsConsumer(AsyncWebsocketConsumer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.run_id: str | None = None
        self.bus: RunEventBus = engine().runs.bus
        self._live: asyncio.Queue[list[dict[str, Any]]] = asyncio.Queue()
        self._follow: asyncio.Task[None] | None = None
        self._subscribed = False
        self._slot: Slot | None = None

    # ------------------------------------------------------------------ connection
    async def connect(self) -> None:
        await self.accept()
        try:
            user = self.scope.get("user")
            if user is None or not user.is_authenticated:
                raise _Refused(401, "authentication required: send 'Authorization: Bearer <token>' or log in")
            self._slot = Slot.take(user)
            raw_id = self.scope["url_route"]["kwargs"]["run_id"]
            try:
                run_id = str(uuid.UUID(str(raw_id)))
            except ValueError:
                raise _Refused(404, f"no run {raw_id}") from None
            query = parse_qs(self.scope.get("query_string", b"").decode("latin1"))
            since = _since(query["since"][-1]) if "since" in query else 0
            if await _visible_run(user, run_id) is None:
                raise _Refused(404, f"no run {run_id}")
        except _Refused as refused:
            await self._refuse(refused)
            return
        self.run_id = run_id
        await self.bus.subscribe(run_id, self)
        self._subscribed = True
        self._start(since)

    async def _refuse(self, refused: _Refused) -> None:
        await self.send(json.dumps({"type": "error", "status": refused.status, "error": refused.message}))
        await self.close(code=4000 + refused.status)

    async def disconnect(self, code: int) -> None:
        if self._slot is not None:
            self._slot, slot = None, self._slot
            slot.give_back()
        await self._stop_follow()
        if self._subscribed and self.run_id is not None:
            self._subscribed = False
            await self.bus.unsubscribe(self.run_id, self)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.run_id is None:
            return
        try:
            message = client_message(text_data, bytes_data)
            if not isinstance(message, dict) or "since" not in message:
                raise _Refused(400, 'expected {"since": N}')
            since = _since(message["since"])
        except _Refused as refused:
            await self._refuse(refused)
            return
        await self._stop_follow()
        self._live = asyncio.Queue()  # live batches before the restart are read from the database again
        self._start(since)

    # ---------------------------------------------------------------- live events
    def deliver(self, events: list[dict[str, Any]]) -> None:
        """Called by an in-process bus, on this consumer's loop."""
        self._live.put_nowait(events)

    async def run_events(self, message: dict[str, Any]) -> None:
        """Channel-layer bus messages (`type: run.events`)."""
        self.deliver(message["events"])

    # --------------------------------------------------------------------- follow
    def _start(self, since: int) -> None:
        self._follow = asyncio.get_running_loop().create_task(self._stream(since))

    async def _stop_follow(self) -> None:
        task, self._follow = self._follow, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _stream(self, since: int) -> None:
        assert self.run_id is not None
        # Stored events first (the subscription is already buffering live ones).
        next_seq = await self._send_stored(since, None)
        if next_seq is None:
            return
        while True:
            batch = await self._live.get()
            for event in batch:
                seq = event["seq"]
                if seq < next_seq:
                    continue
                if seq > next_seq:  # a live message was lost: read the gap back
                    next_seq = await self._send_stored(next_seq, seq - 1)
                    if next_seq is None:
                        return
                    if next_seq != seq:
                        log.error("run %s: events %d..%d are missing from the store", self.run_id, next_seq, seq - 1)
                if await self._send_event(event):
                    return
                next_seq = seq + 1

    async def _send_stored(self, first: int, last: int | None) -> int | None:
        """Send stored events `first..last`; the next seq to send, or None when the stream ended."""
        assert self.run_id is not None
        next_seq = first
        while True:
            page = await _stored_events(self.run_id, next_seq, last)
            for event in page:
                if await self._send_event(event):
                    return None
                next_seq = event["seq"] + 1
            if len(page) < REPLAY_PAGE:
                return next_seq

    async def _send_event(self, event: dict[str, Any]) -> bool:
        """Send one event; True when it ended the stream (and the socket was closed)."""
        await self.send(json.dumps(event))
        if event.get("type") == "run_finished":
            await self.close(code=1000)
            return True
        return False


class WorkerMetricsConsumer(AsyncWebsocketConsumer):
    """`/ws/metrics/?range=5m`: first the history of the range, one message
    `{"type": "history", ...}` (the body of `GET /api/metrics/history/`, see
    `studio.workflows.history.query`; with an `error` and no workers when it cannot be read);
    then every `OMNIFLOW_METRICS_INTERVAL_S` (1 s), one message
    `{"type": "workers", "time": <epoch s>, "workers": [WorkerSnapshot + status, deployment]}`
    with the live workers of the deployments the user can see (the shape of
    `GET /api/workers/`; see `studio.workflows.deployments.workers`). The first of those
    comes at once. Not authenticated: one error message, then close code 4401; a bad
    `range`, 4400."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ticker: asyncio.Task[None] | None = None
        self._slot: Slot | None = None

    async def connect(self) -> None:
        await self.accept()
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self._refuse(401, "authentication required: send 'Authorization: Bearer <token>' or log in")
            return
        try:
            self._slot = Slot.take(user)
        except _Refused as refused:
            await self._refuse(refused.status, refused.message)
            return
        query = parse_qs(self.scope.get("query_string", b"").decode("latin1"))
        try:
            span = parse_range(query["range"][-1] if "range" in query else None, engine().config.metrics_history_s)
        except RangeError as exc:
            await self._refuse(400, str(exc))
            return
        self._ticker = asyncio.get_running_loop().create_task(self._tick(user, span))

    async def _refuse(self, status: int, message: str) -> None:
        await self.send(json.dumps({"type": "error", "status": status, "error": message}))
        await self.close(code=4000 + status)

    async def disconnect(self, code: int) -> None:
        if self._slot is not None:
            self._slot, slot = None, self._slot
            slot.give_back()
        task, self._ticker = self._ticker, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        """Nothing to ask (the stream is the same for every message); a message past the limits
        of `client_message` ends the connection with its error."""
        try:
            client_message(text_data, bytes_data)
        except _Refused as refused:
            await self._refuse(refused.status, refused.message)

    async def _tick(self, user: Any, span: tuple[str, float]) -> None:
        eng = engine()
        interval = eng.config.metrics_interval_s
        loop = asyncio.get_running_loop()
        await self.send(json.dumps(await _history_message(eng, user, span)))
        while True:
            began = loop.time()
            try:
                message = await _worker_message(eng, user)
            except (TimeoutError, RegistryError) as exc:
                log.warning("reading worker metrics failed: %s", exc)
            else:
                await self.send(json.dumps(message))
            await asyncio.sleep(max(0.0, interval - (loop.time() - began)))  # the stream's own period


async def _history_message(eng: Any, user: Any, span: tuple[str, float]) -> dict[str, Any]:
    range_text, range_s = span
    try:
        body = await orm(history, thread_sensitive=False)(
            eng.history.store, user, range_text=range_text, range_s=range_s)
    except HistoryUnavailable as exc:
        log.warning("%s", exc)
        return {"type": "history", "range": range_text, "range_s": range_s, "error": str(exc), "workers": []}
    return {"type": "history", **body}


async def _worker_message(eng: Any, user: Any) -> dict[str, Any]:
    namespaces = await orm(
        lambda: active_deployments(Deployment.objects.visible_to(user)))()
    live = await snapshots(eng, namespaces)
    recorded = await orm(recorded_statuses)(list(namespaces))
    result = listing(live, recorded, await orm(deployment_names)(list(namespaces)))
    return {"type": "workers", "time": result.time, "workers": result.workers}
