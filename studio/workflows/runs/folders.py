"""A deleted run's output folders on the nodes that ran it (the distributed mode).

A run's ops write their files under its owner's folder where they execute (`paths.run_folders`:
`<users root>/<owner id>/<output folder>/<run id>/`): in the Celery mode on the run queue's
worker that claimed it (`Run.executed_on`: its in-process units) and on each node whose role
workers ran its nodes (a `node_state` event names the worker, its `Worker` row the node).
Deleting a run, or its workflow, removes the studio's own copy once the deletion commits
(`studio.workflows.operations`) and, in the deletion's transaction, records what each of those
nodes still owes (`owe`: a `RunFolderRemoval` row with the node, the run id, its owner and its
output folder names) for every node the node directory knows. A name it never heard of runs no
node agent (a run queue worker of its own, whose data dir is the studio's where they share one,
as in the compose file): nothing is owed there. Once the deletion commits, each live node is
sent `omniflow.remove_run_folders(node, run ids)` on its queue `node.<name>`.

The node agent removes what it owes (`remove_owed`) with paths it builds itself: its own users
root (`OMNIFLOW_DATA_DIR`), the owner id, each folder name resolved under it (`paths.resolve_under`:
no absolute name, no `..`, no link) and the run id, never a path from the message. The message's
run ids must be canonical UUIDs, or it is refused whole (`BadRunIds`). A node that was lost when
the run was deleted gets no message: its rows wait, and it removes them when it starts
(`worker_ready` sends it the task for everything owed) and on each supervision tick that looks
for lost nodes (`supervise_node`), so one that comes back without restarting does too. A row
goes once its folders were tried: one that could not be removed (permissions) is logged with
why, not retried forever. A node that never comes back keeps its rows (its data dir went with
it); `forget`ting it in the node directory means later deletions owe it nothing.

Every node finds what it wrote: the run's nodes get their output folder names as names with the
run's owner (`NodeCall.owner`), and the process that writes resolves them under its own users
root (`engine.spec.userfiles`: a role worker's `--users-root`, which its node agent sets from the
node's `OMNIFLOW_DATA_DIR`; the run worker's in-process units under its own), so the folders lie
below the root the node's removal walks, whatever data dir each machine is configured with.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.db import transaction

from engine.spec.ops import OpRegistry
from studio.workflows.models import Run, RunEvent, RunFolderRemoval, Worker
from studio.workflows.paths import output_folder_names, run_folders
from studio.workflows.runs.store import with_node_params

log = logging.getLogger(__name__)

NodeStates = dict[str, bool]
"""The nodes the node directory knows, by name: live (True) or lost."""


class BadRunIds(ValueError):
    """A removal message whose run ids are not all run ids: nothing of it is done."""


def parse_run_ids(values: Any) -> list[str]:
    """`values` as run ids (canonical UUID strings); BadRunIds naming every one that is not."""
    if not isinstance(values, list):
        raise BadRunIds(f"run ids come as a list, not {type(values).__name__}")
    bad = [value for value in values if not _canonical_uuid(value)]
    if bad:
        raise BadRunIds(f"refused: {', '.join(repr(b)[:80] for b in bad[:5])} {'is' if len(bad) == 1 else 'are'}"
                        " not a run id (a UUID as 8-4-4-4-12 lowercase hex digits)")
    return list(values)


def _canonical_uuid(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False


# --------------------------------------------------------------------------- the studio
def nodes_that_ran(runs: list[Run]) -> dict[str, set[str]]:
    """Run id -> the nodes that may hold its folders: those of the processes that claimed it and
    those whose role workers ran its nodes. Read before the rows go (the workers' rows go with
    their deployment)."""
    nodes = {str(run.pk): set(run.executed_on) for run in runs}
    ran = list(RunEvent.objects.filter(run_id__in=list(nodes), type="node_state", data__has_key="worker")
               .values_list("run_id", "data__worker"))
    hosts = dict(Worker.objects.filter(worker_id__in={worker for _, worker in ran}).exclude(host="")
                 .values_list("worker_id", "host"))
    for run_id, worker in ran:
        if worker in hosts:
            nodes[str(run_id)].add(hosts[worker])
    return nodes


def owe(runs: list[Run], registry: OpRegistry, known: Callable[[], NodeStates | None]) -> dict[str, list[str]]:
    """Record (in the caller's transaction) what each node `known` names owes of `runs`' folders
    (`known`: the node directory, read only when a run wrote folders; None when it could not be
    read: then every node that ran a run owes). Returns the live nodes to tell: node -> run ids."""
    names = {str(run.pk): output_folder_names(with_node_params(run.version.spec, run.node_params), registry)
             for run in runs}
    writing = [run for run in runs if names[str(run.pk)]]
    if not writing:
        return {}
    ran = nodes_that_ran(writing)
    states = known()
    if states is None:
        log.warning("the node directory could not be read: the nodes that ran runs %s remove their folders on"
                    " their next supervision tick", sorted(ran))
    notify: dict[str, list[str]] = {}
    rows = []
    for run in writing:
        run_id = str(run.pk)
        for node in sorted(ran[run_id]):
            if states is not None and node not in states:
                continue
            rows.append(RunFolderRemoval(node=node, run_id=run.pk, owner_id=run.owner_id, folders=names[run_id]))
            if states is not None and states[node]:
                notify.setdefault(node, []).append(run_id)
    RunFolderRemoval.objects.bulk_create(rows, ignore_conflicts=True)
    return notify


# ----------------------------------------------------------------------------- a node
def remove_owed(users_root: Path, node: str, run_ids: list[str] | None = None) -> list[str]:
    """Remove the folders `node` owes under `users_root` (this node's `<data dir>/users`): of
    `run_ids` (checked with `parse_run_ids` by the caller), or every run's when None. Each row
    goes once tried. The ids of the runs done."""
    owed = RunFolderRemoval.objects.filter(node=node)
    if run_ids is not None:
        owed = owed.filter(run_id__in=run_ids)
    done = []
    for pk in owed.values_list("pk", flat=True):
        with transaction.atomic():
            row = RunFolderRemoval.objects.select_for_update(skip_locked=True).filter(pk=pk).first()
            if row is None:  # another removal has it
                continue
            _remove(users_root, row)
            row.delete()
        done.append(str(row.run_id))
    return done


def _remove(users_root: Path, row: RunFolderRemoval) -> None:
    user_root = users_root / str(int(row.owner_id))
    if user_root.is_symlink() or not user_root.is_dir():
        return  # nothing of that user's here (or not a plain folder: not ours to walk)
    names = [name for name in row.folders if isinstance(name, str)]
    for folder in run_folders(user_root, names, str(row.run_id)):
        try:
            shutil.rmtree(folder)
        except OSError as exc:
            log.warning("node %s: could not remove %s, the output folder of deleted run %s: %s", row.node, folder,
                        row.run_id, exc)
        else:
            log.info("node %s: removed %s, the output folder of deleted run %s", row.node, folder, row.run_id)
