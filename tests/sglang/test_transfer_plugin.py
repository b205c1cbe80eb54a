"""The omniflow PD transfer backend: selected through SGLang's own `get_kv_class`, KV pages moved
between two processes bit-exact, and a dead or silent prefill failing the receiver in time."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.plugins import load_plugins

from engine.compute.sglang import plugin, transfer
from tests.sglang import polling
from tests.sglang import transfer_peer as peer

ROOT = Path(__file__).resolve().parents[2]
DEST_PAGES = [0, 8, 21, 2, 14, 31]
DEST_AUX = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def selected() -> None:
    """SGLang's plug-in loading, as every SGLang process does it at start."""
    entry = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == "omniflow"]
    assert [ep.value for ep in entry] == ["engine.compute.sglang.plugin:register"]
    load_plugins()
    # load_plugins runs once per process; a registration made before it is applied here.
    from sglang.srt.plugins.hook_registry import HookRegistry

    plugin.register()
    HookRegistry.apply_hooks()


def kv_class(kind: str) -> type:
    from sglang.srt.disaggregation import utils

    return utils.get_kv_class(utils.TransferBackend(plugin.TRANSFER_BACKEND), utils.KVClassType(kind))


def test_selected_through_sglang(selected: None) -> None:
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation import utils
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.fake.conn import FakeKVManager, FakeKVSender
    from sglang.srt.managers import disagg_service

    assert kv_class("manager") is transfer.OmniFlowKVManager
    assert kv_class("sender") is transfer.OmniFlowKVSender
    assert kv_class("receiver") is transfer.OmniFlowKVReceiver
    assert kv_class("bootstrap_server") is transfer.OmniFlowKVBootstrapServer
    assert kv_class("kvargs") is KVArgs
    # Every other backend still resolves to SGLang's own classes.
    assert utils.get_kv_class(utils.TransferBackend.FAKE, utils.KVClassType.MANAGER) is FakeKVManager
    assert utils.get_kv_class(utils.TransferBackend("fake"), utils.KVClassType.SENDER) is FakeKVSender
    # Modules that imported the enum and the function before the hooks see the new ones.
    assert disagg_service.TransferBackend is utils.TransferBackend
    assert disagg_service.get_kv_class is utils.get_kv_class
    assert not disagg_service.rust_server_serves_kv_bootstrap("omniflow")  # we bring our bootstrap server
    assert "omniflow" in DISAGG_TRANSFER_BACKEND_CHOICES
    plugin.register()  # idempotent
    assert DISAGG_TRANSFER_BACKEND_CHOICES.count("omniflow") == 1


def test_cli_accepts_the_backend(selected: None) -> None:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--disaggregation-transfer-backend", "omniflow",
                              "--sampling-backend", "omniflow"])
    assert args.disaggregation_transfer_backend == "omniflow"
    assert args.sampling_backend == "omniflow"


class Prefill:
    """A prefill process (`tests/sglang/transfer_peer.py`) whose stdout lines are awaited with deadlines."""

    def __init__(self, bootstrap_port: int, room: int, mode: str, timeout: float) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.sglang.transfer_peer", "--bootstrap-port", str(bootstrap_port),
             "--room", str(room), "--mode", mode, "--timeout", str(timeout)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.process.stdout, selectors.EVENT_READ)

    def line(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            if self._selector.select(remaining):
                line = self.process.stdout.readline()
                if not line:
                    raise AssertionError(f"prefill exited ({self.process.wait(5)}) before writing a line")
                return line.strip()
        raise AssertionError(f"no line from the prefill process within {timeout}s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self._selector.close()
        self.process.stdout.close()


@pytest.fixture
def bootstrap(selected: None) -> Iterator[transfer.OmniFlowKVBootstrapServer]:
    server = kv_class("bootstrap_server")("127.0.0.1", free_port())
    yield server
    server.close()


def decode_manager(kv: list[torch.Tensor], aux: list[torch.Tensor], port: int, timeout: float,
                   waiting_timeout: float | None = None) -> transfer.OmniFlowKVManager:
    manager_class = kv_class("manager")
    config = transfer.TransferConfig(timeout_s=timeout, waiting_timeout_s=waiting_timeout or timeout)
    return manager_class(peer.kv_args(kv, aux), DisaggregationMode.DECODE, peer.server_args(port), config=config)


def poll_until(receiver: transfer.OmniFlowKVReceiver, states: tuple[int, ...], timeout: float) -> int:
    return polling.poll_until(receiver.poll, lambda state: state in states, time.monotonic() + timeout)


def test_pages_between_two_processes_bit_exact(bootstrap: transfer.OmniFlowKVBootstrapServer) -> None:
    room, timeout = 4242, 20.0
    prefill = Prefill(bootstrap.port, room, "send", timeout)
    source_kv, source_aux = peer.prefill_buffers(seed=7)  # what the prefill process holds
    kv, aux = peer.empty_like_buffers(source_kv, source_aux)
    manager = decode_manager(kv, aux, bootstrap.port, timeout)
    try:
        assert prefill.line(timeout) == "READY"
        # What SGLang's decode scheduler asks before it creates receivers for an address.
        assert manager.try_ensure_parallel_info(f"127.0.0.1:{bootstrap.port}")
        info = manager.prefill_info_table[f"127.0.0.1:{bootstrap.port}"]
        assert (info.attn_tp_size, info.dp_size, info.page_size, info.kv_cache_dtype) == (1, 1, peer.PAGE, "bfloat16")
        receiver = kv_class("receiver")(manager, f"127.0.0.1:{bootstrap.port}", room)
        assert receiver.poll() == KVPoll.Bootstrapping
        receiver.init(0)
        assert poll_until(receiver, (KVPoll.WaitingForInput,), timeout) == KVPoll.WaitingForInput
        receiver.send_metadata(np.array(DEST_PAGES, dtype=np.int32), DEST_AUX)
        assert poll_until(receiver, (KVPoll.Success, KVPoll.Failed), timeout) == KVPoll.Success
        assert prefill.line(timeout) == f"RESULT {KVPoll.Success}"
        assert prefill.process.wait(timeout) == 0

        for got, want in zip(kv, source_kv, strict=True):
            assert torch.equal(got[DEST_PAGES].view(torch.int16), want[peer.SOURCE_PAGES].view(torch.int16))
            untouched = [p for p in range(peer.POOL_PAGES) if p not in DEST_PAGES]
            assert not got[untouched].view(torch.int16).any()
        for got, want in zip(aux, source_aux, strict=True):
            assert torch.equal(got[DEST_AUX].view(torch.int32), want[peer.SOURCE_AUX].view(torch.int32))
            assert not got[[r for r in range(peer.AUX_ROWS) if r != DEST_AUX]].view(torch.int32).any()
        receiver.clear()
    finally:
        prefill.stop()
        manager.close()


def test_dead_prefill_fails_within_the_timeout(bootstrap: transfer.OmniFlowKVBootstrapServer) -> None:
    room, timeout = 77, 2.0
    prefill = Prefill(bootstrap.port, room, "die", timeout=20.0)
    kv, aux = peer.empty_like_buffers(*peer.prefill_buffers(seed=1))
    # A long wait for the prefill to compute: the liveness probe, not that deadline, must fail it.
    manager = decode_manager(kv, aux, bootstrap.port, timeout, waiting_timeout=120.0)
    try:
        assert prefill.line(20.0) == "READY"
        receiver = kv_class("receiver")(manager, f"127.0.0.1:{bootstrap.port}", room)
        receiver.init(0)
        assert poll_until(receiver, (KVPoll.WaitingForInput,), timeout) == KVPoll.WaitingForInput
        receiver.send_metadata(np.array(DEST_PAGES, dtype=np.int32), DEST_AUX)
        assert prefill.process.wait(20.0) == 3  # died while the decode waits for its pages
        died = time.monotonic()
        assert poll_until(receiver, (KVPoll.Success, KVPoll.Failed), 3 * timeout) == KVPoll.Failed
        assert time.monotonic() - died <= timeout + 0.5
        with pytest.raises(transfer.KVTransferError, match="stopped answering"):
            receiver.failure_exception()
        assert not any(t.any() for t in kv)
    finally:
        prefill.stop()
        manager.close()


def test_no_bootstrap_server_fails_within_the_timeout(selected: None) -> None:
    timeout = 1.0
    kv, aux = peer.empty_like_buffers(*peer.prefill_buffers(seed=2))
    manager = decode_manager(kv, aux, free_port(), timeout)
    try:
        receiver = kv_class("receiver")(manager, f"127.0.0.1:{free_port()}", 5)
        start = time.monotonic()
        receiver.init(0)
        receiver.send_metadata(np.array([1, 2], dtype=np.int32), None)
        assert poll_until(receiver, (KVPoll.Success, KVPoll.Failed), 5 * timeout) == KVPoll.Failed
        assert time.monotonic() - start <= timeout + 0.5
        with pytest.raises(transfer.KVTransferError, match="timed out in state Bootstrapping"):
            receiver.failure_exception()
    finally:
        manager.close()


def test_an_unconnectable_bootstrap_address_fails_its_request_not_the_manager(selected: None) -> None:
    """A host ZeroMQ cannot parse (it comes with the request) fails that receiver at once; the
    manager's I/O thread lives on and serves the next request."""
    kv, aux = peer.empty_like_buffers(*peer.prefill_buffers(seed=4))
    manager = decode_manager(kv, aux, free_port(), 5.0)
    try:
        assert manager.try_ensure_parallel_info("no such host:5") is False
        receiver = kv_class("receiver")(manager, "no such host:5", 6)
        receiver.init(0)
        assert poll_until(receiver, (KVPoll.Success, KVPoll.Failed), 5.0) == KVPoll.Failed
        with pytest.raises(transfer.KVTransferError, match="cannot connect to tcp://no such host:5"):
            receiver.failure_exception()
        assert manager.check_alive() is None
        other = kv_class("receiver")(manager, f"127.0.0.1:{free_port()}", 7)
        other.init(0)
        assert other.poll() == KVPoll.Bootstrapping  # still served: it waits for its bootstrap server
        assert manager.check_alive() is None
    finally:
        manager.close()


def test_sender_without_a_decode_fails_within_the_timeout(bootstrap: transfer.OmniFlowKVBootstrapServer) -> None:
    timeout = 1.0
    kv, aux = peer.prefill_buffers(seed=3)
    config = transfer.TransferConfig(timeout_s=timeout, waiting_timeout_s=timeout)
    manager = kv_class("manager")(peer.kv_args(kv, aux), DisaggregationMode.PREFILL, peer.server_args(bootstrap.port),
                                  config=config)
    try:
        assert manager.registered.wait(5.0), manager.registration_error
        start = time.monotonic()
        sender = kv_class("sender")(manager, f"127.0.0.1:{bootstrap.port}", 9)
        deadline = start + 5 * timeout

        def failed(state: int) -> bool:
            if state == KVPoll.Failed:
                return True
            assert state == KVPoll.Bootstrapping
            return False

        state = polling.poll_until(sender.poll, failed, deadline)
        assert state == KVPoll.Failed
        assert time.monotonic() - start <= timeout + 0.5
        with pytest.raises(transfer.KVTransferError, match="timed out in state Bootstrapping"):
            sender.failure_exception()
        sender.clear()
    finally:
        manager.close()


def test_a_side_serves_only_its_own_role(bootstrap: transfer.OmniFlowKVBootstrapServer) -> None:
    """A decode manager has no rooms to send from, a prefill manager none to receive into, and a
    prefill does not answer the decode's topology question: each says so instead of timing out."""
    kv, aux = peer.empty_like_buffers(*peer.prefill_buffers(seed=5))
    decode = decode_manager(kv, aux, bootstrap.port, 5.0)
    config = transfer.TransferConfig(timeout_s=5.0)
    prefill = kv_class("manager")(peer.kv_args(kv, aux), DisaggregationMode.PREFILL, peer.server_args(bootstrap.port),
                                  config=config)
    try:
        with pytest.raises(transfer.KVTransferConfigError, match="prefill manager sends KV; this one is decode"):
            kv_class("sender")(decode, f"127.0.0.1:{bootstrap.port}", 1)
        with pytest.raises(transfer.KVTransferConfigError, match="decode manager receives KV; this one is prefill"):
            kv_class("receiver")(prefill, f"127.0.0.1:{bootstrap.port}", 1)
        with pytest.raises(transfer.KVTransferConfigError, match="only a decode manager receives KV"):
            prefill.try_ensure_parallel_info(f"127.0.0.1:{bootstrap.port}")
        assert decode.check_alive() is None and prefill.check_alive() is None
    finally:
        prefill.close()
        decode.close()


def test_config_from_env_rejects_bad_values() -> None:
    config = transfer.TransferConfig.from_env({"OMNIFLOW_SGLANG_KV_TIMEOUT_S": "2.5"})
    assert config.timeout_s == 2.5 and config.waiting_timeout_s == 300.0
    with pytest.raises(transfer.KVTransferConfigError, match="not a number"):
        transfer.TransferConfig.from_env({"OMNIFLOW_SGLANG_KV_TIMEOUT_S": "soon"})
    with pytest.raises(transfer.KVTransferConfigError, match="positive"):
        transfer.TransferConfig.from_env({"OMNIFLOW_SGLANG_KV_WAITING_TIMEOUT_S": "0"})
