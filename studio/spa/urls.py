from __future__ import annotations

from django.urls import re_path

from studio.spa import views

# Everything the other apps do not own is a page of the single-page app. The API,
# WebSocket, admin and monitoring prefixes are excluded, so their unknown paths still
# answer the API's JSON 404 instead of the app.
urlpatterns = [
    re_path(r"^assets/(?P<path>.+)$", views.asset, name="spa-asset"),
    re_path(r"^(?!api/|ws/|v1/|admin/|static/|metrics$|healthz$)(?P<path>.*)$", views.index, name="spa"),
]
