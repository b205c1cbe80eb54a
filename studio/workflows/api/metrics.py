"""`GET /api/metrics/history/?range=5m|1h&deployment=<uuid>&worker=<id>`: the metrics history of
the workers of your deployments (staff: all), the body `studio.workflows.history.query` documents.
A bad `range` or `deployment` is a 400 naming it, a deployment you cannot see a 404, a history
that cannot be read (Redis) a 503."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from studio.errors import BadRequest, Unavailable
from studio.workflows.api.serializers import ErrorSerializer
from studio.workflows.api.workflows import ERRORS
from studio.workflows.apps import engine
from studio.workflows.history.query import RangeError, history, parse_range
from studio.workflows.history.store import HistoryUnavailable
from studio.workflows.models import Deployment


class MetricsHistoryView(APIView):
    @extend_schema(
        summary="Your workers' metrics over a time range (KV tiers, GPU and process memory, tokens)",
        parameters=[OpenApiParameter("range", str, description="5m (default), 1h, or <n>s|m|h up to the history kept"),
                    OpenApiParameter("deployment", OpenApiTypes.UUID), OpenApiParameter("worker", str)],
        responses={200: OpenApiTypes.OBJECT, 503: ErrorSerializer, **ERRORS},
    )
    def get(self, request: Request) -> Response:
        studio = engine()
        try:
            range_text, range_s = parse_range(request.query_params.get("range"), studio.config.metrics_history_s)
        except RangeError as exc:
            raise BadRequest(str(exc)) from None
        deployment = request.query_params.get("deployment") or None
        if deployment is not None:
            try:
                deployment = str(serializers.UUIDField().to_internal_value(deployment))
            except serializers.ValidationError:
                raise BadRequest(f"deployment must be a UUID, not {deployment!r}") from None
            if not Deployment.objects.visible_to(request.user).filter(pk=deployment).exists():
                raise NotFound(f"no deployment {deployment}")
        try:
            body = history(studio.history.store, request.user, range_text=range_text, range_s=range_s,
                           worker=request.query_params.get("worker") or None, deployment=deployment)
        except HistoryUnavailable as exc:
            raise Unavailable(str(exc)) from None
        return Response(body)
