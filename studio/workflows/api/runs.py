"""Runs: submit (JSON, or multipart with image/audio files), list with filters, get with
per-node states and output links, cancel, replay events, download files (owner only)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from django.db.models import QuerySet
from django.http import FileResponse
from django.shortcuts import get_object_or_404
from django.utils.dateparse import parse_datetime
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, parsers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response

from studio.errors import BadRequest, Conflict
from studio.jsonbody import LimitedJSONParser
from studio.numbers import DB_INT_MAX, count
from studio.throttles import RunThrottle
from studio.workflows.api.serializers import (
    ErrorSerializer,
    RunCreateSerializer,
    RunDetailSerializer,
    RunEventSerializer,
    RunSerializer,
)
from studio.workflows.api.workflows import ERRORS, get_workflow, statuses_param
from studio.workflows.apps import engine
from studio.workflows.models import Deployment, Run, RunFile, RunStatus
from studio.workflows.operations import (
    cancel_run,
    create_run,
    delete_run,
    parse_json_field,
    resolve_run_target,
)
from studio.workflows.runs.service import CancelOutcome

INLINE_TYPES = frozenset({"image/png", "image/jpeg", "image/webp", "audio/wav", "audio/mpeg", "audio/ogg",
                          "audio/flac"})
"""Served inline (players, <img>); anything else downloads as an attachment."""

EVENTS_PAGE = 1000

CANCEL_WAIT_S = 10.0
"""How long a cancel request waits for a run executing in another process to end (then 202)."""


def _datetime(raw: str, name: str) -> dt.datetime:
    value = parse_datetime(raw)
    if value is None:
        raise BadRequest(f"{name} must be an ISO 8601 date-time, not {raw!r}")
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


@extend_schema_view(
    list=extend_schema(
        summary="List runs",
        parameters=[
            OpenApiParameter("status", str, description="comma-separated: pending,running,done,failed,cancelled"),
            OpenApiParameter("workflow", OpenApiTypes.UUID),
            OpenApiParameter("version", int, description="with `workflow`"),
            OpenApiParameter("deployment", OpenApiTypes.UUID),
            OpenApiParameter("created_after", OpenApiTypes.DATETIME),
            OpenApiParameter("created_before", OpenApiTypes.DATETIME),
        ],
        responses={200: RunSerializer(many=True), **ERRORS},
    ),
    retrieve=extend_schema(summary="Get a run with its nodes' states and output links",
                           responses={200: RunDetailSerializer, **ERRORS}),
    destroy=extend_schema(summary="Delete a finished run with its events and files",
                          responses={204: None, 409: ErrorSerializer, **ERRORS}),
)
class RunViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin,
                 viewsets.GenericViewSet):
    parser_classes = [LimitedJSONParser, parsers.MultiPartParser, parsers.FormParser]

    def get_serializer_class(self) -> type:
        return RunSerializer if self.action == "list" else RunDetailSerializer

    def get_throttles(self) -> list[Any]:
        return [RunThrottle()] if self.action == "create" else []

    def get_queryset(self) -> QuerySet[Run]:
        qs = Run.objects.visible_to(self.request.user).select_related("workflow", "version", "deployment", "owner")
        if self.action != "list":
            return qs.prefetch_related("nodes", "files")
        params = self.request.query_params
        if params.get("status"):
            qs = qs.filter(status__in=statuses_param(params["status"], RunStatus.values))
        for field in ("workflow", "deployment"):
            if params.get(field):
                qs = qs.filter(**{f"{field}_id": _uuid(params[field], field)})
        if params.get("version"):
            qs = qs.filter(version__number=count(params["version"], "version", DB_INT_MAX, minimum=1))
        if params.get("created_after"):
            qs = qs.filter(created_at__gte=_datetime(params["created_after"], "created_after"))
        if params.get("created_before"):
            qs = qs.filter(created_at__lt=_datetime(params["created_before"], "created_before"))
        return qs

    def perform_destroy(self, instance: Run) -> None:
        delete_run(instance)

    @extend_schema(
        summary="Submit a run",
        description="JSON: `{workflow, version?, inputs, timeout_s?}` (or `deployment` instead of workflow)."
                    " Multipart: the same fields, `inputs` as a JSON string, and one file part per image/audio"
                    " input named after the input. 422 when the version is invalid or the inputs do not fit.",
        request={"application/json": RunCreateSerializer, "multipart/form-data": RunCreateSerializer},
        responses={201: RunDetailSerializer, 409: ErrorSerializer, 413: ErrorSerializer, 422: ErrorSerializer,
                   **ERRORS},
    )
    def create(self, request: Request) -> Response:
        raw = {k: request.data[k] for k in ("workflow", "version", "deployment", "timeout_s", "inputs")
               if k in request.data}
        if "inputs" in raw:
            raw["inputs"] = parse_json_field(raw["inputs"], "inputs")
        body = RunCreateSerializer(data=raw)
        body.is_valid(raise_exception=True)
        attrs = body.validated_data
        deployment = None
        workflow = None
        if "deployment" in attrs:
            deployment = get_object_or_404(Deployment.objects.visible_to(request.user).select_related("version"),
                                           pk=attrs["deployment"])
        else:
            workflow = get_workflow(request, attrs["workflow"])
        version = resolve_run_target(request.user, workflow=workflow, number=attrs.get("version"),
                                     deployment=deployment)
        files = {name: upload for name, upload in request.FILES.items()}
        run = create_run(request.user, version, attrs["inputs"], files=files, deployment=deployment,
                         timeout_s=attrs.get("timeout_s"))
        body = RunDetailSerializer(self.get_queryset().get(pk=run.pk)).data
        return Response(body, status=status.HTTP_201_CREATED, headers={"Location": body["links"]["self"]})

    @extend_schema(summary="Cancel a run",
                   description="In every mode: a pending run, or one whose executor stopped, ends `cancelled` at"
                               " once; a running one is stopped by whoever executes it. 200 once it has ended"
                               " `cancelled`; 202 while its executor (another process) is still stopping it.",
                   request=None,
                   responses={200: RunDetailSerializer, 202: RunDetailSerializer, 409: ErrorSerializer, **ERRORS})
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: Any = None) -> Response:
        run = self.get_object()
        if run.finished:
            raise Conflict(f"run {run.pk} has already finished ({run.status})")
        outcome = cancel_run(str(run.pk), wait_s=min(engine().config.run_lease_s, CANCEL_WAIT_S))
        run = self.get_queryset().get(pk=run.pk)
        if outcome is CancelOutcome.FINISHED:
            raise Conflict(f"run {run.pk} finished ({run.status}) before it could be cancelled")
        accepted = outcome is CancelOutcome.REQUESTED
        return Response(RunDetailSerializer(run).data, status=status.HTTP_202_ACCEPTED if accepted else 200)

    @extend_schema(
        summary="A run's events from a sequence number on",
        parameters=[OpenApiParameter("since", int, description="first seq to return (default 0)"),
                    OpenApiParameter("limit", int, description=f"at most this many (default/max {EVENTS_PAGE})")],
        responses={200: RunEventSerializer(many=True), **ERRORS},
    )
    @action(detail=True, methods=["get"], pagination_class=None)
    def events(self, request: Request, pk: Any = None) -> Response:
        run = self.get_object()
        since = count(request.query_params.get("since", "0"), "since", DB_INT_MAX)
        limit = min(count(request.query_params.get("limit", str(EVENTS_PAGE)), "limit", DB_INT_MAX), EVENTS_PAGE)
        events = run.events.filter(seq__gte=since).order_by("seq")[:limit]
        return Response([{"seq": e.seq, "type": e.type, "data": e.data} for e in events])

    @extend_schema(summary="Download a run's input or output file",
                   responses={(200, "application/octet-stream"): OpenApiTypes.BINARY, **ERRORS})
    @action(detail=True, methods=["get"], url_path=r"files/(?P<file_id>[0-9a-f-]{32,36})", url_name="file")
    def file(self, request: Request, pk: Any = None, file_id: str | None = None) -> FileResponse:
        run = self.get_object()  # 404 unless the run is the caller's (or the caller is staff)
        try:  # the URL's pattern lets through what only looks like one (36 dashes)
            file_uuid = uuid.UUID(str(file_id))
        except ValueError:
            raise NotFound(f"run {run.pk} has no file {file_id}") from None
        record: RunFile = get_object_or_404(run.files.all(), pk=file_uuid)
        if not record.file.storage.exists(record.file.name):
            raise NotFound(f"the bytes of {record.filename!r} are not in this server's storage: the run worker that"
                           " stored them keeps its files under another OMNIFLOW_DATA_DIR (share its media folder"
                           " with the web server)")
        inline = record.content_type in INLINE_TYPES
        response = FileResponse(record.file.open("rb"), as_attachment=not inline, filename=record.filename,
                                content_type=record.content_type if inline else "application/octet-stream")
        response["Cache-Control"] = "private, max-age=3600"
        return response


def _uuid(raw: str, name: str) -> str:
    try:
        return str(uuid.UUID(raw))
    except ValueError:
        raise BadRequest(f"{name} must be a UUID, not {raw!r}") from None
