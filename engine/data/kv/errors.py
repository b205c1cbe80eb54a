"""Typed errors of the paged KV cache."""

from __future__ import annotations


class KVError(Exception):
    """Base class of every error raised by `engine.data.kv`."""


class KVConfigError(KVError):
    """A store, tier or index was configured with values that cannot work."""


class DiskTierBusy(KVConfigError):
    """The disk tier's file is held by another live process."""


class KVCapacityError(KVError):
    """A tier has no room left: every page it holds is locked (or it holds none).

    Raised instead of evicting a page that is in use; the message names the tier,
    its capacity and how many of its pages are locked.
    """

    def __init__(self, tier: str, capacity_pages: int, locked_pages: int, needed_pages: int = 1) -> None:
        self.tier = tier
        self.capacity_pages = capacity_pages
        self.locked_pages = locked_pages
        self.needed_pages = needed_pages
        super().__init__(
            f"KV {tier} tier is full: capacity {capacity_pages} pages, {locked_pages} locked, "
            f"{needed_pages} more needed; unlock pages or give the tier more room"
        )


class KVLayoutError(KVError):
    """A page's shape, dtype or size does not match the store's KV layout."""


class KVPageNotFound(KVError, KeyError):
    """A page that the caller required is in no tier of the store."""


class KVLockError(KVError):
    """A lock was released that was not held, or a locked view was asked for an unlocked page."""


class KVTimeoutError(KVError, TimeoutError):
    """A prefetch, pull or index call did not finish within its timeout."""


class KVIndexError(KVError):
    """The distributed index (Redis) failed or answered something unexpected."""


class KVTransferError(KVError):
    """A cross-worker page pull failed: the peer is gone, refused, or sent bad bytes."""


class KVClosedError(KVError):
    """The store, tier or reader was used after `close()`."""
