from __future__ import annotations

from django.urls import path

from studio.workflows.consumers import RunEventsConsumer, WorkerMetricsConsumer

websocket_urlpatterns = [
    path("ws/runs/<str:run_id>/", RunEventsConsumer.as_asgi()),
    path("ws/metrics/", WorkerMetricsConsumer.as_asgi()),
]
