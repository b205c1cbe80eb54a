"""Serializers: the API's untrusted edge. They check shapes; GraphSpec meaning is checked
by the engine's validator (see `studio.workflows.specs`)."""

from __future__ import annotations

import time
from typing import Any

from django.urls import reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from studio.workflows.chat.shape import is_chat
from studio.workflows.models import (
    MAX_WORKFLOW_NAME,
    NodeRun,
    Run,
    RunFile,
    RunStatus,
    Workflow,
    WorkflowVersion,
)
from studio.workflows.runs.store import file_url
from studio.workflows.weights import model_weights


class IssueSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()
    node = serializers.CharField(required=False)
    edge = serializers.CharField(required=False)
    port = serializers.CharField(required=False)
    role = serializers.CharField(required=False)
    path = serializers.CharField(required=False)


class ErrorSerializer(serializers.Serializer):
    """Every error response."""

    error = serializers.CharField()
    details = serializers.ListField(child=serializers.JSONField())


class SpecInputSerializer(serializers.Serializer):
    """A workflow given as a GraphSpec document (`spec`) or as DSL source (`source`)."""

    spec = serializers.JSONField(required=False, help_text="GraphSpec document")
    source = serializers.CharField(required=False, trim_whitespace=False, help_text="Python DSL source")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if ("spec" in attrs) == ("source" in attrs):
            raise serializers.ValidationError("give exactly one of `spec` (GraphSpec JSON) or `source` (Python DSL)")
        return attrs


class VersionCreateSerializer(SpecInputSerializer):
    layout = serializers.JSONField(required=False, default=dict, help_text="editor layout (node positions…)")
    message = serializers.CharField(required=False, allow_blank=True, default="")
    base = serializers.IntegerField(required=False, min_value=1,
                                    help_text="the version this edit started from; 409 if a newer one was saved")

    def validate_layout(self, value: Any) -> Any:
        if not isinstance(value, dict):
            raise serializers.ValidationError("layout is a JSON object")
        return value


class VersionSummarySerializer(serializers.ModelSerializer):
    class Meta:
        model = WorkflowVersion
        fields = ["number", "valid", "message", "created_at", "spec_hash"]


class VersionSerializer(serializers.ModelSerializer):
    workflow = serializers.UUIDField(source="workflow_id", read_only=True)
    author = serializers.SlugRelatedField(slug_field="username", read_only=True)
    issues = IssueSerializer(many=True, read_only=True)
    chat = serializers.SerializerMethodField(help_text="whether a deployment of it is a chat model on /v1")

    class Meta:
        model = WorkflowVersion
        fields = ["workflow", "number", "spec", "spec_hash", "layout", "message", "author", "created_at", "valid",
                  "issues", "chat"]
        read_only_fields = fields

    def get_chat(self, obj: WorkflowVersion) -> bool:
        return is_chat(obj.spec)


class WorkflowSerializer(serializers.ModelSerializer):
    owner = serializers.SlugRelatedField(slug_field="username", read_only=True)
    latest_version = serializers.SerializerMethodField()
    version_count = serializers.IntegerField(read_only=True)

    class Meta:
        model = Workflow
        fields = ["id", "name", "description", "owner", "created_at", "updated_at", "latest_version",
                  "version_count"]
        read_only_fields = ["id", "owner", "created_at", "updated_at"]

    @extend_schema_field(VersionSummarySerializer(allow_null=True))
    def get_latest_version(self, obj: Workflow) -> dict[str, Any] | None:
        latest = getattr(obj, "_latest", None) or obj.latest_version()
        return None if latest is None else VersionSummarySerializer(latest).data


class WorkflowCreateSerializer(serializers.Serializer):
    """A new workflow, with its first version when `spec` or `source` is given."""

    name = serializers.CharField(max_length=MAX_WORKFLOW_NAME, required=False,
                                 help_text="defaults to the spec's name")
    description = serializers.CharField(required=False, allow_blank=True)
    spec = serializers.JSONField(required=False)
    source = serializers.CharField(required=False, trim_whitespace=False)
    layout = serializers.JSONField(required=False, default=dict)
    message = serializers.CharField(required=False, allow_blank=True, default="")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "spec" in attrs and "source" in attrs:
            raise serializers.ValidationError("give at most one of `spec` or `source`")
        if "name" not in attrs and "spec" not in attrs and "source" not in attrs:
            raise serializers.ValidationError("give a `name`, or a `spec`/`source` to take it from")
        return attrs


class ImportQuerySerializer(serializers.Serializer):
    """The query parameters of an import."""

    name = serializers.CharField(max_length=MAX_WORKFLOW_NAME, required=False, allow_blank=True,
                                 help_text="the workflow's name (default, or when blank: the spec's)")


class ValidationResultSerializer(serializers.Serializer):
    valid = serializers.BooleanField()
    issues = IssueSerializer(many=True)
    spec = serializers.JSONField(allow_null=True,
                                 help_text="the canonical GraphSpec (null, with ?report=1, when it does not parse)")


class DiffSerializer(serializers.Serializer):
    workflow = serializers.UUIDField()
    from_version = serializers.IntegerField()
    to_version = serializers.IntegerField()
    fields = serializers.JSONField()
    roles = serializers.JSONField()
    nodes = serializers.JSONField()
    edges = serializers.JSONField()
    unified = serializers.CharField()


# ------------------------------------------------------------------------------- runs
class RunCreateSerializer(serializers.Serializer):
    """Submit a run. JSON, or multipart/form-data with `inputs` as a JSON string and one
    file part per image/audio input, named after the input."""

    workflow = serializers.UUIDField(required=False)
    version = serializers.IntegerField(required=False, min_value=1, help_text="defaults to the latest")
    deployment = serializers.UUIDField(required=False)
    inputs = serializers.JSONField(required=False, default=dict)
    timeout_s = serializers.FloatField(required=False, min_value=0.001, max_value=86400)

    def validate_inputs(self, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise serializers.ValidationError("inputs is a JSON object: input name -> value")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "workflow" not in attrs and "deployment" not in attrs:
            raise serializers.ValidationError("give a `workflow` (and optionally a `version`) or a `deployment`")
        return attrs


class RunFileSerializer(serializers.ModelSerializer):
    url = serializers.SerializerMethodField()

    class Meta:
        model = RunFile
        fields = ["id", "role", "name", "filename", "content_type", "size", "sha256", "created_at", "url"]

    def get_url(self, obj: RunFile) -> str:
        return file_url(obj.run_id, obj.id)


class NodeRunSerializer(serializers.ModelSerializer):
    class Meta:
        model = NodeRun
        fields = ["node", "kind", "state", "attempts", "iterations", "started_at", "finished_at", "duration_ms",
                  "error", "progress", "message", "outputs", "frames"]


class RunSerializer(serializers.ModelSerializer):
    workflow_name = serializers.CharField(source="workflow.name", read_only=True)
    version = serializers.IntegerField(source="version.number", read_only=True)
    deployment_name = serializers.CharField(
        source="deployment.name", read_only=True, allow_null=True,
        help_text="the name of the deployment the run ran on (may be blank); null when it ran on the studio's engine")
    owner = serializers.SlugRelatedField(slug_field="username", read_only=True)
    status = serializers.ChoiceField(choices=RunStatus.choices, read_only=True)
    links = serializers.SerializerMethodField()
    queue_position = serializers.SerializerMethodField(
        help_text="a pending run's place in the queue (1: next to start), counting every user's pending runs;"
                  " null once it runs")

    class Meta:
        model = Run
        fields = ["id", "workflow", "workflow_name", "version", "deployment", "deployment_name", "owner", "status",
                  "inputs", "outputs", "error", "failed_node", "timeout_s", "created_at", "started_at", "finished_at",
                  "duration_ms", "last_seq", "queue_position", "links"]
        read_only_fields = fields

    @extend_schema_field(serializers.IntegerField(allow_null=True))
    def get_queue_position(self, obj: Run) -> int | None:
        if obj.status != RunStatus.PENDING:
            return None
        return Run.objects.filter(status=RunStatus.PENDING, created_at__lt=obj.created_at).count() + 1

    @extend_schema_field(OpenApiTypes.OBJECT)
    def get_links(self, obj: Run) -> dict[str, str]:
        return {
            "self": reverse("run-detail", kwargs={"pk": obj.pk}),
            "events": reverse("run-events", kwargs={"pk": obj.pk}),
            "cancel": reverse("run-cancel", kwargs={"pk": obj.pk}),
            "websocket": f"/ws/runs/{obj.pk}/",
        }


class RunDetailSerializer(RunSerializer):
    nodes = NodeRunSerializer(many=True, read_only=True)
    files = RunFileSerializer(many=True, read_only=True)
    output_links = serializers.SerializerMethodField(help_text="output name -> download URL, for file outputs")
    server_time = serializers.SerializerMethodField(
        help_text="the server's clock (UNIX seconds) as it answered: what live times count on, with event times")
    spec = serializers.JSONField(source="version.spec", read_only=True,
                                 help_text="the GraphSpec of the version run: the run view draws it with the run")
    layout = serializers.JSONField(source="version.layout", read_only=True, help_text="that version's editor layout")
    random_weights_roles = serializers.SerializerMethodField(
        help_text="the roles that computed with seeded random weights (for testing): what they made is noise")

    class Meta(RunSerializer.Meta):
        fields = [*RunSerializer.Meta.fields, "nodes", "files", "output_links", "server_time", "spec", "layout",
                  "random_weights_roles"]
        read_only_fields = fields

    @extend_schema_field(serializers.ListField(child=serializers.CharField()))
    def get_random_weights_roles(self, obj: Run) -> list[str]:
        return list(model_weights(obj.version.spec).random_roles)

    @extend_schema_field(serializers.FloatField())
    def get_server_time(self, obj: Run) -> float:
        return time.time()

    @extend_schema_field(serializers.DictField(child=serializers.CharField()))
    def get_output_links(self, obj: Run) -> dict[str, str]:
        return {
            name: file_url(obj.pk, value["$file"])
            for name, value in obj.outputs.items()
            if isinstance(value, dict) and set(value) == {"$file"}
        }


class RunEventSerializer(serializers.Serializer):
    seq = serializers.IntegerField()
    type = serializers.CharField()
    data = serializers.JSONField()
