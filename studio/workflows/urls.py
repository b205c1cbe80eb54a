from __future__ import annotations

from django.urls import path
from rest_framework.routers import SimpleRouter

from studio.workflows.api import catalogue, chat_templates, deployments, metrics, nodes, runs, workflows
from studio.workflows.chat import views as chat

router = SimpleRouter()
router.register("workflows", workflows.WorkflowViewSet, basename="workflow")
router.register("runs", runs.RunViewSet, basename="run")
router.register("deployments", deployments.DeploymentViewSet, basename="deployment")
router.register("sessions", deployments.SessionViewSet, basename="session")

urlpatterns = [
    path("workflows/<uuid:workflow_id>/versions/", workflows.VersionListView.as_view(), name="version-list"),
    path("workflows/<uuid:workflow_id>/versions/<int:number>/", workflows.VersionDetailView.as_view(),
         name="version-detail"),
    path("workflows/<uuid:workflow_id>/versions/<int:number>/diff/", workflows.VersionDiffView.as_view(),
         name="version-diff"),
    path("validate/", workflows.ValidateView.as_view(), name="validate"),
    path("node-kinds/", catalogue.NodeKindsView.as_view(), name="node-kinds"),
    path("role-kinds/", catalogue.RoleKindsView.as_view(), name="role-kinds"),
    path("ops/", catalogue.OpsView.as_view(), name="ops"),
    path("models/", catalogue.ModelsView.as_view(), name="models"),
    # A checkpoint is named as a role names it, slashes and all (`org/model`): `<path:>` takes them.
    path("models/<path:model>/chat-template/", chat_templates.ChatTemplateView.as_view(), name="model-chat-template"),
    path("graphspec/schema/", catalogue.GraphSpecSchemaView.as_view(), name="graphspec-schema"),
    path("workers/", deployments.WorkersView.as_view(), name="worker-list"),
    path("metrics/history/", metrics.MetricsHistoryView.as_view(), name="metrics-history"),
    path("nodes/", nodes.NodesView.as_view(), name="node-list"),
    path("nodes/placement/", nodes.PlacementPreviewView.as_view(), name="node-placement"),
    path("sessions/<uuid:pk>/turns/", chat.session_turns, name="session-turns"),
    *router.urls,
]
