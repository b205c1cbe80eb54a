from __future__ import annotations

from django.urls import path

from studio.accounts import api

urlpatterns = [
    path("auth/session/", api.SessionView.as_view(), name="auth-session"),
    path("tokens/", api.TokenListView.as_view(), name="token-list"),
    path("tokens/<int:pk>/", api.TokenDetailView.as_view(), name="token-detail"),
]
