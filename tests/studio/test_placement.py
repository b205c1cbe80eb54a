"""Placement in a distributed studio, against node records in the real Redis and the real
database, without node agents: what each node has free counts the deployments already placed,
a deployment is refused (409) when it fits nowhere, pinned to a node that must be live,
scaled with its running replicas kept, and a lost node's replicas are placed again (or wait,
said on the deployment, until a node has room), but never a node's that a Redis flush took from
the directory while its agent still announces it (its heartbeats kept in the database, or without
any, a TTL's grace from the flush); the nodes list keeps showing such nodes meanwhile. The
`deploy`/`stop_deployment` tasks these send go to queues no agent consumes here; the test removes
them."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import redis
from django.apps import apps
from django.conf import settings
from django.db.models.functions import Now
from django.utils import timezone

from engine.client.cluster import make_registry
from engine.flow.discovery.nodes import NodeDirectory, NodeRecord
from engine.spec.resources import Amounts
from studio.config import Dispatch
from studio.workflows.apps import build_engine
from studio.workflows.deployments import failover, liveness, records
from studio.workflows.deployments.announce import NodeAnnouncer
from studio.workflows.deployments.node import NodeAgent
from studio.workflows.models import Deployment, NodeHeartbeat, Worker, WorkerStatus
from tests.studio.conftest import client_for
from tests.studio.factories import create_workflow, spec_doc

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis,
              pytest.mark.skipif(not settings.OMNIFLOW.redis_url, reason="needs REDIS_URL (the node directory)")]


@dataclasses.dataclass
class Nodes:
    directory: NodeDirectory
    tag: str
    config: Any

    def up(self, name: str, *, gpus: int = 0, cpus: float = 4, memory_gb: float = 16, ttl_s: float = 30,
           **labels: str) -> str:
        node = f"{self.tag}-{name}"
        total = Amounts(gpus, cpus, memory_gb)
        self.directory.announce(NodeRecord(name=node, address="10.0.0.1", total=total, free=total, labels=labels,
                                           seen_at=time.time(), ttl_s=ttl_s))
        return node

    def down(self, name: str) -> None:
        self.directory.withdraw(f"{self.tag}-{name}")

    def agent(self, name: str, *, cpus: float, ttl_s: float) -> NodeAnnouncer:
        """The announcer of a node agent for node `name` (its thread not started: the test makes
        each heartbeat with `announce()`)."""
        node = dataclasses.replace(self.config.node, cpus=cpus, gpus=0, memory_gb=16, ttl_s=ttl_s)
        return NodeAnnouncer(dataclasses.replace(self.config, node_name=f"{self.tag}-{name}", node=node))

    def flush(self) -> None:
        """What a Redis flush, or a restart without persistence, does to the node directory."""
        client = redis.Redis.from_url(self.config.redis_url)
        try:
            client.flushdb()  # this test's database only
        finally:
            client.close()


@pytest.fixture
def nodes() -> Iterator[Nodes]:
    tag = uuid.uuid4().hex[:6]
    config = dataclasses.replace(settings.OMNIFLOW, allow_module_ops=True, dispatch=Dispatch.CELERY, deploy_node=None,
                                 redis_prefix=f"pt{tag}", run_queue=f"pt{tag}-runs")
    app = apps.get_app_config("workflows")
    engine = build_engine(config)
    previous = app.install(engine)
    directory = NodeDirectory(config.redis_url, config.nodes_namespace)
    try:
        yield Nodes(directory, tag, config)
    finally:
        engine.runs.stop()
        app.install(previous)
        directory.close()
        client = redis.Redis.from_url(config.redis_url)
        for key in [*client.scan_iter(f"pt{tag}*"), *client.scan_iter(f"node.{tag}-*")]:
            client.delete(key)  # the node directory, and the tasks sent to nobody's queue
        client.close()


def spec(*roles: dict[str, Any]) -> dict[str, Any]:
    doc = spec_doc(name="placed", op="tests.studio.fns:echo")
    doc["roles"] = [{"name": "py", "kind": "python", **roles[0]}, *[{"kind": "python", **r} for r in roles[1:]]]
    return doc


def slots(deployment: dict[str, Any] | Deployment) -> list[tuple[str, int, str]]:
    placement = deployment.placement if isinstance(deployment, Deployment) else deployment["placement"]
    return [(s["role"], s["replica"], s["node"]) for s in placement["slots"]]


def test_each_deployment_gets_gpus_no_other_holds(nodes: Nodes, api: Any) -> None:
    a = nodes.up("a", gpus=3)
    wf = create_workflow(api, spec({"replicas": 2, "resources": {"gpus": 1}}))
    first = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json").json()
    assert [(s["node"], s["gpus"]) for s in first["placement"]["slots"]] == [(a, [0]), (a, [1])]
    preview = api.post("/api/nodes/placement/", {"workflow": wf["id"], "replicas": {"py": 1}}, format="json").json()
    assert [(s["node"], s["gpus"]) for s in preview["placement"]] == [(a, [2])]
    response = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json")
    assert response.status_code == 409 and "needs 1 GPU, 0 free" in response.json()["error"]
    # Once the first one stops, its GPUs are free again.
    Deployment.objects.filter(pk=first["id"]).update(status="stopped")
    second = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json").json()
    assert [s["gpus"] for s in second["placement"]["slots"]] == [[0], [1]]


def test_free_resources_count_what_is_placed_and_a_full_cluster_refuses(nodes: Nodes, api: Any) -> None:
    a, b = nodes.up("a", cpus=2), nodes.up("b", cpus=3)
    wf = create_workflow(api, spec({"replicas": 2, "resources": {"cpus": 1}}))
    first = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json").json()
    assert slots(first) == [("py", 0, b), ("py", 1, a)]  # spread, the roomier node first
    assert first["node"] == a and first["status"] == "pending"
    second = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json").json()
    assert slots(second) == [("py", 0, b), ("py", 1, a)]
    # b has one CPU left, a none: a third pair fits only half; the replica left out is named, with
    # the best node's free resources once the other replica took b's last CPU
    response = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json")
    assert response.status_code == 409
    (refusal,) = response.json()["details"]
    assert (refusal["role"], refusal["replicas"], refusal["best_node"], refusal["best_free"]) == (
        "py", [1], a, {"gpus": 0, "cpus": 0.0, "memory_gb": 16.0})
    assert Deployment.objects.count() == 2
    # what the nodes page says is free comes from the placements
    listed = {n["name"]: n for n in api.get("/api/nodes/").json()}
    assert set(listed) == {a, b} and listed[a]["status"] == "live"
    assert {h["deployment"] for h in listed[b]["hosting"]} <= {first["id"], second["id"]}


def test_a_pinned_node_must_be_live_and_the_preview_says_where(nodes: Nodes, api: Any) -> None:
    a = nodes.up("a", gpus=1, kind="gpu")
    wf = create_workflow(api, spec({"resources": {"labels": {"kind": "gpu"}}}))
    response = api.post("/api/deployments/", {"workflow": wf["id"], "node": f"{nodes.tag}-gone"}, format="json")
    assert response.status_code == 409
    assert response.json()["details"] == [{"field": "node", "message": response.json()["error"]}]
    assert f"node '{nodes.tag}-gone' is not live" in response.json()["error"]
    preview = api.post("/api/nodes/placement/", {"workflow": wf["id"], "replicas": {"py": 2}}, format="json").json()
    assert preview == {"distributed": True, "placement": [{"role": "py", "replica": 0, "node": a, "gpus": []},
                                                          {"role": "py", "replica": 1, "node": a, "gpus": []}],
                       "refusals": [], "error": "", "nodes": [a]}
    assert not Deployment.objects.exists()  # a preview reserves nothing


def test_scaling_keeps_running_replicas_and_refuses_what_does_not_fit(nodes: Nodes, api: Any) -> None:
    a, b = nodes.up("a", cpus=2), nodes.up("b", cpus=1)
    wf = create_workflow(api, spec({"resources": {"cpus": 1}}))
    d = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json").json()
    assert slots(d) == [("py", 0, a)]
    Deployment.objects.filter(pk=d["id"]).update(status="running")
    scaled = api.post(f"/api/deployments/{d['id']}/scale/", {"role": "py", "replicas": 3}, format="json").json()
    assert slots(scaled) == [("py", 0, a), ("py", 1, b), ("py", 2, a)]
    response = api.post(f"/api/deployments/{d['id']}/scale/", {"role": "py", "replicas": 4}, format="json")
    assert response.status_code == 409 and "replica 3: cannot be placed" in response.json()["error"]
    assert Deployment.objects.get(pk=d["id"]).replicas == {"py": 3}  # unchanged
    down = api.post(f"/api/deployments/{d['id']}/scale/", {"role": "py", "replicas": 1}, format="json").json()
    assert slots(down) == [("py", 0, a)]


def test_a_lost_nodes_replicas_move_or_wait_for_room(nodes: Nodes, api: Any) -> None:
    a, b = nodes.up("a", cpus=1), nodes.up("b", cpus=1)
    wf = create_workflow(api, spec({"replicas": 2, "resources": {"cpus": 1}}))
    d = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json").json()
    assert slots(d) == [("py", 0, a), ("py", 1, b)]
    Deployment.objects.filter(pk=d["id"]).update(status="running")
    records.add_workers(d["id"], [records.StartedWorker(f"py-{b}-1", "py", "tcp://10.0.0.1:1", b, 999_999)])
    nodes.down("b")
    # no node has room for the lost replica: it waits, said on the deployment
    (rehomed,) = failover.sweep(nodes.config)
    assert rehomed.lost_nodes == (b,) and rehomed.lost_workers == (f"py-{b}-1",)
    waiting = Deployment.objects.get(pk=d["id"])
    assert slots(waiting) == [("py", 0, a)]
    assert waiting.error.startswith(failover.UNPLACED) and "role 'py', replica 1: cannot be placed" in waiting.error
    assert Worker.objects.get(worker_id=f"py-{b}-1").status == WorkerStatus.LOST
    before = Deployment.objects.get(pk=d["id"]).updated_at
    assert failover.sweep(nodes.config) == []  # tried again at every tick: still no room, nothing to record
    assert Deployment.objects.get(pk=d["id"]).updated_at == before
    # a node with room appears: the replica goes there, the deployment says it moved, the error clears
    c = nodes.up("c", cpus=2)
    (rehomed,) = failover.sweep(nodes.config)
    placed = Deployment.objects.get(pk=d["id"])
    assert slots(placed) == [("py", 0, a), ("py", 1, c)] and placed.error == ""
    assert [(m["role"], m["replica"], m["from"], m["to"]) for m in placed.placement["moved"]] == [("py", 1, None, c)]
    assert failover.sweep(nodes.config) == []  # nothing lost any more
    # a node lost with room elsewhere: moved at once, from where to where and why
    nodes.down("a")
    failover.sweep(nodes.config)
    moved = Deployment.objects.get(pk=d["id"]).placement
    assert [(s["role"], s["replica"], s["node"]) for s in moved["slots"]] == [("py", 0, c), ("py", 1, c)]
    assert moved["moved"][-1] | {"at": ""} == {"role": "py", "replica": 0, "from": a, "to": c, "at": "",
                                               "reason": f"node {a} lost"}


def running_on(api: Any, node: str) -> tuple[dict[str, Any], str]:
    """A running deployment of one 1-CPU python replica, placed on `node`, with its live worker
    row there: the deployment and its worker id."""
    wf = create_workflow(api, spec({"resources": {"cpus": 1}}))
    d = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json").json()
    assert slots(d) == [("py", 0, node)]
    Deployment.objects.filter(pk=d["id"]).update(status="running")
    worker = f"py-{node}-1"
    records.add_workers(d["id"], [records.StartedWorker(worker, "py", "tcp://10.0.0.1:1", node, 999_999)])
    return d, worker


def on_agents(nodes: Nodes, api: Any, ttl_s: float) -> tuple[dict[str, NodeAnnouncer], dict[str, Any], str]:
    """Nodes a (1 CPU) and b (2 CPUs), each announced by its agent once; a running deployment whose
    one replica is on b, with its live worker row there: the agents, the deployment, its worker."""
    agents = {"a": nodes.agent("a", cpus=1, ttl_s=ttl_s), "b": nodes.agent("b", cpus=2, ttl_s=ttl_s)}
    for agent in agents.values():
        agent.announce()
    b = agents["b"].config.node_name
    d, worker = running_on(api, b)
    return agents, d, worker


def test_a_redis_flush_loses_no_node_and_moves_no_replica(nodes: Nodes, api: Any) -> None:
    """Redis flushed: the directory forgets both nodes, but their agents' heartbeats (kept in the
    database) have not lapsed, so the supervision tick marks nothing lost and moves nothing; each
    agent's next announcement puts its node back. The directory's own word still stands: a node
    it knows without a live lease is lost whatever its row says."""
    agents, d, worker = on_agents(nodes, api, ttl_s=30)
    b = agents["b"].config.node_name
    before = Deployment.objects.get(pk=d["id"])
    nodes.flush()
    assert nodes.directory.known() == []
    assert failover.sweep(nodes.config) == []
    after = Deployment.objects.get(pk=d["id"])
    assert (after.placement, after.error, after.updated_at) == (before.placement, "", before.updated_at)
    assert Worker.objects.get(worker_id=worker).status == WorkerStatus.READY

    for agent in agents.values():
        agent.announce()
    assert {s.record.name: (s.live, s.record.free) for s in nodes.directory.known()} == {
        agents["a"].config.node_name: (True, Amounts(0, 1, 16)), b: (True, Amounts(0, 1, 16))}
    assert failover.sweep(nodes.config) == []

    nodes.directory.withdraw(b)  # known to the directory, its lease ended: lost, fresh row or not
    (rehomed,) = failover.sweep(nodes.config)
    assert rehomed.lost_nodes == (b,) and rehomed.lost_workers == (worker,)
    assert slots(Deployment.objects.get(pk=d["id"])) == [("py", 0, agents["a"].config.node_name)]


def test_a_node_that_dies_across_a_flush_is_lost_once_its_heartbeat_lapses(nodes: Nodes, api: Any) -> None:
    """Redis flushed and node b's agent gone with it: b is unknown, not lost, while its kept
    heartbeat's lease runs; at the first tick after that lease lapsed (by the database's clock)
    it is lost and its replica moves to a, whose agent kept announcing. Ticks come every quarter
    TTL, so that is within two TTLs of b's last heartbeat."""
    agents, d, worker = on_agents(nodes, api, ttl_s=5)
    a, b = (agents[n].config.node_name for n in ("a", "b"))
    for agent in agents.values():
        agent.announce()  # b's last heartbeat
    nodes.flush()
    agents["a"].announce()
    if NodeHeartbeat.objects.filter(name=b, lapses_at__gt=timezone.now()).exists():  # b's lease still runs
        assert failover.sweep(nodes.config) == []
        assert slots(Deployment.objects.get(pk=d["id"])) == [("py", 0, b)]
    deadline = time.monotonic() + 30
    while not NodeHeartbeat.objects.filter(name=b, lapses_at__lt=Now()).exists():
        assert time.monotonic() < deadline, "node b's kept lease did not lapse"
        time.sleep(0.05)  # polling the database for the end of b's lease
    agents["a"].announce()
    (rehomed,) = failover.sweep(nodes.config)
    assert rehomed.lost_nodes == (b,) and rehomed.lost_workers == (worker,)
    assert slots(Deployment.objects.get(pk=d["id"])) == [("py", 0, a)]
    assert Worker.objects.get(worker_id=worker).status == WorkerStatus.LOST


def test_after_a_redis_restart_a_node_forgotten_waits_a_lease_from_redis_return(nodes: Nodes) -> None:
    """A Redis that came back empty less than a TTL ago has not given the agents their chance to
    announce (maybe after an outage in which no announcement could land): a node it does not know
    is unknown, even with its kept lease lapsed or no row at all; lost once Redis has been up a TTL.
    A node without a row is lost only once the directory has also kept its memory for a TTL."""
    NodeHeartbeat.objects.create(name="lapsed", seen_at=timezone.now() - datetime.timedelta(seconds=60),
                        lapses_at=timezone.now() - datetime.timedelta(seconds=50), ttl_s=10)
    NodeHeartbeat.objects.create(name="fresh", seen_at=timezone.now(),
                        lapses_at=timezone.now() + datetime.timedelta(seconds=60), ttl_s=60)
    placed = ["lapsed", "fresh", "never"]
    young = liveness.judge([], placed, redis_up_s=3, remembered_s=3, default_ttl_s=5)
    assert (young.lost, young.unknown) == (frozenset(), frozenset(placed))
    old = liveness.judge([], placed, redis_up_s=3600, remembered_s=3600, default_ttl_s=5)
    assert (old.lost, old.unknown) == ({"lapsed", "never"}, {"fresh"})
    at_ttl = liveness.judge([], placed, redis_up_s=10, remembered_s=10, default_ttl_s=20)
    assert (at_ttl.lost, at_ttl.unknown) == ({"lapsed"}, {"fresh", "never"})
    flushed = liveness.judge([], placed, redis_up_s=3600, remembered_s=3, default_ttl_s=5)
    assert (flushed.lost, flushed.unknown) == ({"lapsed"}, {"fresh", "never"})


def remembered_for(nodes: Nodes, seconds: float) -> None:
    """Wait until the node directory has kept its memory `seconds` (the first reading marks it)."""
    deadline = time.monotonic() + seconds + 10
    while nodes.directory.remembered_s() < seconds:
        assert time.monotonic() < deadline, f"the node directory did not remember for {seconds} s"
        time.sleep(0.05)  # polling Redis's clock


def test_a_node_placed_before_heartbeats_were_kept_survives_every_flush(nodes: Nodes, api: Any) -> None:
    """Node b is announced in the directory only, as by an agent started before heartbeat rows
    were kept (still running through the upgrade): it has workers placed on it and no row. A
    flush leaves it unknown, not lost, for a TTL from the first tick that found the directory
    emptied; its agent's next announcement puts it back, and the next flush, a TTL later, gives it
    its grace again. When it stays away, it is lost at the first tick after that grace."""
    config = dataclasses.replace(nodes.config, node=dataclasses.replace(nodes.config.node, ttl_s=1.0))
    agent_a = nodes.agent("a", cpus=1, ttl_s=30)
    agent_a.announce()
    a, b = agent_a.config.node_name, nodes.up("b", cpus=2)
    d, worker = running_on(api, b)
    assert not NodeHeartbeat.objects.filter(name=b).exists()
    before = Deployment.objects.get(pk=d["id"])
    for _ in range(2):
        remembered_for(nodes, config.node.ttl_s)  # a grace an earlier flush gave is over
        nodes.flush()
        agent_a.announce()
        assert failover.sweep(config) == []  # b unknown: nothing lost, nothing moved
        after = Deployment.objects.get(pk=d["id"])
        assert (after.placement, after.error, after.updated_at) == (before.placement, "", before.updated_at)
        assert Worker.objects.get(worker_id=worker).status == WorkerStatus.READY
        nodes.up("b", cpus=2)  # its agent's next announcement
        assert failover.sweep(config) == []
    nodes.flush()
    agent_a.announce()
    assert failover.sweep(config) == []
    remembered_for(nodes, config.node.ttl_s)  # b's agent stayed away for the grace
    (rehomed,) = failover.sweep(config)
    assert rehomed.lost_nodes == (b,) and rehomed.lost_workers == (worker,)
    assert slots(Deployment.objects.get(pk=d["id"])) == [("py", 0, a)]
    assert Worker.objects.get(worker_id=worker).status == WorkerStatus.LOST


def test_the_nodes_list_keeps_nodes_a_flush_took_while_their_kept_lease_runs(nodes: Nodes, api: Any,
                                                                               other_user: Any) -> None:
    """After a flush, `/api/nodes/` lists the nodes whose kept lease runs as their last heartbeat
    announced them, with the same keys and values and `"source": "kept-lease"`, until their agents
    announce them again; a node whose kept lease lapsed, or whose row has no record, is not
    listed, and the directory's word stands for the nodes it knows."""
    agents, d, worker = on_agents(nodes, api, ttl_s=30)
    a, b = (agents[n].config.node_name for n in ("a", "b"))
    for agent in agents.values():
        agent.announce()  # the records now say what the deployment takes
    gone = nodes.agent("c", cpus=1, ttl_s=0.5)
    gone.announce()
    c = gone.config.node_name
    NodeHeartbeat.objects.create(name=f"{nodes.tag}-old", seen_at=timezone.now(), ttl_s=30,
                                 lapses_at=timezone.now() + datetime.timedelta(seconds=30))  # before records
    announced = {n["name"]: n for n in api.get("/api/nodes/").json()}
    assert set(announced) == {a, b, c}  # the row without a record is not a node of the list
    assert set(announced[b]) == {"name", "status", "address", "labels", "total", "free", "gpus", "hosting",
                                 "seen_at", "started_at", "ttl_s", "workers", "source"}
    assert {announced[n]["source"] for n in (a, b, c)} == {"announced"}
    assert [w["worker_id"] for w in announced[b]["workers"]] == [worker]
    assert [h["deployment"] for h in announced[b]["hosting"]] == [d["id"]]

    deadline = time.monotonic() + 30
    while not NodeHeartbeat.objects.filter(name=c, lapses_at__lt=Now()).exists():
        assert time.monotonic() < deadline, "node c's kept lease did not lapse"
        time.sleep(0.05)  # polling the database for the end of c's lease
    nodes.flush()
    assert nodes.directory.known() == []
    kept = api.get("/api/nodes/").json()
    assert [n["name"] for n in kept] == [a, b]  # by name; c's lease lapsed, the row without a record shows nothing
    for node in kept:
        assert node == announced[node["name"]] | {"source": "kept-lease"}
    theirs = {n["name"]: n for n in client_for(other_user).get("/api/nodes/").json()}
    assert (theirs[b]["workers"], theirs[b]["hosting"], theirs[b]["source"]) == ([], [], "kept-lease")

    agents["a"].announce()  # a is back in the directory; b is still kept
    assert [(n["name"], n["status"], n["source"]) for n in api.get("/api/nodes/").json()] == [
        (a, "live", "announced"), (b, "live", "kept-lease")]
    agents["b"].announce()
    nodes.directory.withdraw(b)  # the directory's word: lost, fresh kept lease or not, and listed once
    assert [(n["name"], n["status"], n["source"]) for n in api.get("/api/nodes/").json()] == [
        (a, "live", "announced"), (b, "lost", "announced")]


def test_a_node_back_from_being_lost_stops_what_it_no_longer_owns(nodes: Nodes, api: Any, tmp_path: Any) -> None:
    """Rows marked lost while the node was away (its workers cut off, not dead) end the processes
    still running for them when its agent sweeps again; live rows and other nodes' are left alone."""
    a = nodes.up("a")
    wf = create_workflow(api, spec({}))
    d = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json").json()
    procs = {name: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", name])
             for name in (f"py-{a}-lost", f"py-{a}-live", "py-elsewhere-lost")}
    try:
        for name, proc in procs.items():
            host = "elsewhere" if "elsewhere" in name else a
            records.add_workers(d["id"], [records.StartedWorker(name, "py", "", host, proc.pid)])
        records.set_worker_status([f"py-{a}-lost", "py-elsewhere-lost"], WorkerStatus.LOST)
        agent = NodeAgent(dataclasses.replace(nodes.config, node_name=a, data_dir=tmp_path))
        assert agent.reap() == [f"py-{a}-lost"]
        assert procs[f"py-{a}-lost"].wait(timeout=30) is not None
        assert procs[f"py-{a}-live"].poll() is None and procs["py-elsewhere-lost"].poll() is None
        assert agent.reap() == []  # gone: nothing more to do
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(timeout=10)


def registered(namespace: str) -> list[str]:
    """The worker ids the deployment's registry lists."""

    async def listed() -> list[str]:
        registry = make_registry(settings.OMNIFLOW.redis_url, namespace=namespace)
        try:
            return [s.worker_id for s in await registry.workers()]
        finally:
            await registry.close()

    return asyncio.run(listed())


@dataclasses.dataclass
class OnB:
    """A running deployment of one replica, placed on node b of nodes a and b, each with its agent."""

    a: str
    b: str
    d: dict[str, Any]
    namespace: str
    agents: dict[str, NodeAgent]


def running_on_b(nodes: Nodes, api: Any, tmp_path: Any) -> OnB:
    a, b = nodes.up("a", cpus=1), nodes.up("b", cpus=2)
    wf = create_workflow(api, spec({"resources": {"cpus": 1}}))
    d = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json").json()
    assert slots(d) == [("py", 0, b)]
    Deployment.objects.filter(pk=d["id"]).update(status="running")
    agents = {node: NodeAgent(dataclasses.replace(nodes.config, node_name=node, data_dir=tmp_path / node))
              for node in (a, b)}
    return OnB(a, b, d, Deployment.objects.get(pk=d["id"]).namespace, agents)


def start_on_b(on: OnB) -> tuple[str, psutil.Process]:
    """Node b's agent starts the replica: its worker id and process."""
    ticket = records.ticket(on.d["id"])
    assert ticket is not None
    (worker_id,) = on.agents[on.b].reconcile(ticket).started
    return worker_id, psutil.Process(Worker.objects.get(worker_id=worker_id).pid)


def test_a_cut_off_nodes_live_workers_are_fenced_and_only_their_replacements_serve(nodes: Nodes, api: Any,
                                                                                   tmp_path: Any) -> None:
    """Node b drops out of the node directory (its agent gone) while its worker still runs and
    still reaches Redis: failover fences the worker, which stops itself instead of registering
    again beside its replacement, so the deployment's registry lists the replacement on a only.
    When b comes back, its agent has nothing left to end."""
    on = running_on_b(nodes, api, tmp_path)
    a, b, d, namespace, agents = on.a, on.b, on.d, on.namespace, on.agents
    zombie: psutil.Process | None = None
    try:
        cut_off, zombie = start_on_b(on)
        assert registered(namespace) == [cut_off]

        nodes.down("b")
        (rehomed,) = failover.sweep(nodes.config)
        assert rehomed.lost_workers == (cut_off,) and slots(Deployment.objects.get(pk=d["id"])) == [("py", 0, a)]
        assert Worker.objects.get(worker_id=cut_off).status == WorkerStatus.LOST
        zombie.wait(timeout=30)  # fenced: it drains and exits by itself, nobody signals it
        log = (tmp_path / b / "deployments" / d["id"] / f"{cut_off}.log").read_text()
        assert f"worker {cut_off!r} was fenced" in log

        ticket = records.ticket(d["id"])  # what node a's agent gets from the `deploy` the sweep sent
        assert ticket is not None
        (replacement,) = agents[a].reconcile(ticket).started
        assert registered(namespace) == [replacement]

        nodes.up("b", cpus=2)
        assert agents[b].reap() == []  # the fenced worker ended itself
        assert registered(namespace) == [replacement]  # and never came back
    finally:
        agents[a].stop(d["id"])
        if zombie is not None and zombie.is_running():
            zombie.kill()


def test_fences_a_redis_flush_took_are_restored_from_the_rows(nodes: Nodes, api: Any, tmp_path: Any) -> None:
    """Node b is cut off (its worker paused: no heartbeat reaches Redis) and failover fences its
    worker; then Redis is flushed (it keeps nothing on disk), taking the tombstone. The worker
    resumes and registers again beside its replacement, as nothing in Redis forbids it; the next
    supervision tick fences it again from its lost row, and it stops itself."""
    on = running_on_b(nodes, api, tmp_path)
    a, b, d, namespace, agents = on.a, on.b, on.d, on.namespace, on.agents
    zombie: psutil.Process | None = None
    try:
        cut_off, zombie = start_on_b(on)
        zombie.suspend()  # cut off: it neither heartbeats nor sees its fence

        nodes.down("b")
        (rehomed,) = failover.sweep(nodes.config)
        assert rehomed.lost_workers == (cut_off,)
        assert failover.restore_fences(nodes.config) == {}  # fenced: nothing to restore
        client = redis.Redis.from_url(nodes.config.redis_url)
        try:
            client.flushdb()  # this test's database only: the tombstone, and everything else, gone
        finally:
            client.close()
        nodes.up("a", cpus=1)
        ticket = records.ticket(d["id"])
        assert ticket is not None
        (replacement,) = agents[a].reconcile(ticket).started

        zombie.resume()  # back: its record is gone, and so is the fence that refused it
        deadline = time.monotonic() + 30
        while registered(namespace) != sorted([cut_off, replacement]) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling Redis for its registration
        assert registered(namespace) == sorted([cut_off, replacement])  # the attack: both serve

        assert failover.restore_fences(nodes.config) == {namespace: [cut_off]}
        assert registered(namespace) == [replacement]
        zombie.wait(timeout=30)  # fenced again: it drains and exits by itself
        log = (tmp_path / b / "deployments" / d["id"] / f"{cut_off}.log").read_text()
        assert f"worker {cut_off!r} was fenced" in log
        assert registered(namespace) == [replacement]
        assert failover.restore_fences(nodes.config) == {}

        nodes.up("b", cpus=2)
        assert agents[b].reap() == []  # it ended itself
    finally:
        agents[a].stop(d["id"])
        if zombie is not None and zombie.is_running():
            zombie.resume()
            zombie.kill()


def test_nodes_show_only_your_workers(nodes: Nodes, api: Any, other_user: Any) -> None:
    a = nodes.up("a")
    wf = create_workflow(api, spec({}))
    d = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json").json()
    records.add_workers(d["id"], [records.StartedWorker(f"py-{a}-1", "py", "tcp://10.0.0.1:1", a, 1234)])
    mine = {n["name"]: n for n in api.get("/api/nodes/").json()}[a]
    assert [w["worker_id"] for w in mine["workers"]] == [f"py-{a}-1"]
    theirs = {n["name"]: n for n in client_for(other_user).get("/api/nodes/").json()}[a]
    assert theirs["workers"] == [] and theirs["hosting"] == [] and theirs["labels"] == mine["labels"]


def test_a_nodes_model_roots_are_cut_out_of_the_errors_users_read_and_never_listed(nodes: Nodes, api: Any,
                                                                                    tmp_path: Any) -> None:
    """A node's processes report errors naming its own model directories and model cache, which the
    studio's own roots do not cover when that node's data dir is elsewhere: the node announces them
    (kept with its heartbeat), and the deployment and worker errors users read have them cut out."""
    elsewhere = tmp_path / "node-b-models"
    node = dataclasses.replace(nodes.config.node, cpus=4, gpus=0, memory_gb=16, ttl_s=30)
    agent = NodeAnnouncer(dataclasses.replace(nodes.config, node_name=f"{nodes.tag}-b", node=node,
                                              model_dirs=(elsewhere,)))
    agent.announce()
    assert elsewhere in liveness.model_roots()
    listed = {n["name"]: n for n in api.get("/api/nodes/").json()}[f"{nodes.tag}-b"]
    assert str(elsewhere) not in str(listed)
    wf = create_workflow(api, spec({}))
    d = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json").json()
    error = f"ModelLoadError: {elsewhere}/org/broken/config.json: not a JSON file"
    Deployment.objects.filter(pk=d["id"]).update(status="failed", error=error)
    records.add_workers(d["id"], [records.StartedWorker(f"py-{nodes.tag}-b-1", "py", "tcp://10.0.0.1:1",
                                                        f"{nodes.tag}-b", 1234)])
    Worker.objects.filter(deployment_id=d["id"]).update(status=WorkerStatus.FAILED, error=error)
    shown = api.get(f"/api/deployments/{d['id']}/").json()
    assert shown["error"] == "ModelLoadError: org/broken/config.json: not a JSON file"
    assert [w["error"] for w in shown["workers"]] == ["ModelLoadError: org/broken/config.json: not a JSON file"]
