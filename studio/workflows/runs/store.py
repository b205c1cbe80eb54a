"""The database side of run execution. Every function here is synchronous (ORM) and is
called from one thread at a time per run (the engine's database thread, or a Celery
worker), so a run's events are written in order.

A run's stored events are exactly the executor's events (typed up to the write, then
`event_to_dict`), except that
`run_finished` gains `files`: output name -> download URL for outputs stored as files, and
that a run executed again after its executor stopped has a `run_restarted` event (written by
`recovery`) followed by the new execution's events, their `seq` numbered on from it
(`RunTicket.seq_base`); and that server paths below the owner's folder become run files or relative names
(`studio.workflows.runs.outputs`; the files are read before the run's row is locked, `runs.namedfiles`):
users see no server path.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import logging
import mimetypes
from collections.abc import Callable
from concurrent.futures import Executor as ThreadExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
from django.core.files.base import ContentFile
from django.db import DataError, IntegrityError, close_old_connections, connections, transaction
from django.db.models import F
from django.urls import reverse
from django.utils import timezone

from engine.client.keys import PlaneKeys
from engine.client.runs import (
    BlobPath,
    HeldBlob,
    NodeOutputEvent,
    NodeProgressEvent,
    NodeStateEvent,
    RunFinished,
    RunStarted,
    RunStatus,
    event_to_dict,
    finite_json,
    preview,
)
from engine.client.runs import RunEvent as EngineEvent
from studio.dbcalls import orm
from studio.workflows.apps import engine
from studio.workflows.models import (
    FileRole,
    NodeRun,
    NodeState,
    Run,
    RunEvent,
    RunFile,
)
from studio.workflows.models import (
    RunStatus as DbRunStatus,
)
from studio.workflows.paths import PathRoots, resolve_role_paths
from studio.workflows.runs import namedfiles
from studio.workflows.runs.lease import LeaseCheck, LeaseLost, LeaseTerms, RunRestarted
from studio.workflows.runs.namedfiles import NamedFiles, NotRead
from studio.workflows.runs.outputs import NamedFile, ServerPaths, ShowFile, sniff_content_type

log = logging.getLogger(__name__)

INLINE_OUTPUT_LIMIT = 1_000_000
"""Outputs whose JSON passes this many bytes are stored as files instead of inline."""

_TERMINAL_NODE_STATES = {NodeState.DONE, NodeState.FAILED, NodeState.SKIPPED, NodeState.CANCELLED}


@dataclass(frozen=True, slots=True)
class RunTicket:
    """What the engine needs to start a claimed run."""

    run_id: str
    spec: dict[str, Any]
    inputs: dict[str, Any]
    """Input values with uploaded files read back as bytes."""
    timeout_s: float | None
    node_kinds: dict[str, str]
    deployment_id: str | None = None
    """Set when the run executes on a deployment's role workers."""
    namespace: str | None = None
    """The deployment's worker registry namespace."""
    tenant: str | None = None
    """Whose caches the run reads and fills (`Run.tenant`): every run the studio executes has one."""
    owner: str | None = None
    """Whose folder its nodes' output folder names are in (the run's owner's id: `NodeCall.owner`)."""
    seq_base: int = 0
    """Added to the executor's event `seq`s: the events stored before this execution (a run
    executed again after its executor stopped keeps the earlier attempt's events)."""
    plane_keys: PlaneKeys | None = None
    """The CURVE keys of the deployment's worker plane (None: no deployment, or it ended)."""


def with_node_params(spec: dict[str, Any], node_params: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`spec` with each node's params updated from `node_params` (node id -> params); the
    spec itself is not modified."""
    if not node_params:
        return spec
    nodes = [{**n, "params": {**n.get("params", {}), **node_params[n["id"]]}} if n.get("id") in node_params else n
             for n in spec.get("nodes", [])]
    return {**spec, "nodes": nodes}


def _when(epoch: float | None) -> dt.datetime:
    return dt.datetime.fromtimestamp(epoch, tz=dt.UTC) if epoch is not None else timezone.now()


def file_url(run_id: Any, file_id: Any) -> str:
    return reverse("run-file", kwargs={"pk": run_id, "file_id": file_id})


def file_ref(file: RunFile) -> dict[str, Any]:
    return {"$file": str(file.id)}


def store_file(run: Run, role: str, name: str, data: bytes, filename: str, content_type: str,
               sha256: str | None = None) -> RunFile:
    """`data` kept as a file of `run` (owned by its owner); `sha256`: its digest where the caller
    computed it already (outside the run's row lock, `namedfiles.ReadFile`)."""
    record = RunFile(
        owner_id=run.owner_id,
        run=run,
        role=role,
        name=name,
        filename=filename[:255],
        content_type=content_type or mimetypes.guess_type(filename)[0] or "application/octet-stream",
        size=len(data),
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
    )
    record.file.save(record.id.hex, ContentFile(data), save=False)
    record.save()
    return record


# ------------------------------------------------------------------------------ claiming
def claim(run_id: str, lease: LeaseTerms | None = None) -> RunTicket | None:
    """Move a pending run to running and return what it needs; None when it is not pending
    (already claimed, cancelled or finished), which makes execution idempotent. With
    `lease`, the caller holds the run's lease from now on (`studio.workflows.runs.lease`)."""
    held = {} if lease is None else {"lease_owner": lease.owner, "lease_expires_at": lease.expiry()}
    with transaction.atomic():
        claimed = Run.objects.filter(pk=run_id, status=DbRunStatus.PENDING).update(
            status=DbRunStatus.RUNNING, started_at=timezone.now(), attempts=F("attempts") + 1,
            cancel_requested=False, **held,
        )
        if not claimed:
            return None
        run = Run.objects.select_related("version", "deployment").get(pk=run_id)
        node = engine().config.node_name  # where its in-process nodes write (`runs.folders`)
        if node not in run.executed_on:
            run.executed_on = [*run.executed_on, node]
            run.save(update_fields=["executed_on"])
        files = {str(f.id): f for f in run.files.filter(role=FileRole.INPUT)}
    inputs: dict[str, Any] = {}
    for name, value in run.inputs.items():
        if isinstance(value, dict) and set(value) == {"$file"}:
            record = files.get(value["$file"])
            if record is None:
                raise LookupError(f"input {name!r}: uploaded file {value['$file']} is missing")
            with record.file.open("rb") as fh:
                inputs[name] = fh.read()
        else:
            inputs[name] = value
    spec = with_node_params(run.version.spec, run.node_params)
    # The roles' names become server paths only here, where the run's own role units start (a
    # deployment's workers got theirs from their node agent, records.ticket). Its nodes' output
    # folder names stay names: the process that writes resolves them under its own users root
    # for the run's owner (`engine.spec.userfiles`), on whichever node that is.
    spec = resolve_role_paths(spec, run.owner_id, PathRoots.of(engine().config))
    deployment = run.deployment
    return RunTicket(
        run_id=str(run.pk),
        spec=spec,
        inputs=inputs,
        timeout_s=run.timeout_s,
        node_kinds={n["id"]: n["kind"] for n in spec.get("nodes", [])},
        deployment_id=None if deployment is None else str(deployment.pk),
        namespace=None if deployment is None else deployment.namespace,
        tenant=run.tenant,
        owner=str(run.owner_id),
        seq_base=run.last_seq + 1,
        plane_keys=None if deployment is None else deployment.plane_keys(),
    )


# ------------------------------------------------------------------------------- events
def _output_value(run: Run, name: str, value: Any, files: dict[str, str]) -> Any:
    """How one run output is kept: JSON inline, bytes (or oversized JSON) as a file."""
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        content_type, ext = sniff_content_type(data)
        record = store_file(run, FileRole.OUTPUT, name, data, f"{name}{ext}", content_type)
        files[name] = file_url(run.pk, record.pk)
        return file_ref(record)
    try:
        encoded = msgspec.json.encode(finite_json(value))  # JSON writes no infinity: msgspec would write null
    except (TypeError, ValueError, msgspec.EncodeError):  # ValueError: an integer too long to print
        return preview(value)
    if len(encoded) > INLINE_OUTPUT_LIMIT:
        record = store_file(run, FileRole.OUTPUT, name, encoded, f"{name}.json", "application/json")
        files[name] = file_url(run.pk, record.pk)
        return file_ref(record)
    return msgspec.json.decode(encoded)


def _restart(run: Run, nodes: dict[str, NodeRun]) -> set[str]:
    """`run_restarted`: the run is pending again, its nodes and outputs as before any execution."""
    for node in nodes.values():
        node.state, node.attempts, node.iterations = NodeState.PENDING, 0, 0
        node.started_at = node.finished_at = node.duration_ms = node.progress = None
        node.error, node.message, node.outputs, node.frames = "", "", {}, 0
    outputs = run.files.filter(role__in=[FileRole.OUTPUT, FileRole.NODE])
    for produced in outputs:
        produced.delete()  # its file goes with it (`models`); the new execution makes its own
    run.status, run.outputs, run.error, run.failed_node = DbRunStatus.PENDING, {}, "", ""
    run.lease_owner, run.lease_expires_at, run.cancel_requested = "", None, False
    return {"status", "outputs", "error", "failed_node", "lease_owner", "lease_expires_at", "cancel_requested"}


def _show_files(run: Run, named: NamedFiles) -> ShowFile:
    """How each place the batch names is shown, within its transaction: by the run file stored under
    its name (by an earlier event or batch), else by a run file of the bytes gathered for it (stored
    now), else by the text gathered instead."""

    def show(file: NamedFile) -> dict[str, Any] | str:
        record = RunFile.objects.filter(run=run, role=FileRole.OUTPUT, name=file.run_file_name).first()
        if record is None:
            found = named.found[file]
            if isinstance(found, NotRead):
                return found.shown
            record = store_file(run, FileRole.OUTPUT, file.run_file_name, found.data, found.filename,
                                found.content_type, sha256=found.sha256)
        return output_ref(record, file.name)

    return show


def output_ref(record: RunFile, name: str) -> dict[str, Any]:
    """How an output names a stored run file: its id, download URL and its name in the owner's folder."""
    return {**file_ref(record), "url": file_url(record.run_id, record.pk), "name": name}


StoredEvent = EngineEvent | RunRestarted
"""What `record` stores: the executor's events, and the studio's own `RunRestarted`."""


def record(run_id: str, events: list[StoredEvent], final_outputs: dict[str, Any] | None = None,
           blobs: dict[int, list[HeldBlob]] | None = None, *, owner: str | None = None) -> list[dict]:
    """Store a batch of a run's events (in order, contiguous) and bring Run and NodeRun rows
    up to date. `final_outputs` (the run's real output values) comes with `run_finished`;
    `blobs` (by seq) the bytes that `node_output` events only preview (a value's, or those in
    its lists and dicts, a streamed frame's too), kept as the run's files when they are images
    or audio (`_node_media`).
    With `owner`, the writer must still hold the run's lease (else `LeaseLost`, nothing
    written). The events stay typed up to the write; returns them as stored (JSON data), which
    is what followers are sent.
    The files the batch names are read first, before the run's row is locked (`namedfiles`: a
    node's agent may take `nodefiles.FETCH_TIMEOUT_S` to answer), so the lock is held only while
    the batch is written."""
    owner_id, lease_owner, status = Run.objects.values_list("owner_id", "lease_owner", "status").get(pk=run_id)
    _check_lease(run_id, owner, lease_owner, status)  # a writer that lost it fetches nothing
    fields = [_file_values(event) for event in events]  # what gather reads through is what is hidden below
    values = [value for named_by in fields for value in named_by.values()]
    named = namedfiles.gather(engine().config, run_id, str(owner_id),
                              values if final_outputs is None else [*values, final_outputs])
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=run_id)
        _check_lease(run_id, owner, run.lease_owner, run.status)
        if events and events[0].seq != run.last_seq + 1:
            raise ValueError(f"run {run_id}: event seq {events[0].seq} does not follow {run.last_seq}")
        nodes = {n.node: n for n in run.nodes.all()}
        touched: dict[str, NodeRun] = {}
        run_fields: set[str] = {"last_seq"}
        stored: list[dict[str, Any]] = []
        paths, show = named.paths, _show_files(run, named)
        for event, named_by in zip(events, fields, strict=True):
            event = _hide_paths(event, named_by, paths, show)
            when = _when(event.time)
            files: dict[str, str] = {}
            if isinstance(event, RunStarted):
                run.status = DbRunStatus.RUNNING
                run.started_at = run.started_at or when
                run_fields |= {"status", "started_at"}
            elif isinstance(event, NodeStateEvent) and event.node in nodes:
                touched[event.node] = _node_state(nodes[event.node], event, when)
            elif isinstance(event, NodeOutputEvent) and event.node in nodes:
                if blobs and event.seq in blobs:
                    event = msgspec.structs.replace(event, value=_node_media(run, event, blobs[event.seq]))
                node = nodes[event.node]
                node.outputs = {**node.outputs, event.port: event.value}
                if event.frame is not None:
                    node.frames += 1
                touched[node.node] = node
            elif isinstance(event, NodeProgressEvent) and event.node in nodes:
                node = nodes[event.node]
                node.progress = event.progress
                node.message = event.message[:500]
                touched[node.node] = node
            elif isinstance(event, RunRestarted):
                run_fields |= _restart(run, nodes)
                touched.update(nodes)
            elif isinstance(event, RunFinished):
                outputs = event.outputs if final_outputs is None else paths.hide(final_outputs, show)
                run.outputs = {name: _output_value(run, name, value, files) for name, value in outputs.items()}
                run.status = str(event.status)
                run.error = event.error or ""
                run.failed_node = event.failed_node or ""
                run.finished_at = when
                run.duration_ms = event.duration_ms
                run_fields |= {"outputs", "status", "error", "failed_node", "finished_at", "duration_ms"}
            run.last_seq = event.seq
            stored.append({**event_to_dict(event), "files": files} if files else event_to_dict(event))
        RunEvent.objects.bulk_create(
            [RunEvent(run=run, seq=e["seq"], type=e["type"], data=e) for e in stored]
        )
        if touched:
            NodeRun.objects.bulk_update(
                touched.values(),
                ["state", "attempts", "iterations", "started_at", "finished_at", "duration_ms", "error",
                 "progress", "message", "outputs", "frames"],
            )
        run.save(update_fields=sorted(run_fields))
    return stored


def _check_lease(run_id: str, owner: str | None, lease_owner: str, status: str) -> None:
    """`LeaseLost` unless `owner` (None: a writer without a lease) holds the run's lease."""
    if owner is not None and (lease_owner != owner or status != DbRunStatus.RUNNING):
        raise LeaseLost(f"run {run_id}: the lease of {owner} was taken over (the run is {status},"
                        f" held by {lease_owner or 'nobody'})")


def _node_state(node: NodeRun, event: NodeStateEvent, when: dt.datetime) -> NodeRun:
    """`node` brought up to `event` (a state change; 0 for attempt or iteration: not said)."""
    state = str(event.state)
    node.state = state
    node.attempts = event.attempt or node.attempts
    node.iterations = event.iteration or node.iterations
    if state == NodeState.RUNNING and node.started_at is None:
        node.started_at = when
    if state in _TERMINAL_NODE_STATES:
        node.finished_at = when
        if state == NodeState.DONE and node.started_at is None:
            node.started_at = when  # input/output nodes finish without running
        if event.duration_ms is not None:
            node.duration_ms = event.duration_ms
        node.error = event.error or ("" if state == NodeState.DONE else node.error)
    return node


NODE_MEDIA_LIMIT = 64
"""At most this many images and audio clips that nodes produce are kept per run (a loop
making one per iteration keeps its first ones)."""

NODE_MEDIA_BYTES = 32 * 1024 * 1024
"""A bigger blob is not kept for a preview."""


def _node_media(run: Run, event: NodeOutputEvent, blobs: list[HeldBlob]) -> Any:
    """The event's value with each image or audio blob in it (`blobs`, at their places) as a
    file of the run, for the run view's previews (downloaded by the run's owner only, like every
    run file): `{"$file", "url", "content_type", "bytes"}`. Other blobs, and those past the limits,
    keep their previews."""
    value = event.value
    for blob in blobs:
        media = _media_file(run, event, blob.path, blob.value)
        if media is not None:
            value = _put(value, blob.path, media)
    return value


def _media_file(run: Run, event: NodeOutputEvent, path: BlobPath, data: bytes) -> dict[str, Any] | None:
    content_type, ext = sniff_content_type(data)
    if not content_type.startswith(("image/", "audio/")) or len(data) > NODE_MEDIA_BYTES:
        return None
    digest = hashlib.sha256(data).hexdigest()
    files = RunFile.objects.filter(run=run, role=FileRole.NODE)
    record = files.filter(sha256=digest).first()  # the same image passed along several nodes: one file
    if record is None:
        if files.count() >= NODE_MEDIA_LIMIT:
            return None
        # paint.picture; frames.clip#3 (a streamed frame); gallery.images[1] (in a list or dict)
        name = f"{event.node}.{event.port}" + ("" if event.frame is None else f"#{event.frame}")
        name += "".join(f"[{key}]" for key in path)
        record = store_file(run, FileRole.NODE, name[-64:], data, f"{name}{ext}", content_type)
    return {**file_ref(record), "url": file_url(run.pk, record.pk), "content_type": content_type, "bytes": len(data)}


def _put(value: Any, path: BlobPath, item: Any) -> Any:
    """`value` (a preview: lists and dicts) with `item` at `path`; `value` is not modified."""
    if not path:
        return item
    key, rest = path[0], path[1:]
    if isinstance(value, list) and isinstance(key, int) and 0 <= key < len(value):
        return [*value[:key], _put(value[key], rest, item), *value[key + 1:]]
    if isinstance(value, dict) and key in value:
        return {**value, key: _put(value[key], rest, item)}
    raise ValueError(f"a blob's place {path!r} is not in its preview")


def _file_values(event: StoredEvent) -> dict[str, Any]:
    """The fields of `event` whose values may name files (as JSON data), by field name."""
    if isinstance(event, NodeOutputEvent):
        return {"value": msgspec.to_builtins(event.value)}
    if isinstance(event, RunFinished):
        return {"outputs": msgspec.to_builtins(event.outputs)}
    return {}


def _hide_paths(event: StoredEvent, fields: dict[str, Any], paths: ServerPaths, show: ShowFile) -> StoredEvent:
    """The event as users may see it: no server path in its values (`fields`, its `_file_values`: each
    place they name as `show` says), error or progress message."""
    changed = {field: paths.hide(value, show) for field, value in fields.items()}
    if isinstance(event, NodeStateEvent | RunFinished | RunRestarted) and event.error:
        changed["error"] = paths.hide_in_text(event.error)
    if isinstance(event, NodeProgressEvent) and event.message:
        changed["message"] = paths.hide_in_text(event.message)
    return msgspec.structs.replace(event, **changed) if changed else event


def _synthetic_finish(run: Run, status: RunStatus, error: str) -> RunFinished:
    return RunFinished(seq=run.last_seq + 1, run_id=str(run.pk), time=timezone.now().timestamp(), status=status,
                       error=error)


def finish(run: Run, status: RunStatus, error: str) -> list[dict]:
    """End `run` (locked by the caller's transaction) with one `run_finished` event: its
    unfinished nodes are cancelled. For a run no executor finishes (never started, or its
    executor is gone)."""
    NodeRun.objects.filter(run=run).exclude(state__in=_TERMINAL_NODE_STATES).update(
        state=NodeState.CANCELLED, finished_at=timezone.now()
    )
    return record(str(run.pk), [_synthetic_finish(run, status, error)])


def finish_unstarted(run_id: str, status: RunStatus, error: str, *, only_pending: bool) -> list[dict] | None:
    """End a run the executor never started (invalid by now, cancelled while pending, or its
    worker died) with one `run_finished` event; None when it was already finished (or, with
    `only_pending`, no longer pending)."""
    with transaction.atomic():
        run = Run.objects.select_for_update().filter(pk=run_id).first()
        if run is None or run.finished or (only_pending and run.status != DbRunStatus.PENDING):
            return None
        return finish(run, status, error)


def renew(terms: LeaseTerms, run_ids: list[str]) -> LeaseCheck:
    """Extend the leases `terms.owner` holds on `run_ids` (`lease.LeaseKeeper` calls it every tick)."""
    with transaction.atomic():
        Run.objects.filter(pk__in=run_ids, lease_owner=terms.owner, status=DbRunStatus.RUNNING).update(
            lease_expires_at=terms.expiry())
        rows = Run.objects.filter(pk__in=run_ids).values_list("pk", "status", "lease_owner", "cancel_requested")
        held = {str(pk): cancel for pk, status, owner, cancel in rows
                if status == DbRunStatus.RUNNING and owner == terms.owner}
    return LeaseCheck(lost=frozenset(set(run_ids) - set(held)),
                      cancel=frozenset(pk for pk, cancel in held.items() if cancel))


def pending_runs() -> list[str]:
    """Runs waiting to be executed, oldest first (a stopped process's queue, runs swept to restart)."""
    return [str(pk) for pk in Run.objects.filter(status=DbRunStatus.PENDING).order_by("created_at")
            .values_list("pk", flat=True)]


class EventsRefused(Exception):
    """The database refused a batch of a run's events (a value no column of it holds): nothing of
    the batch was written, and writing it again would fail the same way."""


class ThreadedRunStore:
    """The functions above, awaited from an event loop on one dedicated thread (so a run's
    writes stay ordered and the loop never blocks on the database). With `lease`, runs are
    claimed under it and written only while it is held."""

    def __init__(self, executor: ThreadExecutor | None, lease: LeaseTerms | None = None) -> None:
        self._executor = executor
        self.lease = lease

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._executor is None:
            return await orm(fn)(*args, **kwargs)

        def call() -> Any:
            close_old_connections()
            return fn(*args, **kwargs)

        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def claim(self, run_id: str) -> RunTicket | None:
        return await self._call(claim, run_id, self.lease)

    async def record(self, run_id: str, events: list[StoredEvent], final_outputs: dict[str, Any] | None = None,
                     blobs: dict[int, list[HeldBlob]] | None = None) -> list[dict]:
        try:
            return await self._call(record, run_id, events, final_outputs, blobs,
                                    owner=None if self.lease is None else self.lease.owner)
        except (DataError, IntegrityError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise EventsRefused(f"the database refused its events {events[0].seq}..{events[-1].seq}: {reason}"
                                if events else f"the database refused its outputs: {reason}") from exc

    async def renew(self, run_ids: list[str]) -> LeaseCheck:
        assert self.lease is not None, "renew needs a store with a lease"
        return await self._call(renew, self.lease, run_ids)

    async def finish_unstarted(self, run_id: str, status: RunStatus, error: str, *, only_pending: bool):
        return await self._call(finish_unstarted, run_id, status, error, only_pending=only_pending)

    async def close(self) -> None:
        """Close this thread's database connections."""
        await self._call(connections.close_all)
