"""Workflows, their versions (save, list, get, diff), validation, import and export."""

from __future__ import annotations

import json
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Count, QuerySet
from django.http import HttpResponse
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import generics, mixins, parsers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from engine.client.graphs import GraphValidationError, parse_spec, to_python
from studio.errors import BadRequest, Conflict
from studio.jsonbody import LimitedJSONParser
from studio.numbers import DB_INT_MAX, count
from studio.workflows.api.serializers import (
    DiffSerializer,
    ErrorSerializer,
    ImportQuerySerializer,
    SpecInputSerializer,
    ValidationResultSerializer,
    VersionCreateSerializer,
    VersionSerializer,
    WorkflowCreateSerializer,
    WorkflowSerializer,
)
from studio.workflows.models import Workflow, WorkflowVersion
from studio.workflows.operations import (
    check_spec_for_studio,
    create_workflow,
    delete_workflow,
    invalid_workflow,
    parse_spec_input,
    read_spec,
    save_version,
)
from studio.workflows.specs import diff_documents

ERRORS = {
    400: OpenApiResponse(ErrorSerializer, description="malformed request or invalid GraphSpec"),
    401: OpenApiResponse(ErrorSerializer, description="no or bad credentials"),
    404: OpenApiResponse(ErrorSerializer, description="no such object (or not yours)"),
}


class PythonSourceParser(parsers.BaseParser):
    """`text/x-python` (or `text/plain`) bodies: DSL source, handed over as `{"source": text}`."""

    media_type = "text/x-python"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> dict[str, str]:
        try:
            return {"source": stream.read().decode("utf-8")}
        except UnicodeDecodeError:
            raise BadRequest("the source is not UTF-8 text") from None


class PlainTextParser(PythonSourceParser):
    media_type = "text/plain"


def statuses_param(value: str, known: list[str]) -> list[str]:
    """A list query parameter `status=a,b`: its statuses, each one of `known` (BadRequest naming
    those that are not)."""
    wanted = [s.strip() for s in value.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        raise BadRequest(f"unknown status {unknown}; known: {', '.join(known)}")
    return wanted


def visible_workflows(request: Request) -> QuerySet[Workflow]:
    return Workflow.objects.visible_to(request.user).select_related("owner")


def get_workflow(request: Request, workflow_id: Any) -> Workflow:
    return get_object_or_404(visible_workflows(request), pk=workflow_id)


@extend_schema_view(
    list=extend_schema(summary="List your workflows", responses={200: WorkflowSerializer(many=True), **ERRORS}),
    retrieve=extend_schema(summary="Get a workflow", responses={200: WorkflowSerializer, **ERRORS}),
    partial_update=extend_schema(summary="Rename or describe a workflow", responses={200: WorkflowSerializer,
                                                                                      **ERRORS}),
    update=extend_schema(summary="Replace a workflow's name and description",
                         responses={200: WorkflowSerializer, **ERRORS}),
    destroy=extend_schema(summary="Delete a workflow with its versions, runs, their files and its stopped"
                                  " deployments (409 while it has live deployments or runs in progress)",
                          responses={204: None, 409: ErrorSerializer, **ERRORS}),
)
class WorkflowViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.UpdateModelMixin,
                      mixins.DestroyModelMixin, viewsets.GenericViewSet):
    serializer_class = WorkflowSerializer
    parser_classes = [LimitedJSONParser, parsers.MultiPartParser, PythonSourceParser, PlainTextParser]

    def get_queryset(self) -> QuerySet[Workflow]:
        qs = visible_workflows(self.request).annotate(version_count=Count("versions"))
        # Most recently updated first (a saved version or a rename updates it), as dashboards list; workflows
        # updated in the same instant (the examples, loaded together) by name, so the order never shuffles.
        qs = qs.order_by("-updated_at", "name", "id")
        search = self.request.query_params.get("search")
        if search:
            qs = qs.filter(name__icontains=search)
        return qs

    @extend_schema(summary="Create a workflow (with version 1 when a spec or source is given)",
                   request=WorkflowCreateSerializer, responses={201: WorkflowSerializer, 409: ErrorSerializer,
                                                                **ERRORS})
    def create(self, request: Request) -> Response:
        data = WorkflowCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        attrs = data.validated_data
        checked = None
        if "spec" in attrs or "source" in attrs:
            checked = check_spec_for_studio(read_spec(spec=attrs.get("spec"), source=attrs.get("source")))
        name = attrs.get("name") or checked.spec.name
        description = attrs.get("description", checked.spec.description if checked else "")
        workflow = create_workflow(request.user, name=name, description=description, checked=checked,
                                   layout=attrs["layout"], message=attrs["message"])
        return Response(self._one(workflow), status=status.HTTP_201_CREATED)

    def _one(self, workflow: Workflow) -> dict[str, Any]:
        return WorkflowSerializer(self.get_queryset().get(pk=workflow.pk)).data

    def perform_update(self, serializer: WorkflowSerializer) -> None:
        try:
            with transaction.atomic():
                serializer.save()
        except IntegrityError:  # the owner's names are unique: the one constraint an update can break
            name = serializer.validated_data.get("name")
            raise ValidationError({"name": [f"you already have a workflow named {name!r}"]}) from None

    def perform_destroy(self, instance: Workflow) -> None:
        delete_workflow(instance)

    @extend_schema(
        summary="Import a workflow from GraphSpec JSON or Python DSL source",
        description="The body is a GraphSpec (application/json), DSL source (text/x-python or text/plain), or a"
                    " multipart form with a `file` part (.json or .py). Creates a workflow with version 1.",
        request={"application/json": OpenApiTypes.OBJECT, "text/x-python": OpenApiTypes.STR,
                 "multipart/form-data": {"type": "object", "properties": {"file": {"type": "string",
                                                                                    "format": "binary"}}}},
        parameters=[OpenApiParameter("name", str, description="workflow name (default: the spec's name)")],
        responses={201: WorkflowSerializer, 409: ErrorSerializer, **ERRORS},
    )
    @action(detail=False, methods=["post"], url_path="import", url_name="import")
    def import_(self, request: Request) -> Response:
        query = ImportQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        spec = read_spec(**_import_body(request))
        checked = check_spec_for_studio(spec)
        name = query.validated_data.get("name") or spec.name
        workflow = create_workflow(request.user, name=name, description=spec.description, checked=checked,
                                   message="imported")
        return Response(self._one(workflow), status=status.HTTP_201_CREATED)

    @extend_schema(
        summary="Export a version as GraphSpec JSON or Python DSL source",
        parameters=[
            OpenApiParameter("format", str, enum=["json", "python"], description="default json"),
            OpenApiParameter("version", int, description="default: the latest"),
        ],
        responses={(200, "application/json"): OpenApiTypes.OBJECT, (200, "text/x-python"): OpenApiTypes.STR,
                   **ERRORS},
    )
    @action(detail=True, methods=["get"])
    def export(self, request: Request, pk: Any = None) -> HttpResponse:
        workflow = self.get_object()
        number = request.query_params.get("version")
        versions = workflow.versions.all()
        if number is not None:
            version = get_object_or_404(versions, number=count(number, "version", DB_INT_MAX, minimum=1))
        else:
            version = versions.order_by("-number").first()
            if version is None:
                raise Conflict(f"workflow {workflow.name!r} has no saved version")
        fmt = request.query_params.get("format", "json")
        stem = f"{workflow.name}-v{version.number}"
        if fmt == "json":
            response = HttpResponse(json.dumps(version.spec, indent=2) + "\n", content_type="application/json")
            response["Content-Disposition"] = f'attachment; filename="{stem}.json"'
        elif fmt == "python":
            response = HttpResponse(to_python(parse_spec(version.spec)), content_type="text/x-python; charset=utf-8")
            response["Content-Disposition"] = f'attachment; filename="{stem}.py"'
        else:
            raise BadRequest(f"format must be 'json' or 'python', not {fmt!r}")
        return response


def _import_body(request: Request) -> dict[str, Any]:
    data = request.data
    upload = request.FILES.get("file") if hasattr(request, "FILES") else None
    if upload is not None:
        raw = upload.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest("the uploaded file is not UTF-8 text") from None
        if (upload.name or "").endswith(".py"):
            return {"source": text}
        return {"spec": text}
    if isinstance(data, dict) and set(data) == {"source"} and isinstance(data["source"], str):
        return {"source": data["source"]}
    if isinstance(data, dict) and set(data) == {"spec"}:
        return {"spec": data["spec"]}
    if not isinstance(data, dict) or not data:
        raise BadRequest("send a GraphSpec (JSON), DSL source (text/x-python) or a multipart `file`")
    return {"spec": dict(data)}


class VersionListView(generics.ListCreateAPIView):
    """A workflow's versions, newest first; POST saves a new one."""

    serializer_class = VersionSerializer

    def get_queryset(self) -> QuerySet[WorkflowVersion]:
        return self.workflow.versions.select_related("author").order_by("-number")

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        self.workflow = get_workflow(request, kwargs["workflow_id"])

    @extend_schema(summary="List versions", responses={200: VersionSerializer(many=True), **ERRORS})
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)

    @extend_schema(
        summary="Save a new version",
        description="Invalid specs are saved too (with their issues) so drafts are not lost; a spec that does not"
                    " parse at all is refused with 400. Saving what the latest version holds returns it (200).",
        request=VersionCreateSerializer,
        responses={201: VersionSerializer, 200: VersionSerializer, 409: ErrorSerializer, **ERRORS},
    )
    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        data = VersionCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        attrs = data.validated_data
        checked = check_spec_for_studio(read_spec(spec=attrs.get("spec"), source=attrs.get("source")))
        saved = save_version(self.workflow, checked, layout=attrs["layout"], message=attrs["message"],
                             author=request.user, base=attrs.get("base"))
        return Response(VersionSerializer(saved.version).data,
                        status=status.HTTP_201_CREATED if saved.created else status.HTTP_200_OK)


def get_version(request: Request, workflow_id: Any, number: int) -> WorkflowVersion:
    workflow = get_workflow(request, workflow_id)
    return get_object_or_404(workflow.versions.select_related("author", "workflow"), number=number)


class VersionDetailView(APIView):
    @extend_schema(summary="Get a version", responses={200: VersionSerializer, **ERRORS})
    def get(self, request: Request, workflow_id: Any, number: int) -> Response:
        return Response(VersionSerializer(get_version(request, workflow_id, number)).data)


class VersionDiffView(APIView):
    @extend_schema(
        summary="Diff two versions",
        parameters=[OpenApiParameter("against", int, description="the older version (default: the one before)")],
        responses={200: DiffSerializer, **ERRORS},
    )
    def get(self, request: Request, workflow_id: Any, number: int) -> Response:
        new = get_version(request, workflow_id, number)
        raw = request.query_params.get("against")
        against = count(raw, "against", DB_INT_MAX) if raw is not None else number - 1
        if against < 1:
            old_doc: dict[str, Any] = {}
        else:
            old_doc = get_version(request, workflow_id, against).spec
        diff = diff_documents(old_doc, new.spec)
        return Response({"workflow": new.workflow_id, "from_version": max(against, 0), "to_version": number, **diff})


class ValidateView(APIView):
    """Validate a GraphSpec (or DSL source) without saving it."""

    parser_classes = [LimitedJSONParser, PythonSourceParser, PlainTextParser]

    @extend_schema(
        summary="Validate a workflow",
        description="Body: `{\"spec\": GraphSpec}`, `{\"source\": DSL}`, a bare GraphSpec, or text/x-python source."
                    " 200 when valid; 400 listing every problem with its node/edge/port/role id. With `?report=1`"
                    " an invalid workflow answers 200 too, `valid` false and its problems in `issues` (`spec` null"
                    " when the document does not parse): for an editor checking as it edits, where an incomplete"
                    " graph is the normal case and not a failed request (browsers log every 4xx).",
        parameters=[OpenApiParameter("report", str, enum=["1", "true"],
                                     description="answer an invalid workflow with 200 and its issues")],
        request=SpecInputSerializer,
        responses={200: ValidationResultSerializer, **ERRORS},
    )
    def post(self, request: Request) -> Response:
        report = request.query_params.get("report")
        if report not in (None, "1", "true"):
            raise BadRequest(f"report must be 1 or true, not {report!r}")
        data = request.data
        if isinstance(data, dict) and ("spec" in data or "source" in data):
            body = SpecInputSerializer(data=data)
            body.is_valid(raise_exception=True)
            doc, source = body.validated_data.get("spec"), body.validated_data.get("source")
        else:
            doc, source = (data if isinstance(data, dict) else None), None
        try:
            spec = parse_spec_input(spec=doc, source=source)
        except GraphValidationError as exc:
            if report is None:
                raise invalid_workflow(exc) from None
            return Response({"valid": False, "issues": [i.to_dict() for i in exc.issues], "spec": None})
        checked = check_spec_for_studio(spec)
        if not checked.valid and report is None:
            count = len(checked.issues)
            raise BadRequest(f"invalid workflow: {count} problem{'s' if count != 1 else ''}", checked.issue_dicts())
        return Response({"valid": checked.valid, "issues": checked.issue_dicts(), "spec": checked.document})
