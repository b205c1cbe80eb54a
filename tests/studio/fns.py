"""Node functions of the studio tests' workflows."""

from __future__ import annotations

import asyncio
import hashlib
import threading


def echo(text: str) -> str:
    return text.upper()


async def wait_forever(text: str) -> str:
    await asyncio.Event().wait()
    return text


def fail(text: str) -> str:
    raise RuntimeError(f"refusing {text!r}")


def digest(image: bytes) -> str:
    return hashlib.sha256(image).hexdigest()


def png(text: str) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + text.encode()


def count(n: int):
    yield from range(n)


def gallery(text: str) -> dict:
    """Two images in a list and one in a dict beside them, and bytes that are no image."""
    return {"images": [png(f"{text}-0"), png(f"{text}-1")], "cover": {"front": png(f"{text}-cover")},
            "raw": b"\x00\x01", "caption": text}


def frames(text: str):
    """A streamed image per word of `text`."""
    for word in text.split():
        yield png(word)


GATE = threading.Event()
"""Opened by a test to let `gated` finish; reset by the test that uses it."""


async def gated(text: str) -> str:
    await asyncio.to_thread(GATE.wait, 20)
    return text.upper()


async def slow(text: str) -> str:
    """Takes long enough that a WebSocket client sees the run's events live."""
    await asyncio.sleep(0.3)
    return text.upper()


def whoami(text: str) -> dict:
    """Which process ran the node (a role worker, not the test process)."""
    import os

    return {"text": text.upper(), "pid": os.getpid()}


async def gate_file(text: str, gate: str) -> str:
    """Marks that it started (`gate`/started-<pid>-<n>), then holds the run until `gate`/open
    exists (60 s at most): a readiness signal and a release for tests that kill a worker
    mid-run. Passes `text` on."""
    import os
    import time
    import uuid
    from pathlib import Path

    folder = Path(gate)
    (folder / f"started-{os.getpid()}-{uuid.uuid4().hex[:6]}").touch()
    deadline = time.monotonic() + 60
    while not (folder / "open").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{folder / 'open'} did not appear")
        await asyncio.sleep(0.02)
    return text


def announce(text: str, ctx) -> str:
    """Reports progress with a message naming `text` (a server path, in the test that uses it)."""
    ctx.progress(0.5, f"writing {text}")
    return "done"


def huge(text: str) -> int:
    """An integer too long to print: 2**20000 has 6021 digits, past Python's 4300 for str()."""
    return 1 << 20_000


def holds_huge(text: str) -> dict:
    """That integer inside a value, beside a small one."""
    return {"n": -(1 << 20_000), "small": [1, 2]}


def beyond(text: str) -> dict:
    """Floats JSON has no number for, beside one it has."""
    return {"big": float(text) * float(text), "nan": float("nan"), "low": [-float("inf"), 1.5]}


def with_nul(text: str) -> str:
    """Text no PostgreSQL text or jsonb column holds."""
    return f"{text}\x00{text}"
