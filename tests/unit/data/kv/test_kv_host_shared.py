"""Two processes share host pages: a second process maps the owner's segment and reads pages."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kv_factories import StoreFactory, make_keys, make_page, raw, shm_segments, small_layout

from engine.data.kv.errors import KVConfigError
from engine.data.kv.host import HostPageReader, HostTier

REPO = Path(__file__).resolve().parents[4]
LAYOUT = small_layout()

# The reader process: attach by name, answer commands on stdin with raw page bytes.
READER = r"""
import sys
from engine.data.kv.host import HostPageReader
reader = HostPageReader(sys.argv[1])
out = sys.stdout.buffer
out.write(b"ready %d\n" % reader.capacity_pages); out.flush()
held = None
for line in sys.stdin.buffer:
    cmd, _, arg = line.decode().strip().partition(" ")
    if cmd == "read":
        page = reader.read(arg)
        if page is None:
            out.write(b"miss\n")
        else:
            data = page.reshape(-1).view(dtype=__import__("torch").uint8).numpy().tobytes()
            out.write(b"hit %d\n" % len(data) + data)
    elif cmd == "view":
        held = reader.view(arg)
        out.write(b"ok\n" if held is not None else b"miss\n")
    elif cmd == "check":
        data = held.tensor.reshape(-1).view(dtype=__import__("torch").uint8).numpy().tobytes()
        out.write(b"current %d %d\n" % (reader.is_current(held), len(data)) + data)
    elif cmd == "quit":
        break
    out.flush()
held = None
reader.close()
"""


class Reader:
    def __init__(self, segment: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", READER, segment],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO,
            env=env,
        )
        assert self.line().startswith("ready ")

    def line(self) -> str:
        assert self.proc.stdout is not None
        text = self.proc.stdout.readline().decode()
        assert text, f"reader process exited with {self.proc.poll()}"
        return text.strip()

    def send(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()
        return self.line()

    def payload(self, nbytes: int) -> torch.Tensor:
        assert self.proc.stdout is not None
        return torch.frombuffer(bytearray(self.proc.stdout.read(nbytes)), dtype=torch.uint8)

    def read(self, key: str) -> torch.Tensor | None:
        reply = self.send(f"read {key}")
        if reply == "miss":
            return None
        return self.payload(int(reply.split()[1]))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send_quit()
        self.proc.wait(timeout=30)

    def send_quit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"quit\n")
        self.proc.stdin.close()


@pytest.fixture
def reader_factory() -> Iterator[list[Reader]]:
    readers: list[Reader] = []
    yield readers
    for reader in readers:
        reader.close()


def test_another_process_reads_host_pages_bit_exactly(
    make_store: StoreFactory, reader_factory: list[Reader]
) -> None:
    store = make_store(device=1, host=4, disk=None)
    keys = make_keys(4)
    pages = [make_page(LAYOUT, 50 + i) for i in range(4)]
    store.put(keys[0], pages[0])
    store.put(keys[1], pages[1])  # keys[0] demoted into the host segment
    segment = store.host_segment_name
    assert segment is not None and segment in shm_segments()

    reader = Reader(segment)
    reader_factory.append(reader)
    got = reader.read(keys[0])
    assert got is not None and torch.equal(got, raw(pages[0]))
    assert reader.read(keys[1]) is None  # still only on the device

    store.put(keys[2], pages[2])  # keys[1] arrives in the host tier after the reader attached
    got = reader.read(keys[1])
    assert got is not None and torch.equal(got, raw(pages[1]))


def test_reader_view_is_a_mapping_and_sees_the_slot_change(
    make_store: StoreFactory, reader_factory: list[Reader]
) -> None:
    store = make_store(device=1, host=1, disk=None)
    keys = make_keys(3)
    pages = [make_page(LAYOUT, 60 + i) for i in range(3)]
    store.put(keys[0], pages[0])
    store.put(keys[1], pages[1])  # host: keys[0]
    assert store.host_segment_name is not None
    reader = Reader(store.host_segment_name)
    reader_factory.append(reader)
    assert reader.send(f"view {keys[0]}") == "ok"
    store.put(keys[2], pages[2])  # host evicts keys[0] and writes keys[1] into the same slot
    _, current, nbytes = reader.send("check").split()
    bytes_seen = reader.payload(int(nbytes))
    assert current == "0"  # the reader can tell its view went stale...
    assert torch.equal(bytes_seen, raw(pages[1]))  # ...because it maps the owner's memory, not a copy
    assert reader.read(keys[0]) is None


def test_segment_is_unlinked_on_close_and_attach_fails_afterwards() -> None:
    tier = HostTier(LAYOUT, 2)
    name = tier.name
    reader = HostPageReader(name)
    tier.close()
    assert name not in shm_segments()
    reader.close()
    with pytest.raises(KVConfigError, match="no host KV segment"):
        HostPageReader(name)
