"""CUDA IPC on the transfer plane, on a real GPU (skipped where there is none: CI has no
GPU; `scripts/gpu_check.sh` runs these on a machine that has one).

A producer process keeps a CUDA tensor in its store; a consumer in this process pulls the
ref: by CUDA IPC (the producer's own memory, no copy: a change the producer makes shows
through), and without CUDA IPC (staged to host memory once, then shared memory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine.data.peer import Peer  # noqa: E402
from engine.data.wire import TensorRef, Transport  # noqa: E402
from tests.gpu.child import REPO, Child  # noqa: E402

N = 1 << 20  # 4 MiB of float32: above the inline limit, so host staging goes to a segment


class Producer(Child):
    def __init__(self, n: int, env: dict[str, str] | None = None) -> None:
        super().__init__("tests.gpu.cuda_peer", str(n), env=env)
        self.ref = msgspec.msgpack.decode(bytes.fromhex(self.line().strip()), type=TensorRef)


@pytest.fixture
def producer() -> Iterator[Producer]:
    producer = Producer(N)
    yield producer
    producer.close()


@pytest.fixture
def consumer() -> Iterator[Peer]:
    with Peer.start() as peer:
        yield peer


def expected(offset: float = 0.0) -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32) + offset


def test_a_cuda_ref_stays_on_its_gpu(producer: Producer) -> None:
    assert producer.ref.device == "cuda:0"
    assert producer.ref.shm is None  # no host copy was made at put
    assert json.loads(producer.ask("stats"))["segments"] == 0


def test_same_host_consumer_opens_the_producers_memory(producer: Producer, consumer: Peer) -> None:
    data = consumer.pull(producer.ref, timeout=30)
    assert data.transport is Transport.CUDA_IPC
    tensor = data.torch()
    assert tensor.is_cuda and tensor.dtype == torch.float32 and tuple(tensor.shape) == (N,)
    assert torch.equal(tensor.cpu(), expected())
    # Zero copy: the producer changes its tensor in place, the consumer sees it.
    assert producer.ask("bump") == "ok"
    torch.cuda.synchronize()
    assert torch.equal(tensor.cpu(), expected(1.0))
    # The same through the I/O thread (pull_async's path).
    again = consumer.start_pull(producer.ref, 30).wait()
    assert again.transport is Transport.CUDA_IPC and torch.equal(again.torch().cpu(), expected(1.0))


def test_the_mapping_outlives_the_producers_release(producer: Producer, consumer: Peer) -> None:
    tensor = consumer.pull(producer.ref, timeout=30).torch()
    assert producer.ask("release") == "ok"
    # The producer's block is parked, not reused, while this mapping lives.
    assert torch.equal(tensor.cpu(), expected())
    del tensor
    torch.cuda.synchronize()


def test_a_consumer_without_cuda_ipc_gets_host_memory(producer: Producer, consumer: Peer) -> None:
    data = consumer.client.fetch(producer.ref, (Transport.SHM, Transport.TCP), 30)
    assert data.transport is Transport.SHM
    assert np.array_equal(data.numpy(), expected().numpy())
    assert json.loads(producer.ask("stats"))["segments"] == 1  # staged once
    tcp = consumer.client.fetch(producer.ref, (Transport.TCP,), 30)
    assert tcp.transport is Transport.TCP and np.array_equal(tcp.numpy(), expected().numpy())
    assert json.loads(producer.ask("stats"))["segments"] == 1  # not staged twice


def test_a_consumer_process_that_sees_no_gpu_pulls_through_shared_memory(producer: Producer) -> None:
    script = (
        "import sys, msgspec, numpy as np\n"
        "from engine.data.peer import Peer\n"
        "from engine.data.wire import TensorRef\n"
        "ref = msgspec.msgpack.decode(bytes.fromhex(sys.argv[1]), type=TensorRef)\n"
        "with Peer.start() as peer:\n"
        "    data = peer.pull(ref, timeout=30)\n"
        "    assert np.array_equal(data.numpy(), np.arange(ref.shape[0], dtype=np.float32))\n"
        "    print(data.transport.value)\n"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", script, msgspec.msgpack.encode(producer.ref).hex()], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "shm"


def test_in_process_pull_hands_over_the_stored_gpu_tensor(consumer: Peer) -> None:
    source = torch.arange(16, dtype=torch.float32, device="cuda:0")
    ref = consumer.put(source)
    source.add_(100)  # the store kept its own copy
    data = consumer.pull(ref, timeout=5)
    assert data.transport is Transport.LOCAL and data.torch().is_cuda
    assert torch.equal(data.torch().cpu(), torch.arange(16, dtype=torch.float32))


def test_small_tensors_go_inline_and_copies_over_the_gpu_budget_are_staged_at_put(consumer: Peer) -> None:
    from engine.data.peer import PeerConfig
    from engine.data.tensor_store import StoreConfig

    with Peer.start(PeerConfig(store=StoreConfig(cuda_max_bytes=8 << 20))) as producer:
        small = producer.put(torch.arange(16, dtype=torch.float32, device="cuda:0"))
        data = consumer.pull(small, timeout=30)
        assert data.transport is Transport.INLINE  # cheaper staged than shared
        assert torch.equal(data.torch().cpu(), torch.arange(16, dtype=torch.float32))
        kept = producer.put(torch.zeros(1 << 20, dtype=torch.float32, device="cuda:0"))  # 4 MiB: in budget
        assert producer.store.get(kept.id).cuda is not None and kept.shm is None
        over = producer.put(torch.ones(2 << 20, dtype=torch.float32, device="cuda:0"))  # 8 MiB more: over it
        assert producer.store.get(over.id).cuda is None and over.shm is not None and over.device == "cuda:0"
        got = consumer.pull(over, timeout=30)
        assert got.transport is Transport.SHM and bool((got.torch() == 1).all())
        producer.release(kept)
        again = producer.put(torch.ones(1 << 20, dtype=torch.float32, device="cuda:0"))  # room again
        assert producer.store.get(again.id).cuda is not None


def test_pulls_between_two_peers_of_one_process(consumer: Peer) -> None:
    """The driver will not open a process's own IPC handle: the pull falls back to host memory
    (and gives the handle's reference back). An empty tensor has no handle at all."""
    with Peer.start() as other:
        big = other.put(torch.arange(N, dtype=torch.float32, device="cuda:0"))
        data = consumer.pull(big, timeout=30)
        assert data.transport in (Transport.CUDA_IPC, Transport.SHM), data.transport
        assert torch.equal(data.torch().cpu(), expected())
        empty = other.put(torch.empty(0, 3, dtype=torch.float32, device="cuda:0"))
        assert tuple(consumer.pull(empty, timeout=30).torch().shape) == (0, 3)
