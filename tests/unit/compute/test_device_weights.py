"""GPU weight sharing (`DeviceWeights`) without a GPU: its index files, liveness, reclaim, the
errors it gives, and `WeightStore` keeping CPU keys off it. Publishing and attaching real
CUDA memory is covered by `tests/gpu/test_cuda_weights.py`."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from engine.compute.weights import (
    DeviceWeights,
    DeviceWeightsManifest,
    HostWeights,
    SharedWeightsError,
    WeightKey,
    WeightStore,
)
from engine.compute.weights.cuda import KeptTensor, read_index, write_index
from engine.data.peer import Peer
from engine.data.shm import SegmentOwner, list_segments, process_start_token


@pytest.fixture
def peer() -> Iterator[Peer]:
    with Peer.start() as peer:
        yield peer


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path)


@pytest.fixture
def prefix(request) -> Iterator[str]:
    """A host segment prefix of this test alone; asserts it leaves nothing behind."""
    name = f"omniflowdevtest{os.getpid()}{abs(hash(request.node.name)) % 10**6}"
    yield name
    assert list_segments(prefix=name) == []


@pytest.fixture(scope="module")
def dead() -> SegmentOwner:
    """A process that ran and exited (its pid, and its start time read while it lived)."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    start = process_start_token(child.pid)
    assert start is not None
    assert child.stdin is not None
    child.stdin.close()
    assert child.wait(timeout=30) == 0
    owner = SegmentOwner(child.pid, start)
    assert not owner.alive()
    return owner


def this_process() -> SegmentOwner:
    start = process_start_token(os.getpid())
    assert start is not None
    return SegmentOwner(os.getpid(), start)


def manifest(key: str, peer: Peer, owner: SegmentOwner | None = None, **changes) -> DeviceWeightsManifest:
    """An index as a publisher on cuda:0 writes it: a tied weight (two names, one ref) and a buffer."""
    owner = owner or this_process()
    tensors = (
        KeptTensor("embed.weight", "param", "float32", (8, 4), id="e1.0", nbytes=128),
        KeptTensor("head.weight", "param", "float32", (8, 4), id="e1.0", nbytes=128),
        KeptTensor("rope.inv_freq", "buffer", "bfloat16", (2,), id="e1.1", nbytes=4),
    )
    fields = {"key": key, "pid": owner.pid, "start": owner.start, "host": peer.host, "data": peer.address,
              "device": "cuda:0", "device_uuid": "GPU-test", "tensors": tensors, "meta": {"architecture": "X"}}
    return DeviceWeightsManifest(**{**fields, **changes})


def suffix(prefix: str, owner: SegmentOwner) -> str:
    return f"{prefix}-{owner.pid}-{owner.start}-0"


def test_an_index_round_trips_and_names_the_publishers_refs(peer: Peer, root: str):
    weights = DeviceWeights(peer, root=root)
    written = manifest("llm:m@cuda:0", peer)
    path = weights.index_path("llm:m@cuda:0")
    write_index(path, written, suffix(weights.prefix, this_process()))
    assert os.listdir(root) == [os.path.basename(path)]  # the staging file was renamed into place
    assert read_index(path) == written
    assert weights.lookup("llm:m@cuda:0") == written
    assert weights.publisher_alive(written)
    ref = written.ref(written.tensors[2])
    assert (ref.owner, ref.id, ref.dtype, ref.shape, ref.nbytes) == (peer.address, "e1.1", "bfloat16", (2,), 4)
    assert (ref.host, ref.device, ref.shm) == (peer.host, "cuda:0", None)
    assert ref.lease_expires_at == math.inf  # kept refs have no lease (JSON cannot carry inf: rebuilt here)
    assert written.ref(written.tensors[0]) == written.ref(written.tensors[1])  # tied: one ref


def test_lookup_refuses_a_dead_publisher_another_key_or_host_and_a_garbled_index(
        peer: Peer, root: str, dead: SegmentOwner):
    weights = DeviceWeights(peer, root=root)
    path = weights.index_path("k")
    assert weights.lookup("k") is None  # nothing published
    by_the_dead = manifest("k", peer, dead)
    write_index(path, by_the_dead, suffix(weights.prefix, this_process()))
    assert weights.lookup("k") is None and not weights.publisher_alive(by_the_dead)
    write_index(path, manifest("other", peer), suffix(weights.prefix, this_process()))
    assert weights.lookup("k") is None  # an index file names its key: a hash collision is not a match
    write_index(path, manifest("k", peer, host="another-machine/boot"), suffix(weights.prefix, this_process()))
    assert weights.lookup("k") is None
    for garbled in (b'{"key": "k", "pid": ', b'{"key": "k"}', b"\x00\xff"):
        with open(path, "wb") as f:
            f.write(garbled)
        with pytest.raises(SharedWeightsError, match="unreadable CUDA weights index .*-index-"):
            weights.lookup("k")


def test_reclaim_removes_indexes_of_dead_publishers_and_keeps_live_ones(peer: Peer, root: str, dead: SegmentOwner):
    weights = DeviceWeights(peer, root=root)
    me = this_process()
    live, by_the_dead, garbled = (weights.index_path(k) for k in ("live", "dead", "garbled"))
    write_index(live, manifest("live", peer), suffix(weights.prefix, me))
    write_index(by_the_dead, manifest("dead", peer, dead), suffix(weights.prefix, me))
    with open(garbled, "wb") as f:
        f.write(b"not json")
    # Index files being written: their writer is named by the suffix, the content may be empty.
    staged_live = f"{weights.index_path('w')}.{suffix(weights.prefix, me)}"
    staged_dead = f"{weights.index_path('x')}.{suffix(weights.prefix, dead)}"
    for staging in (staged_live, staged_dead):
        open(staging, "wb").close()
    other = os.path.join(root, "omniflowweights-index-0123")  # HostWeights' index: not ours to judge
    open(other, "wb").close()
    removed = weights.reclaim()
    assert sorted(removed) == sorted(os.path.basename(p) for p in (by_the_dead, garbled, staged_dead))
    assert sorted(os.listdir(root)) == sorted(os.path.basename(p) for p in (live, staged_live, other))
    assert weights.lookup("live") is not None
    assert weights.reclaim() == []


def test_publishing_a_cpu_module_says_to_use_host_weights(peer: Peer, root: str):
    weights = DeviceWeights(peer, root=root)
    with pytest.raises(SharedWeightsError, match=r"weight is on cpu: DeviceWeights shares CUDA tensors \(HostWeights"):
        weights.publish("k", torch.nn.Linear(4, 3))
    with pytest.raises(SharedWeightsError, match="no parameters or buffers"):
        weights.publish("k", torch.nn.ReLU())
    assert os.listdir(root) == [] and len(peer.store) == 0  # nothing served, nothing named
    weights.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a process without CUDA")
def test_attaching_without_cuda_is_a_clear_error(peer: Peer, root: str):
    weights = DeviceWeights(peer, root=root)
    with pytest.raises(SharedWeightsError, match="lives on cuda:0; this process has no CUDA"):
        weights.attach(manifest("k", peer), lambda: torch.nn.Linear(4, 8))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a process without CUDA")
def test_a_failed_attach_is_logged_before_loading(peer: Peer, root: str, caplog):
    weights = DeviceWeights(peer, root=root)
    key = WeightKey("m", "lin", "cuda:0")
    write_index(weights.index_path(str(key)), manifest(str(key), peer), suffix(weights.prefix, this_process()))
    store = WeightStore(device=weights)
    built: list[torch.nn.Module] = []

    def build() -> torch.nn.Module:
        built.append(torch.nn.Linear(4, 8))
        return built[-1]

    with caplog.at_level(logging.WARNING, logger="engine.compute.weights.store"):
        # No CUDA here: the load that follows fails too, with torch's own error.
        with pytest.raises((AssertionError, RuntimeError)):
            store.module(key, build, skeleton=lambda: torch.nn.Linear(4, 8))
    assert len(built) == 1
    assert f"cannot attach {key} from the copy published by pid {os.getpid()} (" in caplog.text
    assert "this process has no CUDA" in caplog.text


class _Untouchable(DeviceWeights):
    """A device directory that fails the test if a CPU key reaches it."""

    def lookup(self, key: str):
        raise AssertionError(f"lookup({key!r}) on the device directory")

    def publish(self, key: str, module, meta=None):
        raise AssertionError(f"publish({key!r}) on the device directory")

    def attach(self, manifest, skeleton):
        raise AssertionError("attach on the device directory")


def test_weight_store_keeps_cpu_keys_on_host_weights(peer: Peer, root: str, prefix: str, tiny_llama):
    first = WeightStore(HostWeights(prefix=prefix), _Untouchable(peer, root=root))
    second = WeightStore(HostWeights(prefix=prefix), _Untouchable(peer, root=root))
    try:
        first.llm("tiny-llama")
        attached = second.llm("tiny-llama")
        key = WeightStore.llm_key("tiny-llama")
        assert (first.origin(key), second.origin(key)) == ("published", "attached")
        ids = torch.tensor([[256, 72, 105, 33, 10]])
        with torch.inference_mode():
            assert torch.equal(attached.model(ids).logits, tiny_llama.model(ids).logits)
        linear = WeightKey("test", "linear")
        first.module(linear, lambda: torch.nn.Linear(4, 3), skeleton=lambda: torch.nn.Linear(4, 3))
        second.module(linear, lambda: torch.nn.Linear(4, 3), skeleton=lambda: torch.nn.Linear(4, 3))
        assert (first.origin(linear), second.origin(linear)) == ("published", "attached")
        assert len(list_segments(prefix=prefix)) == 2
    finally:
        first.close()
        second.close()
    assert os.listdir(root) == [] and len(peer.store) == 0


class _AttachesWithoutCuda(DeviceWeights):
    """Attaches by building the skeleton: the bookkeeping around an attach, without a GPU."""

    def attach(self, manifest, skeleton):
        return skeleton()


def test_weights_whose_publisher_died_are_reported_orphaned(peer: Peer, root: str):
    """Attached GPU weights are the publisher's memory: once it exits they are gone, and the
    store says so (a worker's heartbeat then stops the worker)."""
    publisher = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        start = process_start_token(publisher.pid)
        assert start is not None
        owner = SegmentOwner(publisher.pid, start)
        weights = _AttachesWithoutCuda(peer, root=root)
        key = WeightKey("m", "lin", "cuda:0")
        write_index(weights.index_path(str(key)), manifest(str(key), peer, owner), suffix(weights.prefix, owner))
        store = WeightStore(device=weights)
        store.module(key, lambda: pytest.fail("loaded instead of attaching"), skeleton=lambda: torch.nn.Linear(4, 8))
        assert store.origin(key) == "attached"
        assert store.orphaned() == []
    finally:
        assert publisher.stdin is not None
        publisher.stdin.close()
        publisher.wait(timeout=30)
    assert store.orphaned() == [f"{key} (pid {publisher.pid})"]
    store.release(key)
    assert store.orphaned() == []  # nothing uses those weights any more
