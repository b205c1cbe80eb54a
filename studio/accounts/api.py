"""Account endpoints: browser session login/logout and the user's API tokens."""

from __future__ import annotations

from django.contrib.auth import authenticate, get_user, login, logout
from django.middleware.csrf import get_token
from django.utils.decorators import method_decorator
from django.views.decorators.csrf import ensure_csrf_cookie
from drf_spectacular.utils import extend_schema
from rest_framework import generics, serializers, status
from rest_framework.authentication import SessionAuthentication
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from studio.accounts.models import ApiToken
from studio.errors import LoginFailed
from studio.throttles import LoginThrottle, TokenThrottle


class UserSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    username = serializers.CharField()
    is_staff = serializers.BooleanField()


class SessionSerializer(serializers.Serializer):
    user = UserSerializer(allow_null=True)
    csrf_token = serializers.CharField(help_text="send back as X-CSRFToken on session-authenticated writes")


class LoginSerializer(serializers.Serializer):
    username = serializers.CharField()
    password = serializers.CharField(style={"input_type": "password"})


def _session(request: Request) -> dict:
    user = request.user if request.user.is_authenticated else None
    return {
        "user": None if user is None else {"id": user.pk, "username": user.get_username(), "is_staff": user.is_staff},
        "csrf_token": get_token(request),
    }


def _enforce_csrf(request: Request) -> None:
    """Login and logout change the session, so they need the CSRF token too (login CSRF)."""
    SessionAuthentication().enforce_csrf(request)


@method_decorator(ensure_csrf_cookie, name="get")
class SessionView(APIView):
    """The browser's session: who is logged in (and a CSRF token), log in, log out."""

    permission_classes = [AllowAny]
    authentication_classes = []  # this view manages the session itself
    throttle_classes = [LoginThrottle]  # log-ins (POST) only

    @extend_schema(responses=SessionSerializer, summary="Current session user and CSRF token")
    def get(self, request: Request) -> Response:
        # With no authentication classes DRF hands the view an anonymous user; the
        # session itself says who is logged in.
        request.user = get_user(request._request)
        return Response(_session(request))

    @extend_schema(request=LoginSerializer, responses=SessionSerializer, summary="Log in (sets the session cookie)")
    def post(self, request: Request) -> Response:
        _enforce_csrf(request)
        data = LoginSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        user = authenticate(request._request, **data.validated_data)
        if user is None:
            raise LoginFailed()
        login(request._request, user)
        request.user = user
        return Response(_session(request))

    @extend_schema(request=None, responses={204: None}, summary="Log out")
    def delete(self, request: Request) -> Response:
        _enforce_csrf(request)
        logout(request._request)
        return Response(status=status.HTTP_204_NO_CONTENT)


class TokenSerializer(serializers.ModelSerializer):
    class Meta:
        model = ApiToken
        fields = ["id", "name", "prefix", "created_at", "last_used_at"]
        read_only_fields = ["id", "prefix", "created_at", "last_used_at"]


class NewTokenSerializer(TokenSerializer):
    token = serializers.CharField(read_only=True, help_text="shown once; only its hash is stored")

    class Meta(TokenSerializer.Meta):
        fields = [*TokenSerializer.Meta.fields, "token"]


class TokenListView(generics.ListCreateAPIView):
    """The caller's live API tokens; POST issues a new one (its text is in this response only)."""

    serializer_class = TokenSerializer
    pagination_class = None
    throttle_classes = [TokenThrottle]  # issuing (POST) only

    def get_queryset(self):
        return ApiToken.objects.filter(user=self.request.user, revoked=False)

    @extend_schema(request=TokenSerializer, responses={201: NewTokenSerializer})
    def post(self, request: Request, *args, **kwargs) -> Response:
        data = TokenSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        issued = ApiToken.objects.issue(request.user, data.validated_data.get("name", ""))
        body = NewTokenSerializer(issued.token).data
        body["token"] = issued.secret
        return Response(body, status=status.HTTP_201_CREATED)


class TokenDetailView(generics.DestroyAPIView):
    """Revoke one of the caller's tokens."""

    serializer_class = TokenSerializer

    def get_queryset(self):
        return ApiToken.objects.filter(user=self.request.user, revoked=False)

    def perform_destroy(self, instance: ApiToken) -> None:
        instance.revoked = True
        instance.save(update_fields=["revoked"])
