from __future__ import annotations

from django.apps import AppConfig


class AccountsConfig(AppConfig):
    """Users' API tokens and the authentication used by REST and WebSockets."""

    name = "studio.accounts"
    label = "accounts"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from studio.accounts import schema  # noqa: F401 - registers the OpenAPI extension
