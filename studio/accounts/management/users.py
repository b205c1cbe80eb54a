"""What the management commands share about users."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.base_user import AbstractBaseUser
from django.core.management.base import CommandError


def user_named(username: str) -> AbstractBaseUser:
    """The user whose username is `username`; a `CommandError` when there is none."""
    User = get_user_model()
    try:
        return User.objects.get(**{User.USERNAME_FIELD: username})
    except User.DoesNotExist:
        raise CommandError(f"no user {username!r}") from None
