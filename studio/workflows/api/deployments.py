"""Deployments (create from a version, scale a role, stop; status with workers), the
workers of the registry with their latest metrics, and chat sessions (create, history,
close; a turn is sent through `studio.workflows.chat.views`).

The shapes are those `frontend/src/api/cluster.ts` is built against: a deployment has
`id, workflow, version (number), name, status, replicas, cache_scope, error, created_at`; a worker is
a registry `WorkerSnapshot` with `status` and `deployment`.
"""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from django.shortcuts import get_object_or_404
from django.urls import reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from studio.errors import BadRequest, Conflict
from studio.workflows.api.serializers import ErrorSerializer
from studio.workflows.api.workflows import ERRORS, get_workflow, statuses_param
from studio.workflows.apps import engine
from studio.workflows.chat.shape import is_chat
from studio.workflows.deployments import liveness, service
from studio.workflows.deployments.workers import (
    active_deployments,
    deployment_names,
    listing,
    recorded_statuses,
    replica_seats,
    snapshots_sync,
)
from studio.workflows.models import (
    MAX_DEPLOYMENT_NAME,
    CacheScope,
    Deployment,
    DeploymentStatus,
    Session,
    Worker,
    WorkflowVersion,
)
from studio.workflows.paths import PathRoots, without_roots

MAX_NAME = MAX_DEPLOYMENT_NAME


# ----------------------------------------------------------------------- serializers
class DeploymentCreateSerializer(serializers.Serializer):
    workflow = serializers.UUIDField()
    version = serializers.IntegerField(required=False, min_value=1, help_text="defaults to the latest")
    replicas = serializers.DictField(child=serializers.JSONField(), required=False,
                                     help_text="role name -> replica count (default: the spec's)")
    name = serializers.CharField(required=False, allow_blank=True, max_length=MAX_NAME, default="",
                                 help_text="the OpenAI model id of a chat deployment; default: the workflow's name"
                                           " (numbered -2, -3 ... past the names of your live deployments)")
    node = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$", required=False,
                                  help_text="distributed mode: the node whose Celery worker starts the workers")
    cache_scope = serializers.ChoiceField(choices=CacheScope.choices, default=CacheScope.USER,
                                          help_text="user: each user's runs keep their own caches; shared (staff"
                                                    " only): every user's runs of it share one")



class ProposedNameSerializer(serializers.Serializer):
    name = serializers.CharField(help_text="the workflow's name, numbered -2, -3 ... past your live deployments'")


def deploy_request(request: Request) -> tuple[dict[str, Any], WorkflowVersion]:
    """A deploy request's fields and the version it names (the workflow's latest when it names
    none; 404 when the caller cannot see it, Conflict when the workflow has no saved version)."""
    body = DeploymentCreateSerializer(data=request.data)
    body.is_valid(raise_exception=True)
    attrs = body.validated_data
    workflow = get_workflow(request, attrs["workflow"])
    versions = workflow.versions.all()
    if "version" in attrs:
        return attrs, get_object_or_404(versions, number=attrs["version"])
    version = versions.order_by("-number").first()
    if version is None:
        raise Conflict(f"workflow {workflow.name!r} has no saved version to deploy")
    return attrs, version

class CacheScopeSerializer(serializers.Serializer):
    cache_scope = serializers.ChoiceField(choices=CacheScope.choices)


class ScaleSerializer(serializers.Serializer):
    role = serializers.CharField()
    replicas = serializers.JSONField(help_text="the new replica count of the role")


def error_as_read(error: str) -> str:
    """A deployment's or worker's error as its user reads it: without this server's roots or those
    the nodes announced (their processes report it; `without_roots`)."""
    if not error:
        return error
    return without_roots(error, PathRoots.of(engine().config).with_hidden(liveness.model_roots()))


class WorkerRowSerializer(serializers.ModelSerializer):
    """A `Worker` row as the deployment's detail shows it (its fields as the model types them)."""

    error = serializers.SerializerMethodField(help_text="failed: why it did not come up")

    class Meta:
        model = Worker
        fields = ["worker_id", "role", "host", "address", "device", "gpus", "pid", "status", "error", "started_at",
                  "last_seen_at"]
        read_only_fields = fields

    def get_error(self, obj: Any) -> str:
        return error_as_read(obj.error)


class DeploymentSerializer(serializers.ModelSerializer):
    workflow = serializers.UUIDField(source="version.workflow_id", read_only=True)
    workflow_name = serializers.CharField(source="version.workflow.name", read_only=True)
    version = serializers.IntegerField(source="version.number", read_only=True)
    roles = serializers.SerializerMethodField()
    inputs = serializers.SerializerMethodField()
    chat = serializers.SerializerMethodField()
    links = serializers.SerializerMethodField()
    error = serializers.SerializerMethodField(help_text="failed or unplaced: why")

    class Meta:
        model = Deployment
        fields = ["id", "workflow", "workflow_name", "version", "name", "status", "replicas", "error", "node",
                  "placement", "namespace", "cache_scope", "roles", "inputs", "chat", "created_at", "updated_at",
                  "links"]
        read_only_fields = fields

    def get_error(self, obj: Deployment) -> str:
        return error_as_read(obj.error)

    def get_roles(self, obj: Deployment) -> list[dict[str, Any]]:
        return [{"name": r["name"], "kind": r["kind"], "model": r.get("model"), "device": r.get("device", "cpu")}
                for r in obj.version.spec.get("roles", [])]

    def get_inputs(self, obj: Deployment) -> list[dict[str, Any]]:
        """The workflow's inputs (what a run of it names): name, port type, and default where it has one."""
        return [{"name": n["id"], "type": n.get("outputs", {}).get("value", {}).get("type", "any"),
                 **({"default": n["params"]["default"]} if "default" in n.get("params", {}) else {})}
                for n in obj.version.spec.get("nodes", []) if n.get("kind") == "input"]

    def get_chat(self, obj: Deployment) -> bool:
        """Whether `/v1/chat/completions` serves it (its spec is a chat workflow)."""
        return is_chat(obj.version.spec)

    def get_links(self, obj: Deployment) -> dict[str, str]:
        return {"self": reverse("deployment-detail", kwargs={"pk": obj.pk}),
                "stop": reverse("deployment-stop", kwargs={"pk": obj.pk}),
                "scale": reverse("deployment-scale", kwargs={"pk": obj.pk}),
                "cache_scope": reverse("deployment-cache-scope", kwargs={"pk": obj.pk})}


class DeploymentDetailSerializer(DeploymentSerializer):
    workers = serializers.SerializerMethodField()
    join = serializers.SerializerMethodField()
    join_keys = serializers.SerializerMethodField()

    class Meta(DeploymentSerializer.Meta):
        fields = [*DeploymentSerializer.Meta.fields, "workers", "join", "join_keys"]
        read_only_fields = fields

    def get_workers(self, obj: Deployment) -> list[dict[str, Any]]:
        """Worker rows (those this studio started), each with its replica number among its role's
        live ones and its tensor-parallel rank (`replica_seats`), and its live registry snapshot (or null)."""
        live = {s.worker_id: s for s in self.context.get("live", [])}
        records = list(obj.workers.all())
        seats = replica_seats(records)
        rows = []
        for row in records:
            body = dict(WorkerRowSerializer(row).data)
            body["replica"], body["rank"] = seats[row.worker_id].replica, seats[row.worker_id].rank
            snap = live.pop(row.worker_id, None)
            body["live"] = None if snap is None else snap.to_dict()
            rows.append(body)
        for snap in live.values():  # joined by hand (omniflow worker --namespace ...)
            rows.append({"worker_id": snap.worker_id, "role": snap.role, "host": snap.info.host,
                         "address": snap.info.address, "device": snap.info.device, "gpus": [], "pid": snap.info.pid,
                         "status": "joined", "error": "", "started_at": None, "last_seen_at": None, "replica": None,
                         "rank": 0,
                         "live": snap.to_dict()})
        return rows

    def get_join(self, obj: Deployment) -> str:
        """How a worker on another machine joins this deployment (the same Redis): with the
        deployment's plane keys (`join_keys`; a worker without `--keys` does not start, one with other
        keys is refused by every peer), bound to that machine's own address (never every interface),
        and refusing `module:function` ops unless this studio allows them, as the workers it starts do."""
        ops = "--module-ops" if engine().config.allow_module_ops else "--no-module-ops"
        return (f"omniflow worker --workflow <the workflow file> --role <ROLE> --registry <REDIS_URL>"
                f" --namespace {obj.namespace} --keys <DIR> --listen tcp://<this machine's private address>:0 {ops}")

    def get_join_keys(self, obj: Deployment) -> str:
        """Where `join`'s `--keys <DIR>` comes from: run on the studio's host (it reads the database),
        then copy DIR to the joining machine, readable by the worker's user only."""
        return f"python manage.py deployment_keys {obj.pk} <DIR>"


class ChatSessionSerializer(serializers.ModelSerializer):
    deployment = serializers.UUIDField(source="deployment_id", read_only=True)
    turns = serializers.SerializerMethodField()
    links = serializers.SerializerMethodField()

    class Meta:
        model = Session
        fields = ["id", "deployment", "title", "messages", "turns", "closed", "created_at", "updated_at", "links"]
        read_only_fields = fields

    def get_turns(self, obj: Session) -> int:
        return sum(1 for m in obj.messages if m.get("role") == "assistant")

    def get_links(self, obj: Session) -> dict[str, str]:
        return {"self": reverse("session-detail", kwargs={"pk": obj.pk}),
                "turns": reverse("session-turns", kwargs={"pk": obj.pk}),
                "close": reverse("session-close", kwargs={"pk": obj.pk})}


class ChatSessionCreateSerializer(serializers.Serializer):
    deployment = serializers.UUIDField()
    title = serializers.CharField(required=False, allow_blank=True, max_length=200, default="")
    system = serializers.CharField(required=False, allow_blank=True, trim_whitespace=False, max_length=20000,
                                   help_text="system prompt: the first message of the history")


# ----------------------------------------------------------------------- deployments
def visible_deployments(request: Request) -> QuerySet[Deployment]:
    return Deployment.objects.visible_to(request.user).select_related("version", "version__workflow")


@extend_schema_view(
    list=extend_schema(summary="List deployments",
                       parameters=[OpenApiParameter("workflow", OpenApiTypes.UUID),
                                   OpenApiParameter("status", str, description="comma-separated statuses")],
                       responses={200: DeploymentSerializer(many=True), **ERRORS}),
    retrieve=extend_schema(summary="A deployment's status with its workers",
                           responses={200: DeploymentDetailSerializer, **ERRORS}),
)
class DeploymentViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    def get_serializer_class(self) -> type:
        return DeploymentSerializer if self.action == "list" else DeploymentDetailSerializer

    def get_queryset(self) -> QuerySet[Deployment]:
        qs = visible_deployments(self.request)
        params = self.request.query_params
        if self.action == "list":
            if params.get("workflow"):
                try:
                    qs = qs.filter(version__workflow_id=serializers.UUIDField().to_internal_value(params["workflow"]))
                except serializers.ValidationError:
                    raise BadRequest(f"workflow must be a UUID, not {params['workflow']!r}") from None
            if params.get("status"):
                qs = qs.filter(status__in=statuses_param(params["status"], DeploymentStatus.values))
        else:
            qs = qs.prefetch_related("workers")
        return qs

    def get_serializer_context(self) -> dict[str, Any]:
        context = super().get_serializer_context()
        if self.action != "list" and self.kwargs.get("pk"):
            deployment = self.get_queryset().filter(pk=self.kwargs["pk"]).first()
            if deployment is not None and deployment.active:
                live = snapshots_sync(engine(), {str(deployment.pk): deployment.namespace})
                context["live"] = live.get(str(deployment.pk), [])
        return context

    def _detail(self, deployment: Deployment, code: int = status.HTTP_200_OK) -> Response:
        self.kwargs["pk"] = str(deployment.pk)
        obj = self.get_queryset().prefetch_related("workers").get(pk=deployment.pk)
        return Response(DeploymentDetailSerializer(obj, context=self.get_serializer_context()).data, status=code)

    @extend_schema(summary="Deploy a version onto role workers", request=DeploymentCreateSerializer,
                   responses={201: DeploymentDetailSerializer, 409: ErrorSerializer, 422: ErrorSerializer, **ERRORS})
    def create(self, request: Request) -> Response:
        attrs, version = deploy_request(request)
        deployment = service.create_deployment(request.user, version, replicas=attrs.get("replicas"),
                                               name=attrs["name"], node=attrs.get("node"),
                                               cache_scope=CacheScope(attrs["cache_scope"]))
        response = self._detail(deployment, status.HTTP_201_CREATED)
        response["Location"] = response.data["links"]["self"]
        return response

    @extend_schema(summary="The name a deployment of the workflow left unnamed would take now",
                   parameters=[OpenApiParameter("workflow", OpenApiTypes.UUID, required=True)],
                   responses={200: ProposedNameSerializer, **ERRORS})
    @action(detail=False, methods=["get"], url_path="proposed-name", url_name="proposed-name")
    def proposed_name(self, request: Request) -> Response:
        try:
            workflow_id = serializers.UUIDField().to_internal_value(request.query_params.get("workflow", ""))
        except serializers.ValidationError:
            raise BadRequest(f"workflow must be a UUID, not {request.query_params.get('workflow', '')!r}") from None
        workflow = get_workflow(request, workflow_id)
        return Response({"name": service.proposed_name(request.user, workflow.name)})

    @extend_schema(summary="Stop a deployment's workers", request=None,
                   responses={200: DeploymentDetailSerializer, **ERRORS})
    @action(detail=True, methods=["post"])
    def stop(self, request: Request, pk: Any = None) -> Response:
        return self._detail(service.stop_deployment(self.get_object()))

    @extend_schema(summary="Set the replica count of one role", request=ScaleSerializer,
                   responses={200: DeploymentDetailSerializer, 409: ErrorSerializer, **ERRORS})
    @action(detail=True, methods=["post"])
    def scale(self, request: Request, pk: Any = None) -> Response:
        deployment = self.get_object()
        body = ScaleSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        return self._detail(service.scale_deployment(deployment, body.validated_data["role"],
                                                     body.validated_data["replicas"]))


    @extend_schema(summary="Set whose runs share the deployment's caches (shared: staff only)",
                   request=CacheScopeSerializer, responses={200: DeploymentDetailSerializer, 403: ErrorSerializer,
                                                            **ERRORS})
    @action(detail=True, methods=["post"], url_path="cache-scope", url_name="cache-scope")
    def cache_scope(self, request: Request, pk: Any = None) -> Response:
        deployment = self.get_object()
        body = CacheScopeSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        return self._detail(service.set_cache_scope(request.user, deployment,
                                                    CacheScope(body.validated_data["cache_scope"])))

# ---------------------------------------------------------------------------- workers
class WorkersView(APIView):
    @extend_schema(
        summary="Live workers of your deployments, with their latest metrics",
        parameters=[OpenApiParameter("deployment", OpenApiTypes.UUID), OpenApiParameter("role", str)],
        responses={200: OpenApiTypes.OBJECT, **ERRORS},
    )
    def get(self, request: Request) -> Response:
        qs = Deployment.objects.visible_to(request.user)
        if request.query_params.get("deployment"):
            try:
                qs = qs.filter(pk=serializers.UUIDField().to_internal_value(request.query_params["deployment"]))
            except serializers.ValidationError:
                raise BadRequest(f"deployment must be a UUID, not {request.query_params['deployment']!r}") from None
        namespaces = active_deployments(qs)
        live = snapshots_sync(engine(), namespaces)
        recorded = recorded_statuses(list(namespaces))
        return Response(listing(live, recorded, deployment_names(list(namespaces)),
                                role=request.query_params.get("role") or None).workers)


# --------------------------------------------------------------------------- sessions
@extend_schema_view(
    list=extend_schema(summary="Your chat sessions", responses={200: ChatSessionSerializer(many=True), **ERRORS}),
    retrieve=extend_schema(summary="A chat session with its history", responses={200: ChatSessionSerializer, **ERRORS}),
)
class SessionViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = ChatSessionSerializer

    def get_queryset(self) -> QuerySet[Session]:
        qs = Session.objects.visible_to(self.request.user)
        deployment = self.request.query_params.get("deployment")
        if self.action == "list" and deployment:
            try:
                qs = qs.filter(deployment_id=serializers.UUIDField().to_internal_value(deployment))
            except serializers.ValidationError:
                raise BadRequest(f"deployment must be a UUID, not {deployment!r}") from None
        return qs

    @extend_schema(summary="Open a chat session on a chat deployment", request=ChatSessionCreateSerializer,
                   responses={201: ChatSessionSerializer, 409: ErrorSerializer, 422: ErrorSerializer, **ERRORS})
    def create(self, request: Request) -> Response:
        body = ChatSessionCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        attrs = body.validated_data
        deployment = get_object_or_404(visible_deployments(request), pk=attrs["deployment"])
        from studio.workflows.chat.turns import open_session

        session = open_session(request.user, deployment, title=attrs["title"], system=attrs.get("system") or "")
        data = ChatSessionSerializer(session).data
        return Response(data, status=status.HTTP_201_CREATED, headers={"Location": data["links"]["self"]})

    @extend_schema(summary="Close a chat session (no further turns)", request=None,
                   responses={200: ChatSessionSerializer, **ERRORS})
    @action(detail=True, methods=["post"])
    def close(self, request: Request, pk: Any = None) -> Response:
        session = self.get_object()
        if not session.closed:
            session.closed = True
            session.save(update_fields=["closed", "updated_at"])
        return Response(ChatSessionSerializer(session).data)
