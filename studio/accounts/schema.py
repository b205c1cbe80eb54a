"""OpenAPI description of the bearer-token authentication (drf-spectacular extension,
registered by importing this module; AccountsConfig.ready does)."""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "studio.accounts.auth.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer",
                "description": "an API token: `python manage.py create_token USER` or POST /api/tokens/"}
