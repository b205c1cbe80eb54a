"""How a node counts a role's lost replicas for supervision (`records.loss_streak`): young
losses in a row, latest first, ended by a replica that had lasted; follower ranks, live
workers, other roles and other nodes do not count; a failed start counts once, however many
replicas it was to bring up, and however long it took."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from django.utils import timezone

from studio.workflows.deployments import records
from studio.workflows.models import Deployment, Worker, WorkflowVersion
from tests.studio.factories import create_workflow, spec_doc

pytestmark = pytest.mark.django_db

NODE = "node-a"


@pytest.fixture
def deployment(api: Any, user: Any) -> Deployment:
    wf = create_workflow(api, spec_doc())
    return Deployment.objects.create(owner=user, version=WorkflowVersion.objects.get(workflow_id=wf["id"], number=1),
                                     node=NODE, status="running")


def row(deployment: Deployment, worker_id: str, status: str, lived_s: float, lost_ago_s: float,
        host: str = NODE, role: str = "py") -> None:
    lost_at = timezone.now() - datetime.timedelta(seconds=lost_ago_s)
    worker = Worker.objects.create(deployment=deployment, role=role, worker_id=worker_id, host=host, status=status,
                                   last_seen_at=lost_at, pid=1)
    Worker.objects.filter(pk=worker.pk).update(started_at=lost_at - datetime.timedelta(seconds=lived_s))


def test_young_losses_in_a_row_count_until_one_that_lasted(deployment: Deployment) -> None:
    row(deployment, "py-a", "lost", lived_s=3600, lost_ago_s=100)   # lasted: ends the row
    Worker.objects.create(deployment=deployment, role="py", worker_id="py-n", host=NODE, status="lost")  # no time
    row(deployment, "py-b", "lost", lived_s=5, lost_ago_s=50)
    row(deployment, "py-b.tp1", "lost", lived_s=5, lost_ago_s=50)   # its follower: counted by rank 0
    row(deployment, "py-c", "ready", lived_s=40, lost_ago_s=0)      # live: not a loss
    row(deployment, "py-d", "lost", lived_s=2, lost_ago_s=10)
    row(deployment, "py-e", "lost", lived_s=1, lost_ago_s=200, host="node-b")  # another node's
    row(deployment, "lm-f", "lost", lived_s=1, lost_ago_s=5, role="lm")  # another role's
    streak, latest = records.loss_streak(str(deployment.pk), NODE, "py", healthy_s=60.0)
    assert streak == 2
    assert latest == Worker.objects.get(worker_id="py-d").last_seen_at


def test_a_failed_start_counts_once_and_nothing_lost_counts_nothing(deployment: Deployment) -> None:
    assert records.loss_streak(str(deployment.pk), NODE, "py", healthy_s=60.0) == (0, None)
    records.fail_starts(str(deployment.pk), NODE, [records.FailedStart("py", w, "worker py-x exited")
                                                   for w in ("py-x", "py-y", "py-z")])
    streak, latest = records.loss_streak(str(deployment.pk), NODE, "py", healthy_s=60.0)
    assert streak == 1 and latest is not None
    records.starting_workers(str(deployment.pk), [records.StartingWorker("py-w", "py", NODE, pid=1)])
    records.fail_starts(str(deployment.pk), NODE, [records.FailedStart("py", "py-w", "slow")])
    assert records.loss_streak(str(deployment.pk), NODE, "py", healthy_s=60.0)[0] == 2
    failed = Worker.objects.get(worker_id="py-x")
    assert (failed.status, failed.pid, failed.host, failed.error) == ("failed", None, NODE, "worker py-x exited")
    # However long a failed start took, it counts (it never stayed up).
    Worker.objects.filter(worker_id="py-w").update(started_at=timezone.now() - datetime.timedelta(hours=1))
    assert records.loss_streak(str(deployment.pk), NODE, "py", healthy_s=60.0)[0] == 2


def test_a_deployment_runs_once_every_placed_replica_is_up_not_while_one_is_starting(deployment: Deployment) -> None:
    """Two replicas placed on two nodes: the first node's share up and the second's still starting
    (its row made at spawn) is not running yet; both up is."""
    Deployment.objects.filter(pk=deployment.pk).update(status="starting", placement={"slots": [
        {"role": "py", "replica": 0, "node": "node-a"}, {"role": "py", "replica": 1, "node": "node-b"}]})
    Worker.objects.create(deployment=deployment, role="py", worker_id="py-b", host="node-b", status="ready", pid=1)
    starting = Worker.objects.create(deployment=deployment, role="py", worker_id="py-a", host="node-a",
                                     status="starting", pid=2)
    assert records.settle_started(str(deployment.pk))
    assert Deployment.objects.get(pk=deployment.pk).status == "starting"
    Worker.objects.filter(pk=starting.pk).update(status="ready")
    assert records.settle_started(str(deployment.pk))
    assert Deployment.objects.get(pk=deployment.pk).status == "running"
