"""Eviction order of one tier: LRU or LFU, deterministic so tests can assert exact victims.

A tracker only orders pages; the store decides which candidate to take (it skips
locked pages) and what to do with it (demote or drop).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from enum import StrEnum
from typing import Protocol

from engine.data.kv.keys import PageHash


class EvictionPolicy(StrEnum):
    LRU = "lru"
    LFU = "lfu"


class PageTracker(Protocol):
    """Keeps the pages of one tier in eviction order (first yielded = next victim).

    `order()` is lazy: stop iterating before changing the tracker.
    """

    def insert(self, page: PageHash, frequency: int = 1) -> None: ...

    def touch(self, page: PageHash) -> None: ...

    def remove(self, page: PageHash) -> None: ...

    def frequency(self, page: PageHash) -> int: ...

    def order(self) -> Iterator[PageHash]: ...

    def __len__(self) -> int: ...

    def __contains__(self, page: object) -> bool: ...


class LRUTracker:
    """Least recently used first. An insert counts as a use."""

    __slots__ = ("_pages",)

    def __init__(self) -> None:
        self._pages: OrderedDict[PageHash, int] = OrderedDict()

    def insert(self, page: PageHash, frequency: int = 1) -> None:
        self._pages[page] = max(frequency, self._pages.get(page, 0))
        self._pages.move_to_end(page)

    def touch(self, page: PageHash) -> None:
        self._pages[page] += 1
        self._pages.move_to_end(page)

    def remove(self, page: PageHash) -> None:
        del self._pages[page]

    def frequency(self, page: PageHash) -> int:
        return self._pages[page]

    def order(self) -> Iterator[PageHash]:
        return iter(self._pages)

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, page: object) -> bool:
        return page in self._pages


class LFUTracker:
    """Least frequently used first; among equal counts, least recently used first.

    Counts start at the `frequency` given on insert (a promoted page keeps the count
    it earned in the lower tier) and grow by one per touch. Buckets per count keep
    every operation O(1) except `order`, which sorts the (few) distinct counts.
    """

    __slots__ = ("_buckets", "_counts")

    def __init__(self) -> None:
        self._counts: dict[PageHash, int] = {}
        self._buckets: dict[int, OrderedDict[PageHash, None]] = {}

    def _place(self, page: PageHash, count: int) -> None:
        self._counts[page] = count
        self._buckets.setdefault(count, OrderedDict())[page] = None

    def _unplace(self, page: PageHash) -> int:
        count = self._counts.pop(page)
        bucket = self._buckets[count]
        del bucket[page]
        if not bucket:
            del self._buckets[count]
        return count

    def insert(self, page: PageHash, frequency: int = 1) -> None:
        count = max(frequency, 1)
        if page in self._counts:
            count = max(count, self._unplace(page))
        self._place(page, count)

    def touch(self, page: PageHash) -> None:
        self._place(page, self._unplace(page) + 1)

    def remove(self, page: PageHash) -> None:
        self._unplace(page)

    def frequency(self, page: PageHash) -> int:
        return self._counts[page]

    def order(self) -> Iterator[PageHash]:
        for count in sorted(self._buckets):
            yield from self._buckets[count]

    def __len__(self) -> int:
        return len(self._counts)

    def __contains__(self, page: object) -> bool:
        return page in self._counts


def make_tracker(policy: EvictionPolicy) -> PageTracker:
    if policy is EvictionPolicy.LRU:
        return LRUTracker()
    if policy is EvictionPolicy.LFU:
        return LFUTracker()
    raise ValueError(f"unknown eviction policy {policy!r}")
