"""Per-user API tokens. Only a token's SHA-256 is stored; the token itself is shown once."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import models

TOKEN_PREFIX = "of_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class IssuedToken:
    """A new token: `secret` is the only copy of the token text; it is not stored."""

    token: ApiToken
    secret: str


class ApiTokenManager(models.Manager["ApiToken"]):
    def issue(self, user: Any, name: str = "") -> IssuedToken:
        secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
        token = self.create(user=user, name=name, key_hash=hash_token(secret), prefix=secret[:10])
        return IssuedToken(token=token, secret=secret)

    def resolve(self, secret: str) -> ApiToken | None:
        """The live token with this text, or None."""
        return self.select_related("user").filter(key_hash=hash_token(secret), revoked=False).first()


class ApiToken(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100, blank=True)
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(max_length=16, editable=False, help_text="first characters, to recognise a token")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked = models.BooleanField(default=False)

    objects = ApiTokenManager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user}{', revoked' if self.revoked else ''})"
