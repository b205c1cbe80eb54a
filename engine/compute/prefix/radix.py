"""A page-aligned radix tree over cache keys, mapping each full page of a prefix to its KV page key.

Edges hold whole pages (`page_size` ids each), so a match is always a number of whole
pages and every matched page names a page of the KV store (`engine.data.kv`). The tree
does not hold KV bytes; the store does, in whichever tier it has them:

* Lock counts (`lock`/`unlock`) protect a matched path from `evict` while a request or
  a session uses it. The tree's locks mirror the store locks the caller takes on the
  same pages, which keep them in the device tier.
* When the store evicts a device page it demotes it to a lower tier, and the tree keeps
  it: a later match returns it and locking it in the store promotes it. Only a page
  gone from every tier is forgotten (`store_listener` queues those; the tree drops the
  page and everything below it on its next call).
* Each namespace (model id, tenant salt) has its own root: keys of different models or
  tenants never meet, besides having different page hashes.

Not thread-safe: one engine thread owns the tree (the store listener only queues).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.data.kv.keys import PageHash
from engine.data.kv.store import KVEvent

Namespace = tuple[str | None, str | None]
"""(model id, tenant salt)."""


class PrefixLockError(RuntimeError):
    """An unlock without a matching lock."""


@dataclass(slots=True, eq=False)
class RadixNode:
    key: tuple[int, ...]
    pages: list[PageHash]
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    attached: bool = True

    @property
    def is_root(self) -> bool:
        return self.parent is None


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The longest cached prefix of a key: its pages, in order, and the node where it ends.

    `node` is what to `lock` to keep the match from being evicted; the page list is valid
    while it is locked.
    """

    pages: tuple[PageHash, ...]
    node: RadixNode
    page_size: int

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def num_tokens(self) -> int:
        return len(self.pages) * self.page_size


class RadixCache:
    """Prefix tree of one engine. See the module docstring for its contract."""

    def __init__(self, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self._roots: dict[Namespace, RadixNode] = {}
        self._where: dict[PageHash, RadixNode] = {}
        self._gone: deque[PageHash] = deque()
        self._clock = itertools.count(1)

    # -- bookkeeping ------------------------------------------------------------------

    def root(self, namespace: Namespace) -> RadixNode:
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = RadixNode(key=(), pages=[], parent=None)
        return node

    @property
    def num_pages(self) -> int:
        return len(self._where)

    def __contains__(self, page: object) -> bool:
        return page in self._where

    def store_listener(self) -> Callable[[KVEvent], None]:
        """A `KVStore` listener: queues pages that left the store's last tier (thread-safe)."""

        def listener(event: KVEvent) -> None:
            if event.best is None:
                self._gone.append(event.page)

        return listener

    def _drain(self) -> None:
        while self._gone:
            page = self._gone.popleft()
            if page in self._where:
                self.forget(page)

    def _page(self, key: Sequence[int], index: int) -> tuple[int, ...]:
        start = index * self.page_size
        return tuple(key[start : start + self.page_size])

    def _split(self, node: RadixNode, pages: int) -> RadixNode:
        """Cut `node` after its first `pages` pages; returns the new upper part."""
        assert node.parent is not None and 0 < pages < len(node.pages)
        cut = pages * self.page_size
        upper = RadixNode(
            key=node.key[:cut],
            pages=node.pages[:pages],
            parent=node.parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        node.parent.children[node.key[: self.page_size]] = upper
        node.key = node.key[cut:]
        node.pages = node.pages[pages:]
        node.parent = upper
        upper.children[node.key[: self.page_size]] = node
        for page in upper.pages:
            self._where[page] = upper
        return upper

    def _walk(self, key: Sequence[int], namespace: Namespace, limit: int) -> tuple[RadixNode, list[PageHash]]:
        """Deepest node matching the first `limit` pages of `key` (splitting a partly matched node)."""
        node = self.root(namespace)
        matched: list[PageHash] = []
        tick = next(self._clock)
        node.last_access = tick
        index = 0
        while index < limit:
            child = node.children.get(self._page(key, index))
            if child is None:
                break
            same = 1
            while same < len(child.pages) and index + same < limit:
                if self._page(child.key, same) != self._page(key, index + same):
                    break
                same += 1
            if same < len(child.pages):
                child = self._split(child, same)
            child.last_access = tick
            matched.extend(child.pages)
            index += same
            node = child
        return node, matched

    # -- public API ---------------------------------------------------------------------

    def match(self, key: Sequence[int], namespace: Namespace, max_pages: int | None = None) -> MatchResult:
        """Longest cached prefix of the full pages of `key` (at most `max_pages`). Marks it used."""
        self._drain()
        limit = len(key) // self.page_size
        if max_pages is not None:
            limit = min(limit, max_pages)
        node, pages = self._walk(key, namespace, limit)
        return MatchResult(pages=tuple(pages), node=node, page_size=self.page_size)

    def insert(self, key: Sequence[int], pages: Sequence[PageHash], namespace: Namespace) -> RadixNode:
        """Record that the first `len(pages)` pages of `key` have these KV page keys; returns the node
        where they end. Pages already in the tree are kept (equal keys have equal page hashes)."""
        self._drain()
        if len(key) < len(pages) * self.page_size:
            raise ValueError(f"{len(pages)} pages need {len(pages) * self.page_size} key ids, got {len(key)}")
        node, matched = self._walk(key, namespace, len(pages))
        if len(matched) == len(pages):
            return node
        rest = len(matched)
        leaf = RadixNode(
            key=tuple(key[rest * self.page_size : len(pages) * self.page_size]),
            pages=list(pages[rest:]),
            parent=node,
            last_access=node.last_access,
        )
        node.children[leaf.key[: self.page_size]] = leaf
        for page in leaf.pages:
            self._where[page] = leaf
        return leaf

    def lock(self, node: RadixNode) -> None:
        """Protect the path from the root to `node` from `evict` (counts nest)."""
        while node.parent is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        walk: RadixNode | None = node
        while walk is not None and walk.parent is not None:
            if walk.lock_ref <= 0:
                raise PrefixLockError("unlock of a prefix that is not locked")
            walk.lock_ref -= 1
            walk = walk.parent

    def forget(self, page: PageHash) -> list[PageHash]:
        """Drop `page` and every page below it (they are unreachable without it); returns them.

        A holder of a lock on a dropped node can still unlock it: parent links stay.
        """
        node = self._where.get(page)
        if node is None:
            return []
        index = node.pages.index(page)
        if index > 0:
            self._split(node, index)
        return self._detach(node)

    def _detach(self, node: RadixNode) -> list[PageHash]:
        assert node.parent is not None
        if node.attached:
            del node.parent.children[node.key[: self.page_size]]
        dropped: list[PageHash] = []
        stack = [node]
        while stack:
            current = stack.pop()
            current.attached = False
            for page in current.pages:
                if self._where.get(page) is current:
                    del self._where[page]
                    dropped.append(page)
            stack.extend(current.children.values())
        return dropped

    def evict(self, num_pages: int) -> list[PageHash]:
        """Forget at least `num_pages` pages (if that many are unlocked), least recently used
        leaves first; returns the forgotten pages so the caller can free them in the store."""
        self._drain()
        heap: list[tuple[int, int, RadixNode]] = []
        order = itertools.count()
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                if node.children:
                    stack.extend(node.children.values())
                elif node.lock_ref == 0:
                    heap.append((node.last_access, next(order), node))
        heapq.heapify(heap)
        dropped: list[PageHash] = []
        while heap and len(dropped) < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            dropped.extend(self._detach(node))
            if parent is not None and parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return dropped
