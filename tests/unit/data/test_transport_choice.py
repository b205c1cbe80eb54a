"""`choose_transport`: which path a pulled tensor takes, over every kind of stored entry.

The expected transports follow the rules of `engine.data.transport_choice`'s docstring, written
out per case here, not computed by the code under test."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.data.codec import KiB
from engine.data.ref_table import RefTable, StoredTensor
from engine.data.tensor_store import StoreConfig
from engine.data.transport_choice import NoTransport, choose_transport
from engine.data.wire import ShmLocation, TensorHeader, Transport

INLINE, SHM, TCP, CUDA_IPC = Transport.INLINE, Transport.SHM, Transport.TCP, Transport.CUDA_IPC
CONFIG = StoreConfig(inline_max_bytes=64 * KiB, use_shm=True)
SMALL, LARGE = 1 * KiB, 1024 * KiB


def entry(nbytes: int, *, where: str) -> StoredTensor:
    """A stored tensor of `nbytes` that lives `where`: "private" (host memory of the store's),
    "segment" (shared memory), "lent" (two buffers of a lender's) or "gpu" (kept on its GPU, not
    yet staged). A CPU tensor stands in for the GPU one: the choice reads only whether there is one."""
    refs = RefTable("tcp://127.0.0.1:1", "h", default_lease_s=10.0, max_lease_s=100.0, wall_clock=lambda: 0.0)
    header = TensorHeader("uint8", (nbytes,), (1,), nbytes)
    ref = refs.new_ref(refs.next_id(), header, 10.0, "cuda:0" if where == "gpu" else "cpu")
    data = np.zeros(nbytes, np.uint8)
    match where:
        case "private":
            return StoredTensor(ref, header, data, None, 10.0)
        case "segment":
            return StoredTensor(ref, header, data, None, 10.0, location=ShmLocation("seg", 2 * nbytes, 4096, 1))
        case "lent":
            half = nbytes // 2
            return StoredTensor(ref, header, None, None, 10.0, parts=(data[:half], data[half:]), on_free=lambda: None)
        case "gpu":
            return StoredTensor(ref, header, None, None, 10.0, cuda=torch.zeros(nbytes, dtype=torch.uint8))
    raise AssertionError(where)


@pytest.mark.parametrize(("nbytes", "where", "accepted", "expected"), [
    # small, in one buffer: inline whenever the consumer takes it, else its order
    (SMALL, "private", (SHM, TCP, INLINE), INLINE),
    (SMALL, "private", (SHM, TCP), TCP),  # no segment behind it: SHM is passed over
    # large: the consumer's order, SHM only for a tensor in a segment
    (LARGE, "segment", (SHM, TCP, INLINE), SHM),
    (LARGE, "segment", (TCP, SHM), TCP),
    (LARGE, "private", (SHM, TCP, INLINE), TCP),
    # lent: TCP chunks only, small or not
    (SMALL, "lent", (INLINE, SHM, TCP), TCP),
    (LARGE, "lent", (SHM, TCP), TCP),
    # on its GPU: CUDA IPC, unless small and inline is taken; staged into a segment when large
    (LARGE, "gpu", (CUDA_IPC, SHM, TCP), CUDA_IPC),
    (LARGE, "gpu", (INLINE, CUDA_IPC), CUDA_IPC),
    (SMALL, "gpu", (CUDA_IPC, INLINE), INLINE),
    (SMALL, "gpu", (CUDA_IPC, TCP), CUDA_IPC),
    (LARGE, "gpu", (SHM, TCP), SHM),
    (SMALL, "gpu", (SHM, TCP), TCP),  # a small one is staged into private memory, not a segment
    (0, "gpu", (CUDA_IPC, TCP), TCP),  # nothing to share
])
def test_the_transport_each_entry_takes(nbytes: int, where: str, accepted: tuple[Transport, ...],
                                        expected: Transport) -> None:
    assert choose_transport(entry(nbytes, where=where), accepted, CONFIG) is expected


def test_a_gpu_tensor_of_a_store_without_segments_never_goes_by_shared_memory() -> None:
    no_shm = StoreConfig(inline_max_bytes=64 * KiB, use_shm=False)
    assert choose_transport(entry(LARGE, where="gpu"), (SHM, TCP), no_shm) is TCP
    with pytest.raises(NoTransport, match=r"none of \['shm'\] can carry this tensor"):
        choose_transport(entry(LARGE, where="gpu"), (SHM,), no_shm)


@pytest.mark.parametrize(("nbytes", "where", "accepted"), [
    (LARGE, "private", (SHM, INLINE)),
    (SMALL, "lent", (INLINE, SHM)),
    (LARGE, "segment", (CUDA_IPC, INLINE)),
    (LARGE, "segment", ()),
])
def test_no_accepted_transport_can_carry_it(nbytes: int, where: str, accepted: tuple[Transport, ...]) -> None:
    names = [t.value for t in accepted]
    with pytest.raises(NoTransport) as raised:
        choose_transport(entry(nbytes, where=where), accepted, CONFIG)
    assert str(raised.value) == f"none of {names} can carry this tensor"
