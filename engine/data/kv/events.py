"""`KVEvent`: one change of a page's residency in a `KVStore`, as its listeners get it.

The store's tier moves (`hierarchy`) emit them in order while the store's mutex is held, so a
listener sees every change and may read the store (`device_slot`) as of that change: keep it
short (the index publisher only buffers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from engine.data.kv.keys import PageHash
from engine.data.kv.tier import Tier


class KVEventKind(StrEnum):
    STORED = "stored"  # written into `tier` by put (or write-through)
    PROMOTED = "promoted"  # copied up into `tier` from `source`
    DEMOTED = "demoted"  # moved down into `tier` from `source` (copied unless already there)
    EVICTED = "evicted"  # removed from `tier` to make room
    DROPPED = "dropped"  # removed from `tier` because it was corrupt or explicitly removed


@dataclass(frozen=True, slots=True)
class KVEvent:
    kind: KVEventKind
    page: PageHash
    tier: Tier
    source: Tier | None = None
    best: Tier | None = None  # the fastest tier holding the page after the event; None: gone


KVListener = Callable[[KVEvent], None]
