"""Nodes of a distributed studio on one machine, for the multi-node tests.

Each node is a network namespace (`engine.bench.netns.Lan`: namespaces on a private bridge,
made and deleted by the test) running its own node agent: a Celery worker consuming
`node.<name>` (node `a` also the run queue), with its own `OMNIFLOW_NODE_LABELS` and resource
overrides. Its role workers inherit the namespace and listen on the node's address.

How the namespaces reach the machine's servers, which listen on 127.0.0.1 only:

* Redis through a TCP forwarder this fixture owns (`tests.tcp_forward`), listening on the
  LAN's host address (inside the test's namespaces only) and connecting to REDIS_URL's server:
  the nodes use the same Redis database as the studio in the test process (broker, worker
  registry, node directory, KV index), as machines sharing one Redis would;
* PostgreSQL through its Unix socket (`/var/run/postgresql`): filesystem sockets do not
  belong to a network namespace. Without the socket the tests skip, saying so (a SQLite test
  database is a file, reached as it is).

Everything started here is stopped here, even when a test fails: closing the LAN SIGKILLs
whatever still runs in a node's namespace (agents and role workers) before deleting it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from engine.bench._netns import Lan, NetNode
from engine.flow.discovery.nodes import NodeDirectory, NodeDirectoryError

ROOT = Path(__file__).resolve().parents[2]
PG_SOCKET_DIR = "/var/run/postgresql"
NODE_TTL_S = 3.0  # announced every second: a node survives two announcements lost under load
SUPERVISE_S = 0.5


def unix_socket_database_url(tcp_url: str) -> str | None:
    """The PostgreSQL URL `tcp_url` names, reached through the server's Unix socket (None when
    the socket is not there); a SQLite URL as it is (its file is reachable from any namespace)."""
    if tcp_url.startswith("sqlite:"):
        return tcp_url
    if not os.path.exists(os.path.join(PG_SOCKET_DIR, ".s.PGSQL.5432")):
        return None
    parts = urlsplit(tcp_url)
    auth = parts.username or "postgres"
    if parts.password:
        auth += f":{parts.password}"
    return f"postgres://{auth}@{parts.path}?host={PG_SOCKET_DIR}" + (f"&{parts.query}" if parts.query else "")


@dataclass
class NodeProc:
    """A node agent in its namespace."""

    name: str
    net: NetNode
    env: dict[str, str]
    queues: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*self.net.exec_prefix, sys.executable, "-m", "celery", "-A", "studio", "worker", "-P", "solo",
                 "-Q", ",".join(self.queues), "-n", f"{self.name}@%h", "--without-gossip", "--without-mingle",
                 "--without-heartbeat", "-l", "info"],
                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def pids(self) -> list[int]:
        """Every process in the node's namespace (its agent and its role workers)."""
        out = subprocess.run(["ip", "netns", "pids", self.net.namespace], capture_output=True, text=True,
                             timeout=20).stdout
        return [int(p) for p in out.split()]

    def kill(self) -> list[int]:
        """SIGKILL the agent and every role worker of the node: the machine died."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)
        return pids

    def tail(self) -> str:
        return f"--- node {self.name}\n{self.log.read_text(errors='replace')[-3000:]}"


@dataclass
class NodeCluster:
    lan: Lan
    prefix: str
    run_queue: str
    redis_url: str
    """Redis as this (the test's) process reaches it."""
    nodes: dict[str, NodeProc] = field(default_factory=dict)

    def directory(self) -> NodeDirectory:
        return NodeDirectory(self.redis_url, f"{self.prefix}-nodes")

    def live(self) -> set[str]:
        directory = self.directory()
        try:
            return {r.name for r in directory.live()}
        finally:
            directory.close()

    def logs(self) -> str:
        return "\n".join(n.tail() for n in self.nodes.values())

    def wait_for(self, what: str, check: Callable[[], Any], deadline_s: float = 60.0) -> Any:
        """Poll `check` until it returns something true; fails with every node's log when the
        deadline passes. The pause is a check that the node agents still run."""
        deadline = time.monotonic() + deadline_s
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {deadline_s} s\n{self.logs()}")
            time.sleep(0.1)

    def start(self, name: str) -> NodeProc:
        node = self.nodes[name]
        node.start()
        self.wait_for(f"node {name} announced", lambda: node.name in self.live() or self._exited(node), 120)
        return node

    @staticmethod
    def _exited(node: NodeProc) -> bool:
        if node.proc is not None and node.proc.poll() is not None:
            raise RuntimeError(f"node agent {node.name} exited with {node.proc.returncode}\n{node.tail()}")
        return False


@contextlib.contextmanager
def node_cluster(tmp: Path, redis_url: str, database_url: str, nodes: dict[str, dict[str, str]],
                 run_node: str) -> Iterator[NodeCluster]:
    """Node agents in namespaces, one per `nodes` entry (name -> its extra environment: labels,
    resource overrides); `run_node` also executes runs."""
    tag = secrets.token_hex(3)
    prefix, run_queue = f"of{tag}", f"of{tag}-runs"
    redis = urlsplit(redis_url)
    with Lan.make(list(nodes)) as lan:
        forward = subprocess.Popen([sys.executable, "-m", "tests.tcp_forward", lan.host_address,
                                    f"{redis.hostname or '127.0.0.1'}:{redis.port or 6379}"],
                                   cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert forward.stdout is not None
            line = forward.stdout.readline()
            if not line.startswith("FORWARDING "):
                raise RuntimeError(f"the Redis forwarder did not start: {line!r}")
            auth = f"{redis.username or ''}:{redis.password}@" if redis.password else ""
            node_redis = f"redis://{auth}{lan.host_address}:{int(line.split()[1])}{redis.path or '/0'}"
            cluster = NodeCluster(lan, prefix, run_queue, redis_url)
            for name, extra in nodes.items():
                net = lan.nodes[name]
                node_name = f"{tag}-{name}"
                env = {**os.environ, "DJANGO_SETTINGS_MODULE": "studio.settings", "DATABASE_URL": database_url,
                       "REDIS_URL": node_redis, "OMNIFLOW_REDIS_PREFIX": prefix, "OMNIFLOW_DISPATCH": "celery",
                       "OMNIFLOW_NODE": node_name, "OMNIFLOW_RUN_QUEUE": run_queue,
                       "OMNIFLOW_WORKER_LISTEN": f"tcp://{net.address}:0", "OMNIFLOW_NODE_TTL_S": str(NODE_TTL_S),
                       "OMNIFLOW_NODE_SUPERVISE_S": str(SUPERVISE_S), "OMNIFLOW_WORKER_MAX_RESTARTS": "2",
                       "OMNIFLOW_ALLOW_MODULE_OPS": "1", "OMNIFLOW_DATA_DIR": str(tmp / name),
                       "OMNIFLOW_DB_POOL": "4", "PYTHONPATH": str(ROOT), **extra}
                env.pop("OMNIFLOW_DEPLOY_NODE", None)
                env.pop("OMNIFLOW_HOST_ID", None)
                queues = [f"node.{node_name}", *([run_queue] if name == run_node else [])]
                cluster.nodes[name] = NodeProc(node_name, net, env, queues, tmp / f"node-{name}.log")
            try:
                for name in nodes:
                    cluster.nodes[name].start()
                for name, node in cluster.nodes.items():
                    cluster.wait_for(f"node {name} announced", lambda n=node: n.name in cluster.live()
                                     or cluster._exited(n), 180)
                yield cluster
            finally:
                for node in cluster.nodes.values():
                    if node.proc is not None and node.proc.poll() is None:
                        node.proc.send_signal(signal.SIGTERM)
                for node in cluster.nodes.values():
                    if node.proc is not None:
                        try:
                            node.proc.wait(timeout=15)
                        except subprocess.TimeoutExpired:
                            node.proc.kill()
                            node.proc.wait(timeout=10)
                directory = cluster.directory()
                with contextlib.suppress(NodeDirectoryError):  # Redis away: their leases end them anyway
                    for node in cluster.nodes.values():
                        directory.forget(node.name)
                directory.close()
        finally:
            assert forward.stdin is not None
            forward.stdin.close()
            try:
                forward.wait(timeout=10)
            except subprocess.TimeoutExpired:
                forward.kill()
                forward.wait(timeout=10)
