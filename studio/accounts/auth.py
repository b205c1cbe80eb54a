"""Authentication: `Authorization: Bearer <token>` for REST and WebSockets, sessions for the browser.

REST: `BearerTokenAuthentication` (first, so a missing credential answers 401 with
`WWW-Authenticate: Bearer`) and DRF's `SessionAuthentication`, which enforces CSRF on
session-authenticated writes.

WebSockets: `websocket_auth(inner)` puts the user in `scope["user"]`. A bearer token
wins; otherwise the session cookie counts only when the handshake's `Origin` is one of
this site's hosts, the WebSocket analogue of the CSRF check (a page on another site can
open a socket with the victim's cookies, but not with their token).
"""

from __future__ import annotations

import datetime as dt
from typing import Any
from urllib.parse import urlsplit

from channels.auth import AuthMiddlewareStack
from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from django.http.request import validate_host
from django.utils import timezone
from rest_framework import authentication, exceptions

from studio.accounts.models import ApiToken
from studio.dbcalls import orm

_TOUCH_EVERY = dt.timedelta(minutes=1)


def bearer_token(header: bytes | str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header value, or None."""
    if not header:
        return None
    if isinstance(header, bytes):
        header = header.decode("latin1")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def user_for_token(secret: str) -> Any | None:
    """The active user owning `secret`, or None; records when the token was last used."""
    token = ApiToken.objects.resolve(secret)
    if token is None or not token.user.is_active:
        return None
    now = timezone.now()
    if token.last_used_at is None or now - token.last_used_at > _TOUCH_EVERY:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token.user


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request) -> tuple[Any, str] | None:
        header = authentication.get_authorization_header(request)
        if not header:
            return None
        if not header.lower().startswith(b"bearer"):
            return None
        secret = bearer_token(header)
        if secret is None:
            raise exceptions.AuthenticationFailed("malformed Authorization header: expected 'Bearer <token>'")
        user = user_for_token(secret)
        if user is None:
            raise exceptions.AuthenticationFailed("invalid or revoked API token")
        return (user, secret)

    def authenticate_header(self, request) -> str:
        return self.keyword


def origin_allowed(origin: bytes | None) -> bool:
    if not origin:
        return False
    parts = urlsplit(origin.decode("latin1"))
    if not parts.hostname:
        return False
    if f"{parts.scheme}://{parts.netloc}" in settings.CSRF_TRUSTED_ORIGINS:
        return True
    return validate_host(parts.hostname, settings.ALLOWED_HOSTS)


class _BearerOrSameOriginSession:
    """Inner half of `websocket_auth`: runs after Channels' session middleware."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        headers = dict(scope.get("headers", []))
        secret = bearer_token(headers.get(b"authorization"))
        if secret is not None:
            # Read-only and independent of the request thread: off the one thread sync views share,
            # so a burst of REST writes does not hold WebSocket handshakes past their timeout.
            user = await orm(user_for_token, thread_sensitive=False)(secret)
            scope = {**scope, "user": user or AnonymousUser(), "auth": "token" if user else "invalid-token"}
        elif getattr(scope.get("user"), "is_authenticated", False):
            if origin_allowed(headers.get(b"origin")):
                scope = {**scope, "auth": "session"}
            else:
                scope = {**scope, "user": AnonymousUser(), "auth": "cross-origin-session"}
        else:
            scope = {**scope, "auth": None}
        return await self.inner(scope, receive, send)


def websocket_auth(inner: Any) -> Any:
    return AuthMiddlewareStack(_BearerOrSameOriginSession(inner))
