"""Prefetch: promoting pages into a store's device tier on a background thread.

`KVStore.prefetch` hands the pages to its `Prefetcher`, whose one worker thread (started on the
first prefetch) takes the store's mutex for each page in turn: a page already in the device tier
counts as resident, one lower down is promoted (`TierHierarchy.promote`), one in no tier (or
found corrupt) is reported missing. The caller holds a `PrefetchHandle` to wait or cancel; a
store closed meanwhile fails the job with `KVClosedError`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from engine.data.kv.errors import KVTimeoutError
from engine.data.kv.hierarchy import TierHierarchy
from engine.data.kv.keys import PageHash
from engine.data.kv.tier import Tier


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    loaded: int  # promoted into the device tier by this prefetch
    resident: int  # already in the device tier
    missing: tuple[PageHash, ...]  # in no tier (or found corrupt)
    locked: int = 0
    cancelled: bool = False  # stopped by `PrefetchHandle.cancel` before the end of the list


class PrefetchHandle:
    """A prefetch in flight. `wait` returns its result or raises what stopped it."""

    def __init__(self, future: Future[PrefetchResult], cancelled: threading.Event) -> None:
        self._future = future
        self._cancelled = cancelled

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> PrefetchResult:
        try:
            return self._future.result(timeout)
        except TimeoutError as exc:
            raise KVTimeoutError(f"prefetch did not finish within {timeout} s") from exc

    def cancel(self) -> None:
        """Stop after the page being loaded now; pages already loaded stay and `wait` reports them."""
        self._cancelled.set()


class Prefetcher:
    """The prefetch thread of one store. `mutex` and `check_open` are the store's."""

    def __init__(self, tiers: TierHierarchy, mutex: threading.RLock, check_open: Callable[[], None]) -> None:
        self._tiers = tiers
        self._mutex = mutex
        self._check_open = check_open
        self._executor: ThreadPoolExecutor | None = None

    def start(self, pages: list[PageHash], lock: bool) -> PrefetchHandle:
        """Queue a prefetch of `pages`; the caller holds the mutex and has checked the store is open."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-prefetch")
        cancelled = threading.Event()
        future = self._executor.submit(self._job, pages, lock, cancelled)
        return PrefetchHandle(future, cancelled)

    def stop(self) -> None:
        """Cancel queued prefetches and wait for the running one; called outside the mutex, once
        the store is marked closed (so no `start` comes after)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def _job(self, pages: list[PageHash], lock: bool, cancelled: threading.Event) -> PrefetchResult:
        loaded = resident = locked = 0
        missing: list[PageHash] = []
        stopped = False
        for page in pages:
            with self._mutex:
                if cancelled.is_set():
                    stopped = True
                    break
                self._check_open()
                if page in self._tiers.levels[Tier.DEVICE].tier:
                    resident += 1
                elif self._tiers.promote(page):
                    loaded += 1
                else:
                    missing.append(page)
                    continue
                if lock:
                    self._tiers.locks[page] += 1
                    locked += 1
        return PrefetchResult(
            loaded=loaded, resident=resident, missing=tuple(missing), locked=locked, cancelled=stopped
        )
