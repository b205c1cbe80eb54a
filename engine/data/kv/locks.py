"""Pages locked in the device tier for compute (`KVStore.lock`): how a store takes and gives back
locks over its `TierHierarchy`, under its mutex.

A locked page stays in the device tier, in its slot: eviction passes it over (the hierarchy's
`locks`, which it reads), until its last lock is given back. Locks nest, one count per lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack

from engine.data.kv.errors import KVLockError, KVPageNotFound
from engine.data.kv.hierarchy import TierHierarchy
from engine.data.kv.keys import PageHash
from engine.data.kv.tier import Tier


def lock_pages(tiers: TierHierarchy, pages: Sequence[PageHash]) -> list[Tier]:
    """Take one lock on each of `pages` in the device tier, promoting a page held only lower down
    (a page listed twice: two locks); returns the tier each was found in, in order. All or
    nothing: a page in no tier (`KVPageNotFound`) or one the device tier cannot take
    (`KVCapacityError`) gives back the locks this call took. Counts no lookups."""
    taken: list[PageHash] = []
    found: list[Tier] = []
    device = tiers.device
    with ExitStack() as undo:
        undo.callback(tiers.release, taken)  # on any failure, the locks this call took so far
        for page in pages:
            if page in device:
                tiers.levels[Tier.DEVICE].tracker.touch(page)
                found.append(Tier.DEVICE)
            else:
                source = tiers.best(page)
                if source is None or not tiers.promote(page):
                    raise KVPageNotFound(page)
                found.append(source)
            tiers.locks[page] += 1
            taken.append(page)
        undo.pop_all()
    return found


def unlock_pages(tiers: TierHierarchy, pages: Sequence[PageHash]) -> None:
    """Give back one lock on each of `pages` (a page listed twice: two). All or nothing:
    `KVLockError`, and no lock given back, when a page holds fewer locks than that."""
    missing = [page for page, n in Counter(pages).items() if tiers.locks.get(page, 0) < n]
    if missing:
        raise KVLockError(f"unlock of pages that are not locked: {missing[:4]}")
    tiers.release(pages)
