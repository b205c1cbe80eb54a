"""What a follower rank mirrors of rank 0's KV memory: the pass message travels without pickle,
and a `ShardKV` fed rank 0's journal holds the bytes rank 0's store holds, page by page, through
writes, tail pages, saved tails, evictions to host and disk, promotions back and drops; a page
corrupt on the follower's own disk tier is noted, not a failure, until rank 0 drops it too."""

from __future__ import annotations

import ast
import gc
from pathlib import Path

import msgspec
import pytest
import torch

import engine.compute.tp as tp
from engine.compute.llm.config import EngineConfig
from engine.compute.tp.embeds import embed_rows
from engine.compute.tp.follower import ShardKV
from engine.compute.tp.group import TPError
from engine.compute.tp.journal import KVJournal
from engine.compute.tp.messages import (
    CheckPages,
    ChunkInputs,
    CopyPage,
    DecodeInputs,
    DropPage,
    ForgetTail,
    Fresh,
    GatherRequest,
    PrefillInputs,
    Saved,
    SaveTail,
    SetTail,
    Shards,
    Tail,
    TPMessage,
    TPPass,
    WritePage,
)
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout
from engine.data.kv.store import Capacity, DiskTierConfig, KVStore, KVStoreConfig
from engine.data.kv.tier import Tier

TP_DIR = Path(tp.__file__).parent
FORBIDDEN_MODULES = {"pickle", "_pickle", "cloudpickle", "dill", "copyreg", "marshal", "shelve", "multiprocessing"}
FORBIDDEN_CALLS = {"gather_object", "broadcast_object_list", "all_gather_object", "scatter_object_list",
                   "send_object_list", "recv_object_list", "send_pyobj", "recv_pyobj"}
LAYOUT = KVLayout(page_size=2, num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32")


@pytest.mark.parametrize("module", sorted(p.name for p in TP_DIR.glob("*.py")))
def test_no_tp_module_pickles(module: str) -> None:
    tree = ast.parse((TP_DIR / module).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {alias.name.split(".")[0] for alias in node.names}
            assert not names & FORBIDDEN_MODULES, f"{module}:{node.lineno} imports {names & FORBIDDEN_MODULES}"
        elif isinstance(node, ast.ImportFrom):
            root = (node.module or "").split(".")[0]
            assert root not in FORBIDDEN_MODULES, f"{module}:{node.lineno} imports {root}"
        elif isinstance(node, ast.Attribute):
            assert node.attr not in FORBIDDEN_CALLS, f"{module}:{node.lineno} calls {node.attr}"


@pytest.mark.parametrize("forward", [
    None,
    PrefillInputs([ChunkInputs([1, 2, 3], 4, [0, 5], 1)], [True], "r1"),
    PrefillInputs([ChunkInputs([259] * 3, 0, [], None, embed_rows([(1, torch.ones(2, 4))], torch.bfloat16))],
                  [False], None),
    DecodeInputs([7], [9], [[0, 5]], [1], ["r1"]),
    GatherRequest(["ab" * 32], 3),
    GatherRequest(["ab" * 32], None, check=True),
    CheckPages(["ab" * 32, "cd" * 32]),
])
def test_a_pass_round_trips(forward) -> None:
    ops = [WritePage("ab" * 32, 3, Fresh(0, 1)), CopyPage("cd" * 32, 0, 1), CopyPage("cd" * 32, 2, 0, 4),
           DropPage("cd" * 32, 2), SetTail(1, Saved(2)), SaveTail(5, Shards([b"\x00\x01"])), ForgetTail(5),
           SetTail(0, Tail(3))]
    message = TPPass(ops, forward)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=TPMessage) == message


def page(value: float) -> torch.Tensor:
    return torch.full(LAYOUT.page_shape, float(value))


def key(index: int) -> PageHash:
    return PageHash(f"{index:064x}")


class Rank0:
    """A stand-in for rank 0's engine: a store (device 2 pages, host 2, disk 4) and its journal;
    the follower is a `ShardKV` of the same layout (rank 1: the `Shards` of a page are its bytes)."""

    def __init__(self, tmp_path: Path) -> None:
        disk = DiskTierConfig(tmp_path / "rank-0", Capacity(pages=4))
        self.store = KVStore(KVStoreConfig(layout=LAYOUT, device_capacity=Capacity(pages=2),
                                           host_capacity=Capacity(pages=2), disk=disk, device="cpu"))
        self.journal = KVJournal(self.store)
        config = EngineConfig(page_size=2, device_pages=2, host_pages=2, disk_path=str(tmp_path / "rank-1"),
                              disk_pages=4, max_running=2)
        self.follower = ShardKV(config, LAYOUT, "cpu", rank=1)
        self.journal.tails = torch.zeros((2, *LAYOUT.page_shape))

    def put(self, index: int, data: torch.Tensor) -> None:
        self.journal.expect([key(index)], [self.journal.shards_origin([data])])
        self.store.put(key(index), data)
        self.journal.settle([key(index)])

    def mirror(self) -> None:
        for op in self.journal.drain():
            self.follower.apply(op)

    def close(self) -> None:
        self.journal.close()
        self.store.close()
        self.follower.close()


def test_a_follower_mirrors_writes_and_tier_moves_byte_for_byte(tmp_path: Path) -> None:
    rank0 = Rank0(tmp_path)
    try:
        for index in range(6):  # 2 on the device, 2 demoted to the host, 2 on from there to the disk
            rank0.put(index, page(index))
        assert rank0.store.get(key(0)) is not None  # disk -> device (evicting to host and disk)
        assert rank0.store.lock([key(2)])  # host -> device
        rank0.store.remove(key(5))
        rank0.mirror()
        resident = rank0.store.resident_pages()
        assert resident[key(2)] is Tier.DEVICE and key(5) not in resident
        for page_key, tier in resident.items():
            want = rank0.store.get(page_key, promote=False)
            assert torch.equal(rank0.follower.read(page_key, tier), want), (page_key, tier)
            assert rank0.follower.slots.get(page_key) == rank0.store.device_slot(page_key)
        assert set(rank0.follower.slots) == {p for p, t in resident.items() if t is Tier.DEVICE}
    finally:
        rank0.close()


def test_tail_pages_and_their_saved_copies_are_mirrored_and_forgotten(tmp_path: Path) -> None:
    rank0 = Rank0(tmp_path)
    journal, tails = rank0.journal, rank0.journal.tails
    try:
        follower = rank0.follower
        follower.tails[1] = page(7.0)  # the decode forward writes tails on every rank alike
        tails[1] = page(7.0)
        copy = tails[1].clone()
        saved = journal.save(copy, Tail(1))
        journal.record(SetTail(0, journal.origin_of(copy)))
        rank0.mirror()
        assert torch.equal(follower.saved[saved], copy) and torch.equal(follower.tails[0], copy)
        del copy
        gc.collect()
        rank0.mirror()
        assert saved not in follower.saved  # the copy freed on rank 0: forgotten on the follower
        with pytest.raises(TPError, match="do not hold"):
            journal.origin_of(torch.zeros(LAYOUT.page_shape))
    finally:
        rank0.close()


def test_a_write_of_unannounced_bytes_breaks_the_journal(tmp_path: Path) -> None:
    rank0 = Rank0(tmp_path)
    try:
        rank0.store.put(key(1), page(1.0))
        with pytest.raises(TPError, match="no follower holds"):
            rank0.journal.drain()
    finally:
        rank0.close()


def corrupt_follower_page(follower: ShardKV, page_key: PageHash) -> None:
    assert follower.disk is not None
    offset = follower.disk.payload_offset(page_key)
    with open(follower.disk.path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))


def test_a_page_corrupt_on_the_followers_disk_is_noted_until_rank_0_drops_it(tmp_path: Path) -> None:
    rank0 = Rank0(tmp_path)
    follower = rank0.follower
    try:
        for index in range(6):  # pages 0 and 1 end on the disk tier only
            rank0.put(index, page(index))
        rank0.mirror()
        assert rank0.journal.take_from_disk() == []
        corrupt_follower_page(follower, key(0))
        corrupt_follower_page(follower, key(1))
        # Rank 0 promotes its intact copy; the follower's fails its checksum: noted, no TPError.
        assert rank0.store.get(key(0)) is not None
        rank0.mirror()
        assert rank0.journal.take_from_disk() == [key(0)]  # what rank 0 asks the ranks about (CheckPages)
        assert follower.corrupt == {key(0)} and key(0) in follower.slots
        # Read where it is, to serve it (a checked gather): None, noted.
        assert follower.read_intact(key(1)) is None and follower.corrupt == {key(0), key(1)}
        assert torch.equal(follower.read_intact(key(2)), rank0.store.get(key(2), promote=False))
        # Rank 0 drops both from every tier: the follower follows, though its disk lost them already.
        rank0.store.remove(key(0))
        rank0.store.remove(key(1))
        rank0.mirror()
        assert follower.corrupt == set() and key(0) not in follower.slots
        assert follower.disk is not None and key(0) not in follower.disk and key(1) not in follower.disk
    finally:
        rank0.close()
