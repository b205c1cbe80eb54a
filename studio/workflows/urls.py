from __future__ import annotations

from django.urls import path
from rest_framework.routers import SimpleRouter

from studio.workflows.api import catalogue, runs, workflows

router = SimpleRouter()
router.register("workflows", workflows.WorkflowViewSet, basename="workflow")
router.register("runs", runs.RunViewSet, basename="run")

urlpatterns = [
    path("workflows/<uuid:workflow_id>/versions/", workflows.VersionListView.as_view(), name="version-list"),
    path("workflows/<uuid:workflow_id>/versions/<int:number>/", workflows.VersionDetailView.as_view(),
         name="version-detail"),
    path("workflows/<uuid:workflow_id>/versions/<int:number>/diff/", workflows.VersionDiffView.as_view(),
         name="version-diff"),
    path("validate/", workflows.ValidateView.as_view(), name="validate"),
    path("node-kinds/", catalogue.NodeKindsView.as_view(), name="node-kinds"),
    path("role-kinds/", catalogue.RoleKindsView.as_view(), name="role-kinds"),
    path("graphspec/schema/", catalogue.GraphSpecSchemaView.as_view(), name="graphspec-schema"),
    *router.urls,
]
