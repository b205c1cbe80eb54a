"""Runs: submit a workflow to an `Executor` and follow it as typed events.

* `Executor` -- runs plans over a dispatcher: `submit(spec, inputs)` starts a `Run`; `aclose()`
  ends its runs and its dispatcher. `in_process_executor` makes one whose units run in this
  process; `engine.client.plane.WorkerPlane` one whose calls go to a deployment's workers;
* `Run` -- one run: `events(since=...)` follows it, `cancel()`, `done`, `outputs`;
* `RunInputError`, `resolve_inputs` -- a run's inputs checked against its plan before submitting;
* the events, in order, with contiguous sequence numbers (`RunStarted` first, `RunFinished`
  last): `RunEvent` (their union), `NodeStateEvent`, `NodeOutputEvent`, `NodeProgressEvent`,
  `NodeState`, `RunStatus`; `EventLog` keeps a run's events for late readers; `event_to_dict`,
  `preview` and `finite_json` shape them for JSON;
* `HeldBlob` -- a byte blob (an image, an audio clip) a node's output event only previews, and its
  place in the value (`BlobPath`), which `Run.take_blobs` hands a server that shows them;
* `TransferError` -- a tensor that could not be moved between workers (a run fails with it).
"""

from __future__ import annotations

from engine.data.channel import TransferError
from engine.flow.dispatch import InProcessDispatcher
from engine.flow.events import (
    BlobPath,
    EventLog,
    HeldBlob,
    NodeOutputEvent,
    NodeProgressEvent,
    NodeState,
    NodeStateEvent,
    RunEvent,
    RunFinished,
    RunStarted,
    RunStatus,
    event_to_dict,
    finite_json,
    preview,
)
from engine.flow.executor import Executor, Run, RunInputError, resolve_inputs
from engine.spec.kinds import KindRegistry
from engine.spec.ops import OpConfig
from engine.spec.userfiles import UsersRoot

__all__ = [
    "BlobPath",
    "EventLog",
    "HeldBlob",
    "Executor",
    "NodeOutputEvent",
    "NodeProgressEvent",
    "NodeState",
    "NodeStateEvent",
    "Run",
    "RunEvent",
    "RunFinished",
    "RunInputError",
    "RunStarted",
    "RunStatus",
    "TransferError",
    "event_to_dict",
    "finite_json",
    "in_process_executor",
    "preview",
    "resolve_inputs",
]


def in_process_executor(kinds: KindRegistry, *, ops: OpConfig, users: UsersRoot | None = None) -> Executor:
    """An executor whose units all run in this process, sharing one copy of each model's
    weights; python units may run `ops` and write a run's files in its owner's folder under
    `users` (`engine.spec.userfiles`). Loads torch: call it where runs execute, not at import.
    The caller owns it (`aclose()`)."""
    from engine.worker.units import SharedUnits  # torch: when an executor is made, not at import

    return Executor(InProcessDispatcher(kinds, build=SharedUnits(kinds, ops=ops, users=users)), kinds)
