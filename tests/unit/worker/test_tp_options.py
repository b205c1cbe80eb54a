"""A role worker's options (tensor-parallel seats, the stall timeout, module ops), and the worker ids of a
replica's ranks."""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

import pytest

from engine.data.rendezvous import listening_socket
from engine.flow.dsl import Workflow
from engine.spec.graph import encode_spec
from engine.worker.launcher import leader_worker_id, rank_worker_id
from engine.worker.options import WorkerOptionError, add_worker_arguments, worker_config


@pytest.fixture
def workflow(tmp_path: Path) -> Path:
    wf = Workflow("tp")
    wf.role("one", kind="llm", model="tiny-llama")
    wf.role("two", kind="llm", model="tiny-llama", tp_size=2)
    wf.input("x", "json")
    path = tmp_path / "tp.json"
    path.write_bytes(encode_spec(wf.to_spec()))
    return path


def parse(workflow: Path, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser.parse_args(["--workflow", str(workflow), "--plaintext", *argv])  # keys: test_plane_options


def test_ranks_of_a_tp_role_get_their_seat(workflow: Path):
    config = worker_config(parse(workflow, "--role", "two", "--tp-rank", "1", "--tp-address", "tcp://127.0.0.1:5"))
    assert (config.role.tp_size, config.tp_rank, config.tp_address) == (2, 1, "tcp://127.0.0.1:5")
    assert worker_config(parse(workflow, "--role", "one")).tp_address is None


def test_rank_0_takes_an_inherited_listening_socket(workflow: Path):
    listener, address = listening_socket()
    with listener:
        config = worker_config(parse(workflow, "--role", "two", "--tp-address", address,
                                     "--tp-listen-fd", str(listener.fileno())))
        assert config.tp_listen_fd == listener.fileno()
        assert address.startswith("tcp://127.0.0.1:") and listener.getsockname()[1] == int(address.rsplit(":", 1)[1])


def test_a_tp_listen_fd_that_is_not_a_listening_tcp_socket_is_refused(workflow: Path):
    unbound = socket.socket()
    read_end, write_end = os.pipe()
    try:
        for fd in (unbound.fileno(), read_end, 9999):
            with pytest.raises(WorkerOptionError, match=f"--tp-listen-fd {fd}: not an open, listening TCP socket"):
                worker_config(parse(workflow, "--role", "two", "--tp-address", "tcp://127.0.0.1:5",
                                    "--tp-listen-fd", str(fd)))
    finally:
        unbound.close()
        os.close(read_end)
        os.close(write_end)


@pytest.mark.parametrize(("argv", "message"), [
    (("--role", "two"), "give --tp-address"),
    (("--role", "two", "--tp-address", "127.0.0.1:5"), "give --tp-address"),
    (("--role", "two", "--tp-rank", "2", "--tp-address", "tcp://127.0.0.1:5"), "has ranks 0..1"),
    (("--role", "two", "--tp-rank", "-1", "--tp-address", "tcp://127.0.0.1:5"), "has ranks 0..1"),
    (("--role", "one", "--tp-rank", "1"), "has tp_size 1"),
    (("--role", "one", "--tp-address", "tcp://127.0.0.1:5"), "has tp_size 1"),
    (("--role", "one", "--tp-listen-fd", "0"), "has tp_size 1"),
    (("--role", "two", "--tp-rank", "1", "--tp-address", "tcp://127.0.0.1:5", "--tp-listen-fd", "0"),
     "only rank 0 hosts the rendezvous"),
])
def test_bad_tp_options_are_refused(workflow: Path, argv: tuple[str, ...], message: str):
    with pytest.raises(WorkerOptionError, match=message):
        worker_config(parse(workflow, *argv))


def test_rank_worker_ids_name_their_leader():
    assert rank_worker_id("tp-two-0-99", 0) == "tp-two-0-99"
    assert rank_worker_id("tp-two-0-99", 3) == "tp-two-0-99.tp3"
    assert leader_worker_id("tp-two-0-99.tp3") == "tp-two-0-99"
    assert leader_worker_id("tp-two-0-99") is None
    assert leader_worker_id("tp-two-0-99.tp0") is None
    assert leader_worker_id("a.tpx") is None


def test_the_stall_timeout_defaults_to_a_minute_and_refuses_negative_or_nan(workflow: Path):
    assert worker_config(parse(workflow, "--role", "one")).stall_timeout_s == 60.0
    assert worker_config(parse(workflow, "--role", "one", "--stall-timeout", "0")).stall_timeout_s == 0.0
    for bad in ("-1", "nan"):
        with pytest.raises(WorkerOptionError, match=f"--stall-timeout {float(bad)}: must be 0"):
            worker_config(parse(workflow, "--role", "one", "--stall-timeout", bad))


def test_module_ops_are_allowed_on_the_command_line_unless_refused(workflow: Path):
    assert worker_config(parse(workflow, "--role", "one")).allow_module_ops is True
    assert worker_config(parse(workflow, "--role", "one", "--no-module-ops")).allow_module_ops is False
    assert worker_config(parse(workflow, "--role", "one", "--module-ops")).allow_module_ops is True
