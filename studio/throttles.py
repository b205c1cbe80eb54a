"""API throttles (DRF's, over Django's cache `throttle`: Redis in the distributed mode, so every
web process counts the same requests; this process's memory otherwise).

Three scopes, each a rate of `studio.config.Throttles` (`OMNIFLOW_THROTTLE_<SCOPE>`, read per
request): `login` (session log-ins, per client address), `token` (issuing API tokens, per
user) and `run` (submitting runs over REST and `/v1/chat/completions`, per user). A throttled
request is 429 with the error shape and `Retry-After`.
"""

from __future__ import annotations

from typing import Any

from django.core.cache import caches
from rest_framework.throttling import SimpleRateThrottle

CACHE_ALIAS = "throttle"


class StudioThrottle(SimpleRateThrottle):
    """A scope's rate, read from the studio's configuration; only the methods in `methods` count."""

    methods: frozenset[str] = frozenset({"POST"})

    def __init__(self) -> None:
        self.cache = caches[CACHE_ALIAS]
        super().__init__()

    def get_rate(self) -> str | None:
        from studio.workflows.apps import engine

        return getattr(engine().config.throttles, self.scope)

    user: Any = None
    """Whom to count, when the request is not DRF's (see `run_throttle_wait`)."""

    def get_cache_key(self, request: Any, view: Any) -> str | None:
        user = self.user if self.user is not None else getattr(request, "user", None)
        ident = f"user-{user.pk}" if user is not None and user.is_authenticated else self.get_ident(request)
        return self.cache_format % {"scope": self.scope, "ident": ident}

    def allow_request(self, request: Any, view: Any) -> bool:
        if request.method not in self.methods:
            return True
        return super().allow_request(request, view)


class LoginThrottle(StudioThrottle):
    scope = "login"

    def get_cache_key(self, request: Any, view: Any) -> str | None:
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}


class TokenThrottle(StudioThrottle):
    scope = "token"


class RunThrottle(StudioThrottle):
    scope = "run"


def run_throttle_wait(request: Any, user: Any) -> float | None:
    """For views outside DRF (`/v1/chat/completions`): None when `user` may submit a run now,
    else the seconds to wait. Counts the request."""
    throttle = RunThrottle()
    throttle.user = user
    if throttle.allow_request(request, None):
        return None
    return throttle.wait() or 1.0
