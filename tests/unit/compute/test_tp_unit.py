"""The pure parts of a tensor-parallel role's ranks: devices, a follower watching rank 0, and the
pull timeout of a diffusion rank (what travels to the followers: `test_tp_mirror.py`)."""

from __future__ import annotations

import os
import select
import subprocess
import sys

import pytest

from engine.compute.llm.unit import LLMUnitError
from engine.compute.threaded import UnitInputError
from engine.compute.tp.diffusion_unit import pull_timeout_s
from engine.compute.tp.seat import LeaderWatch, rank_device
from engine.spec.graph import RoleSpec


def role(device: str, gpus: int | None = None) -> RoleSpec:
    return RoleSpec(name="lm", kind="llm", model="tiny-llama", tp_size=2, device=device,
                    resources={} if gpus is None else {"gpus": gpus})


@pytest.mark.parametrize(("device", "gpus", "ranks"), [
    ("cpu", None, ["cpu", "cpu"]),
    ("cuda", None, ["cuda:0", "cuda:1"]),
    ("cuda", 1, ["cuda:0", "cuda:1"]),
    ("cuda", 2, ["cuda:0", "cuda:2"]),
    ("cuda:2", None, ["cuda:2", "cuda:3"]),
])
def test_each_rank_gets_its_own_gpus_or_the_cpu(device, gpus, ranks):
    assert [rank_device(role(device, gpus), r) for r in range(2)] == ranks


@pytest.mark.parametrize("device", ["mps", "cuda:x", "tpu:0"])
def test_other_devices_are_refused(device):
    with pytest.raises(LLMUnitError, match="runs on cpu or cuda"):
        rank_device(role(device), 0)


def test_a_follower_sees_rank_0_gone_even_before_it_is_reaped():
    """Rank 0 dead but not yet reaped by its parent (a zombie still answers kill(pid, 0)) is gone."""
    leader = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    watch = LeaderWatch(None, leader.pid)
    try:
        assert watch.gone() is None
        exited = os.pidfd_open(leader.pid)
        try:
            leader.stdin.close()  # it exits; nobody reaps it yet
            assert select.select([exited], [], [], 30.0)[0], "the stand-in for rank 0 did not exit"
        finally:
            os.close(exited)
        assert watch.gone() == f"rank 0 (pid {leader.pid}) is gone"
    finally:
        watch.close()
        leader.kill()
        leader.wait(10)


def test_a_follower_of_a_vanished_rank_0_stops():
    leader = subprocess.Popen([sys.executable, "-c", "pass"])
    leader.wait(30)
    watch = LeaderWatch(None, leader.pid)
    try:
        assert watch.gone() == f"rank 0 (pid {leader.pid}) is gone"
    finally:
        watch.close()


def test_a_tp_diffusion_rank_pulls_within_half_the_group_timeout() -> None:
    def of(**params) -> RoleSpec:
        return RoleSpec(name="dif", kind="diffusion", model="tiny-llama", tp_size=2, params=params)

    assert pull_timeout_s(of()) == 5.0  # half the default tp_timeout_s
    assert pull_timeout_s(of(tp_timeout_s=3.0)) == 1.5
    assert pull_timeout_s(of(tp_timeout_s=3.0, pull_timeout_s=1)) == 1.0
    for bad in (2.0, 0, -1, True, "1"):
        with pytest.raises(UnitInputError, match="pull_timeout_s must be a positive number of seconds at most half"):
            pull_timeout_s(of(tp_timeout_s=3.0, pull_timeout_s=bad))
