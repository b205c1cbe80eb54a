"""Nodes (distributed mode): `GET /api/nodes/` lists the machines of the node directory, live
and lost, with their resources, labels, free capacity and the workers of your deployments on
each. While a Redis flush or restart has taken nodes from the directory, it also lists those
whose kept lease has not lapsed, as live, from the record of their last heartbeat
(`liveness.kept`), with `"source": "kept-lease"` rather than `"announced"`, until their agents
announce them again. `POST /api/nodes/placement/` says where deploying a version would put its
replicas now (the deploy dialog shows it before you confirm), or every reason it cannot.

Every signed-in user sees the nodes themselves (names, labels, resources); the workers and
deployments on them only where the deployment is theirs (staff: all).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from engine.client.cluster import NodeDirectoryError, NodeRecord
from studio.errors import Unavailable
from studio.workflows.api.deployments import DeploymentCreateSerializer, deploy_request
from studio.workflows.api.serializers import ErrorSerializer
from studio.workflows.api.workflows import ERRORS
from studio.workflows.apps import engine
from studio.workflows.deployments import liveness, placing, service
from studio.workflows.deployments.records import LIVE_WORKER_STATUSES
from studio.workflows.models import ACTIVE_DEPLOYMENT_STATUSES, Deployment, Worker


def node_json(record: NodeRecord, live: bool, workers: list[dict[str, Any]],
              hosting_names: Mapping[str, str], *, announced: bool = True) -> dict[str, Any]:
    """A node as `/api/nodes/` shows it; `announced` False: the node directory has forgotten it and
    `record` is its last heartbeat's, kept in the database, whose lease has not lapsed."""
    return {
        "name": record.name,
        "status": "live" if live else "lost",
        "address": record.address,
        "labels": dict(record.labels),
        "total": record.total.to_dict(),
        "free": record.free.to_dict(),
        "gpus": [{"index": g.index, "model": g.model, "memory_gb": g.memory_gb} for g in record.gpus],
        "hosting": [{"deployment": d, "name": hosting_names.get(d, ""), "replicas": roles}
                    for d, roles in sorted(record.hosting.items()) if d in hosting_names],
        "seen_at": record.seen_at,
        "started_at": record.started_at,
        "ttl_s": record.ttl_s,
        "workers": workers,
        "source": "announced" if announced else "kept-lease",
    }


class NodesView(APIView):
    @extend_schema(summary="The nodes of the cluster, live and lost, with your workers on each",
                   responses={200: OpenApiTypes.OBJECT, 503: ErrorSerializer, **ERRORS})
    def get(self, request: Request) -> Response:
        config = engine().config
        if config.redis_url is None:
            return Response([])  # the embedded studio hosts its workers itself: no nodes
        directory = placing.directory(config)
        try:
            states = directory.known()
        except NodeDirectoryError as exc:
            raise Unavailable(f"the node directory cannot be read: {exc}") from None
        finally:
            directory.close()
        visible = dict(Deployment.objects.visible_to(request.user).filter(status__in=ACTIVE_DEPLOYMENT_STATUSES)
                       .values_list("pk", "name"))
        names = {str(pk): name for pk, name in visible.items()}
        workers: dict[str, list[dict[str, Any]]] = {}
        for row in (Worker.objects.filter(deployment_id__in=list(visible), status__in=LIVE_WORKER_STATUSES)
                    .order_by("role", "worker_id")):
            workers.setdefault(row.host, []).append({
                "worker_id": row.worker_id, "role": row.role, "deployment": str(row.deployment_id),
                "status": row.status, "address": row.address, "pid": row.pid, "device": row.device,
                "gpus": list(row.gpus)})
        listed = [node_json(s.record, s.live, workers.get(s.record.name, []), names) for s in states]
        kept = liveness.kept({s.record.name for s in states})
        listed += [node_json(r, True, workers.get(r.name, []), names, announced=False) for r in kept]
        return Response(sorted(listed, key=lambda n: n["name"]))


class PlacementPreviewView(APIView):
    @extend_schema(summary="Where deploying a version would place its replicas now",
                   request=DeploymentCreateSerializer,
                   responses={200: OpenApiTypes.OBJECT, 409: ErrorSerializer, 422: ErrorSerializer,
                              503: ErrorSerializer, **ERRORS})
    def post(self, request: Request) -> Response:
        attrs, version = deploy_request(request)
        return Response(service.preview_placement(request.user, version, replicas=attrs.get("replicas"),
                                                  node=attrs.get("node")))
