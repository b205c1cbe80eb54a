"""Open WebSockets per user (`OMNIFLOW_QUOTA_WEBSOCKETS`), counted in this web process.

Every socket holds a consumer, a subscription to the run bus or a metrics ticker: a script opening
sockets without end would hold the web process's memory and its event loop. `SocketSlots.take`
answers whether one more may open for a user; staff are exempt, as from every quota. The count is
per process: a studio behind several daphne processes allows the quota in each.
"""

from __future__ import annotations

import threading
from typing import Any


class SocketSlots:
    """How many WebSockets each user holds open here, at most `limit` each."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[Any, int] = {}
        self._lock = threading.Lock()

    def take(self, user: Any) -> bool:
        """Count one more socket of `user`; False (nothing counted) when they hold `limit` already."""
        if getattr(user, "is_staff", False):
            return True
        with self._lock:
            held = self._open.get(user.pk, 0)
            if held >= self.limit:
                return False
            self._open[user.pk] = held + 1
            return True

    def give_back(self, user: Any) -> None:
        """One socket `take` counted for `user` closed."""
        if getattr(user, "is_staff", False):
            return
        with self._lock:
            held = self._open.get(user.pk, 0) - 1
            if held > 0:
                self._open[user.pk] = held
            else:
                self._open.pop(user.pk, None)

    def held(self, user: Any) -> int:
        with self._lock:
            return self._open.get(user.pk, 0)
