"""What a process shares with the compute units it builds: `UnitContext`.

A unit is built as `Unit(role, ctx)`. Whoever builds it says what the process shares:

* `weights`: the process's `WeightStore`, so roles of one model hold one copy of it (a unit
  without one loads its own);
* `kv_store`: the worker's KV store, for the units that keep KV pages (a unit without one
  makes its own);
* `ops`: the ops a python unit may run (None: the command line's: every registered op, and
  `module:function` ops — trusted code);
* `seat`: the worker's seat on the transfer plane (its `Peer`, its worker id and the KV index),
  for the units that pull or serve KV pages; a unit without one starts a peer of its own the
  first time it needs one (in-process dispatch);
* `users`: where this host keeps its owners' folders (`engine.spec.userfiles.UsersRoot`): a python
  unit resolves a call's output folder names under it for the call's owner (None: a call with an
  owner and an output folder is refused).

The worker process (`engine.worker.process`) and the in-process builder of the command line and
the studio (`engine.worker.units.SharedUnits`) give a context; `InProcessDispatcher`'s default
builder (`engine.flow.dispatch`) gives none.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.compute.weights.store import WeightStore
from engine.data.kv.pull import KVHolderIndex
from engine.data.kv.store import KVStore
from engine.data.peer import Peer
from engine.spec.ops import OpConfig
from engine.spec.userfiles import UsersRoot


@dataclass(frozen=True, slots=True)
class TransferSeat:
    """A worker's seat on the transfer plane, as its units use it."""

    peer: Peer
    worker_id: str
    index: KVHolderIndex | None = None
    """Where pages other workers hold are found (None: pulls only from the holder a value names)."""


@dataclass(frozen=True, slots=True)
class UnitContext:
    """See the module docstring."""

    weights: WeightStore | None = None
    kv_store: KVStore | None = None
    ops: OpConfig | None = None
    seat: TransferSeat | None = None
    users: UsersRoot | None = None
