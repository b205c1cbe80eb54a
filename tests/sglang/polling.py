"""Waiting on a transfer's `KVPoll` state the way SGLang's schedulers do: by calling `poll()`.

The sender and receiver expose no event to wait on, by design: SGLang's prefill and decode
schedulers call `poll()` on each in-flight transfer from their event loop, and `poll()` itself
moves the transfer along (it notices a passed deadline or a dead peer and fails the transfer, and
a receiver finishes its pull inside it). So a test driving a transfer must poll too, as the
scheduler would. This module is the one place that does it for `tests/sglang` (the test and the
prefill process `transfer_peer.py`), bounded by a deadline and pausing only `POLL_PAUSE_S`
between calls: the shortest pause that still hands the CPU to the transfer's I/O threads (and
the other process) instead of spinning.
"""

from __future__ import annotations

import time
from collections.abc import Callable

POLL_PAUSE_S = 0.001


def poll_until(poll: Callable[[], int], done: Callable[[int], bool], deadline: float) -> int:
    """Call `poll()` until `done(state)` or `time.monotonic()` passes `deadline` (at least once);
    returns the last state."""
    while not done(state := poll()) and time.monotonic() < deadline:
        time.sleep(POLL_PAUSE_S)
    return state
