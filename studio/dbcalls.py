"""The ORM from async code: `orm(fn)` awaits `fn` on a thread and returns the database
connections it opened, in the context that holds them.

Channels' `database_sync_to_async` closes old connections after a call, but from the worker
thread's own context, while asgiref runs the function in a copy of the caller's context (and
copies it back into the caller): the connection Django opened lives in that copy. With the
PostgreSQL pool (`OMNIFLOW_DB_POOL`) such a connection stays checked out for as long as the
calling task's context lives, and is never returned once that task ends: a pool of 16 ran dry
after 16 WebSocket handshakes. `orm` closes inside the call (with `CONN_MAX_AGE` 0, closing
hands the connection back to the pool).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from channels.db import database_sync_to_async
from django.db import close_old_connections

P = ParamSpec("P")
R = TypeVar("R")


def orm(fn: Callable[P, R], *, thread_sensitive: bool = True) -> Callable[P, Coroutine[Any, Any, R]]:
    """`fn` as a coroutine function run on a thread (the one thread sync views share, or with
    `thread_sensitive=False` any thread: for reads that need not wait behind writes); the
    connections it opened go back when it returns or raises."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        finally:
            close_old_connections()

    return database_sync_to_async(call, thread_sensitive=thread_sensitive)
