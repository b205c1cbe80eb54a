from __future__ import annotations

from django.contrib import admin

from studio.workflows.models import (
    Deployment,
    NodeHeartbeat,
    NodeRun,
    Run,
    RunEvent,
    RunFile,
    Session,
    Worker,
    Workflow,
    WorkflowVersion,
)


class ReadOnlyInline(admin.TabularInline):
    """Rows the studio writes (versions, node states): listed under their parent, never added,
    changed or deleted there. A subclass names `model` and its `fields`."""

    extra = 0
    can_delete = False

    def get_readonly_fields(self, request, obj=None) -> tuple[str, ...]:
        return tuple(self.fields)

    def has_add_permission(self, request, obj=None) -> bool:
        return False


class VersionInline(ReadOnlyInline):
    model = WorkflowVersion
    fields = ("number", "valid", "message", "author", "created_at")
    show_change_link = True


@admin.register(Workflow)
class WorkflowAdmin(admin.ModelAdmin):
    list_display = ("name", "owner", "updated_at", "created_at")
    search_fields = ("name", "description", "owner__username")
    raw_id_fields = ("owner",)
    inlines = [VersionInline]


@admin.register(WorkflowVersion)
class WorkflowVersionAdmin(admin.ModelAdmin):
    """Versions are immutable: viewable, not editable."""

    list_display = ("workflow", "number", "valid", "author", "created_at")
    list_filter = ("valid",)
    search_fields = ("workflow__name", "message")
    readonly_fields = ("workflow", "number", "spec", "spec_hash", "layout", "message", "author", "created_at",
                       "valid", "issues")

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


class WorkerInline(admin.TabularInline):
    model = Worker
    extra = 0


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    """`plane_secret` is left out: whoever holds it can join the deployment's worker plane, and the
    admin is no place to show or change it (`manage.py deployment_keys` writes it for a worker that
    joins). The public key is shown, not editable: it has to match the secret."""

    list_display = ("__str__", "owner", "status", "cache_scope", "created_at")
    list_filter = ("status", "cache_scope")
    raw_id_fields = ("owner", "version")
    exclude = ("plane_secret",)
    readonly_fields = ("plane_public",)
    inlines = [WorkerInline]


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    list_display = ("worker_id", "deployment", "role", "status", "address", "last_seen_at")
    list_filter = ("status", "role")


@admin.register(NodeHeartbeat)
class NodeHeartbeatAdmin(admin.ModelAdmin):
    """Written by the node agents (`deployments.liveness`): shown, never edited here."""

    list_display = ("name", "seen_at", "lapses_at", "ttl_s")
    readonly_fields = ("name", "seen_at", "lapses_at", "ttl_s")

    def has_add_permission(self, request) -> bool:
        return False


class NodeRunInline(ReadOnlyInline):
    model = NodeRun
    fields = ("node", "kind", "state", "attempts", "iterations", "duration_ms", "error")


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ("id", "workflow", "version", "owner", "status", "created_at", "duration_ms")
    list_filter = ("status",)
    search_fields = ("id", "workflow__name", "owner__username")
    raw_id_fields = ("owner", "workflow", "version", "deployment")
    readonly_fields = ("last_seq", "started_at", "finished_at", "duration_ms")
    inlines = [NodeRunInline]


@admin.register(NodeRun)
class NodeRunAdmin(admin.ModelAdmin):
    list_display = ("run", "node", "kind", "state", "attempts", "duration_ms")
    list_filter = ("state", "kind")
    raw_id_fields = ("run",)


@admin.register(RunEvent)
class RunEventAdmin(admin.ModelAdmin):
    list_display = ("run", "seq", "type")
    list_filter = ("type",)
    raw_id_fields = ("run",)

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(RunFile)
class RunFileAdmin(admin.ModelAdmin):
    list_display = ("filename", "run", "role", "name", "content_type", "size", "owner")
    list_filter = ("role",)
    raw_id_fields = ("run", "owner")


@admin.register(Session)
class SessionAdmin(admin.ModelAdmin):
    list_display = ("__str__", "owner", "deployment", "closed", "updated_at")
    list_filter = ("closed",)
    raw_id_fields = ("owner", "deployment")
