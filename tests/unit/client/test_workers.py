"""The command lines `engine.client.workers.replica_processes` gives a node agent, read back by
the worker's own option parser and config (`engine.worker.options`): each rank gets its seat, its
id and the plane's keys; rank 0 alone inherits the rendezvous socket, which the block closes."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import pytest

from engine.client.keys import PlaneKeys
from engine.client.workers import WorkerOptions, replica_processes
from engine.flow.dsl import Workflow
from engine.spec.graph import encode_spec
from engine.worker.launcher import rank_worker_id
from engine.worker.options import add_worker_arguments, plane_keys, worker_config


@pytest.fixture
def options(tmp_path: Path) -> WorkerOptions:
    wf = Workflow("tp")
    wf.role("one", kind="llm", model="tiny-llama")
    wf.role("two", kind="llm", model="tiny-llama", tp_size=3)
    wf.input("x", "json")
    path = tmp_path / "tp.json"
    path.write_bytes(encode_spec(wf.to_spec()))
    keys = PlaneKeys.generate()
    return WorkerOptions(workflow=path, registry_url="redis://127.0.0.1:1/0", namespace="ns",
                         listen="tcp://127.0.0.1:0", heartbeat_s=0.25, registry_ttl_s=1.5,
                         keys_dir=keys.write(tmp_path / "keys"))


def parse(argv: tuple[str, ...]) -> argparse.Namespace:
    assert argv[:3] == (sys.executable, "-m", "engine.worker")
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser.parse_args(argv[3:])


def test_a_replica_without_tensor_parallelism_is_one_process(options: WorkerOptions):
    with replica_processes("one", "one-n1-ab", 1, options) as processes:
        assert [(p.worker_id, p.pass_fds) for p in processes] == [("one-n1-ab", ())]
        args = parse(processes[0].argv)
    assert (args.role, args.worker_id, args.registry, args.namespace, args.listen, args.heartbeat,
            args.registry_ttl) == ("one", "one-n1-ab", "redis://127.0.0.1:1/0", "ns", "tcp://127.0.0.1:0", 0.25, 1.5)
    assert plane_keys(args) == PlaneKeys.load(options.keys_dir)
    config = worker_config(args)
    assert (config.role.name, config.tp_rank, config.tp_address) == ("one", 0, None)
    assert not config.allow_module_ops  # registered ops only, unless the operator says otherwise


def test_module_ops_reach_a_worker_only_where_the_operator_allows_them(options: WorkerOptions):
    allowed = dataclasses.replace(options, allow_module_ops=True)
    with replica_processes("two", "two-n1-cd", 3, allowed) as processes:
        assert all(worker_config(parse(p.argv)).allow_module_ops for p in processes)
    with replica_processes("two", "two-n1-cd", 3, options) as processes:
        assert not any(worker_config(parse(p.argv)).allow_module_ops for p in processes)


def test_the_ranks_of_a_tensor_parallel_replica_meet_on_a_socket_handed_to_rank_0(options: WorkerOptions):
    with replica_processes("two", "two-n1-cd", 3, options) as processes:
        assert [p.worker_id for p in processes] == [rank_worker_id("two-n1-cd", r) for r in range(3)]
        ranks = [parse(p.argv) for p in processes]
        (fd,) = processes[0].pass_fds
        assert [p.pass_fds for p in processes[1:]] == [(), ()]
        os.fstat(fd)  # open here until the block ends
        configs = [worker_config(args) for args in ranks]
    assert [(c.worker_id, c.tp_rank) for c in configs] == [(rank_worker_id("two-n1-cd", r), r) for r in range(3)]
    assert len({c.tp_address for c in configs}) == 1 and configs[0].tp_address.startswith("tcp://127.0.0.1:")
    assert [args.tp_listen_fd for args in ranks] == [fd, None, None]
    with pytest.raises(OSError):
        os.fstat(fd)  # this process's copy is closed: only rank 0's remains


def test_every_rank_sees_its_replicas_gpus_and_holds_its_own_share(options: WorkerOptions):
    with replica_processes("two", "two-n1-cd", 3, options, gpus=(1, 2, 5, 6, 7, 0)) as processes:
        assert [p.gpus for p in processes] == [(1, 2), (5, 6), (7, 0)]
        assert [dict(p.env) for p in processes] == [
            {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1,2,5,6,7,0"}] * 3
    with replica_processes("one", "one-n1-ab", 1, options, gpus=(3,)) as processes:
        assert [(p.gpus, dict(p.env)) for p in processes] == [
            ((3,), {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "3"})]


def test_a_replica_without_gpus_leaves_the_environment_alone(options: WorkerOptions):
    with replica_processes("two", "two-n1-cd", 3, options) as processes:
        assert [(p.gpus, dict(p.env)) for p in processes] == [((), {})] * 3


def test_gpus_that_do_not_split_over_the_ranks_are_refused(options: WorkerOptions):
    with pytest.raises(ValueError, match="role 'two': 4 GPUs do not split evenly over 3 ranks"), \
            replica_processes("two", "two-n1-cd", 3, options, gpus=(0, 1, 2, 3)):
        pass
