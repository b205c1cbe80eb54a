"""URL map.

    /api/...            REST API (see studio.workflows.urls and studio.accounts.urls)
    /api/schema/        OpenAPI 3 document; /api/docs/ Swagger UI; /api/redoc/ ReDoc
    /ws/runs/<id>/      run events (WebSocket; see studio.workflows.routing)
    /ws/metrics/        workers' metrics, every second (WebSocket)
    /v1/models, /v1/chat/completions   OpenAI-compatible chat on chat deployments
    /metrics, /healthz  Prometheus metrics, health
    /admin/             Django admin
    /assets/..., /*     the studio frontend (studio.spa): built bundles, and index.html for any other page
"""

from __future__ import annotations

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from studio import health
from studio.workflows.chat import views as chat

handler400 = "studio.errors.handler400"
handler403 = "studio.errors.handler403"
handler404 = "studio.errors.handler404"
handler500 = "studio.errors.handler500"

urlpatterns = [
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/redoc/", SpectacularRedocView.as_view(url_name="schema"), name="api-redoc"),
    path("api/", include("studio.accounts.urls")),
    path("api/", include("studio.workflows.urls")),
    path("v1/models", chat.models, name="openai-models"),
    path("v1/chat/completions", chat.chat_completions, name="openai-chat-completions"),
    path("healthz", health.healthz, name="healthz"),
    path("metrics", health.metrics, name="metrics"),
    path("admin/", admin.site.urls),
    path("", include("studio.spa.urls")),  # last: it takes every path the others leave
]
