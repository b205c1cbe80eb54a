"""The node directory against the real Redis at REDIS_URL: a node is live while its agent
announces it, lost (still known, with its last record) once the lease lapses or it withdraws,
gone once forgotten; a flush forgets every node, which says nothing of how long Redis has been
up but starts the directory's memory anew. Each test uses its own namespace and deletes its keys afterwards."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from engine.flow.discovery.nodes import GpuInfo, NodeDirectory, NodeDirectoryError, NodeRecord
from engine.spec.resources import Amounts

pytestmark = pytest.mark.redis

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
def directory() -> Iterator[NodeDirectory]:
    namespace = f"test-nodes-{uuid.uuid4().hex[:8]}"
    nodes = NodeDirectory(REDIS_URL, namespace)
    yield nodes
    nodes.close()
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(f"{namespace}:*"):
        client.delete(key)
    client.close()


def record(name: str, ttl_s: float = 5.0, **changes: object) -> NodeRecord:
    base = {"name": name, "address": "10.0.0.2", "total": Amounts(1, 8, 32), "free": Amounts(0, 6, 30),
            "gpus": (GpuInfo(0, "H200", 141.0),), "labels": {"kind": "gpu"}, "hosting": {"d1": {"llm": 1}},
            "agent_pid": 42, "started_at": 1.0, "seen_at": time.time(), "ttl_s": ttl_s}
    return NodeRecord(**{**base, **changes})  # type: ignore[arg-type]


def test_a_node_is_live_while_announced_then_lost_then_forgotten(directory: NodeDirectory) -> None:
    directory.announce(record("a", ttl_s=0.3))
    directory.announce(record("b"))
    assert [r.name for r in directory.live()] == ["a", "b"]
    a = directory.live()[0]
    assert (a.total, a.free, a.gpu_memory_gb, a.labels, a.hosting) == (
        Amounts(1, 8, 32), Amounts(0, 6, 30), 141.0, {"kind": "gpu"}, {"d1": {"llm": 1}})
    deadline = time.monotonic() + 5
    while "a" in {r.name for r in directory.live()}:
        assert time.monotonic() < deadline, "the lease of node a did not lapse"
        time.sleep(0.05)
    states = {s.record.name: s for s in directory.known()}
    assert (states["a"].live, states["b"].live) == (False, True)
    assert states["a"].record.free == Amounts(0, 6, 30)  # its last record, shown as lost
    directory.announce(record("a", free=Amounts(1, 8, 32)))  # it came back
    assert {s.record.name: s.live for s in directory.known()} == {"a": True, "b": True}
    directory.withdraw("b")  # stopped on purpose: lost at once, still known
    assert {s.record.name: s.live for s in directory.known()} == {"a": True, "b": False}
    directory.forget("b")
    assert [s.record.name for s in directory.known()] == ["a"]


def test_a_flush_forgets_every_node_but_redis_stays_up(directory: NodeDirectory) -> None:
    directory.announce(record("a"))
    directory.withdraw("a")
    before = directory.up_s()
    assert before >= 0
    client = redis.Redis.from_url(REDIS_URL)
    since = f"{directory.namespace}:since"
    try:
        first = directory.remembered_s()  # the first reading marks the directory's memory as starting now
        mark = float(client.get(since))
        assert 0 <= first < 1 and directory.remembered_s() >= first and float(client.get(since)) == mark
        client.flushdb()  # this test's database only
        assert directory.known() == []  # neither live nor lost: unknown
        assert directory.up_s() >= before
        assert client.get(since) is None  # the flush took the mark with the nodes
        assert 0 <= directory.remembered_s() < 1 and float(client.get(since)) > mark  # marked anew
    finally:
        client.close()
    directory.announce(record("a"))
    assert [(s.record.name, s.live) for s in directory.known()] == [("a", True)]


def test_bad_records_and_an_unreachable_redis_are_errors(directory: NodeDirectory) -> None:
    with pytest.raises(ValueError, match="positive ttl_s"):
        directory.announce(record("a", ttl_s=0))
    client = redis.Redis.from_url(REDIS_URL)
    client.hset(f"{directory.namespace}:nodes", "x", b'{"name": "x"}')
    client.close()
    with pytest.raises(NodeDirectoryError, match="node 'x' has a malformed record"):
        directory.known()
    away = NodeDirectory("redis://127.0.0.1:1/0", "nowhere", op_timeout_s=0.5)
    with pytest.raises(NodeDirectoryError, match="reading the node directory failed"):
        away.known()
    with pytest.raises(NodeDirectoryError, match="announcing node 'a' failed"):
        away.announce(record("a"))
    with pytest.raises(NodeDirectoryError, match="reading how long Redis has been up failed"):
        away.up_s()
    with pytest.raises(NodeDirectoryError, match="how long the node directory has remembered failed"):
        away.remembered_s()
    away.close()
