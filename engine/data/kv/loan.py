"""Pages lent out of a `KVStore` for a zero-copy send: views of the store's own slots, kept
from reuse until the borrower gives them back (`KVStore.lend`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from engine.data.kv.keys import PageHash


@dataclass(eq=False)
class PageLoan:
    """The bytes of `pages`, in order, as views of the lending store's slots (no copy): `runs`
    are 1-D uint8 arrays, one per run of pages in adjacent slots of one tier.

    Until `release`, the store neither evicts these pages nor reuses their slots: a page
    removed meanwhile leaves the store at once, but its slot keeps its bytes until the
    release, so a send reading `runs` reads what was written. Read-only to the borrower.
    `release` gives the pages back; it is idempotent and safe from any thread.
    """

    pages: tuple[PageHash, ...]
    runs: tuple[np.ndarray, ...]
    _give_back: Callable[[], None] = field(repr=False)
    _released: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(run.nbytes for run in self.runs)

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._give_back()
