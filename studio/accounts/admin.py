from __future__ import annotations

from django.contrib import admin

from studio.accounts.models import ApiToken


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("prefix", "user", "name", "created_at", "last_used_at", "revoked")
    list_filter = ("revoked",)
    search_fields = ("user__username", "name", "prefix")
    readonly_fields = ("key_hash", "prefix", "created_at", "last_used_at")
    raw_id_fields = ("user",)

    def has_add_permission(self, request) -> bool:
        return False  # tokens are issued with `manage.py create_token` or POST /api/tokens/
