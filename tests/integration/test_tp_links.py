"""The links between the ranks of a tensor-parallel replica stay on loopback: torch's
rendezvous store and gloo's connections are not authenticated, so they must not be reachable
from another host. Attacked where it matters: inside a network namespace (a node of the test's
own LAN) whose hostname resolves to its LAN address, the address gloo binds when left alone."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.bench._netns import Lan, NetNode
from engine.compute.tp.group import TPError, TPGroup

ROOT = Path(__file__).resolve().parents[2]

RANK = """
import subprocess, sys, torch
from engine.compute.tp.group import TPGroup
rank, address = int(sys.argv[1]), sys.argv[2]
group = TPGroup.init(rank, 2, address, timeout_s=30.0)
total = group.all_reduce_(torch.ones(1))
assert total.item() == 2.0, total
if rank == 0:  # every rank is up and linked: list the namespace's listening sockets
    print(subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout, flush=True)
group.min_int(0)  # a barrier: rank 1 stays until the listing is taken
group.close()
"""


@pytest.fixture
def node() -> Iterator[NetNode]:
    why = Lan.unavailable()
    if why is not None:
        pytest.skip(why)
    with Lan.make(["a"]) as lan:
        node = lan.nodes["a"]
        # `ip netns exec` puts /etc/netns/<namespace>/hosts over /etc/hosts: the hostname resolves
        # to the node's LAN address there, as on a machine whose name resolves to its LAN address.
        etc = Path("/etc/netns") / node.namespace
        etc.mkdir(parents=True)
        try:
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{node.address} {socket.gethostname()}\n")
            yield node
        finally:
            (etc / "hosts").unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                etc.rmdir()


def test_rendezvous_and_gloo_links_listen_on_loopback_only(node: NetNode) -> None:
    resolved = subprocess.run([*node.exec_prefix, "getent", "hosts", socket.gethostname()], capture_output=True,
                              text=True, timeout=20).stdout
    assert resolved.split()[0] == node.address  # what gloo would bind without the group's setting
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(name, None)
    address = "tcp://127.0.0.1:29611"  # the namespace is new: every port in it is free
    ranks = [subprocess.Popen([*node.exec_prefix, sys.executable, "-c", RANK, str(rank), address], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=120) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(ranks, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    pids = {str(p.pid) for p in ranks}
    listening = [line.split() for line in outs[0][0].splitlines() if line.strip()]
    ours = [fields[3] for fields in listening if any(f"pid={pid}," in fields[-1] for pid in pids)]
    # the store, and gloo's listener of each rank: three sockets, all on loopback
    assert len(ours) >= 3, listening
    assert all(local.rpartition(":")[0] in ("127.0.0.1", "[::ffff:127.0.0.1]") for local in ours), ours


def test_a_group_address_off_loopback_is_refused() -> None:
    with pytest.raises(TPError, match="meet on loopback"):
        TPGroup.init(1, 2, "tcp://10.0.0.5:29500", timeout_s=1.0)
