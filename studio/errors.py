"""Errors, mapped once to HTTP: every error response is `{"error": ..., "details": [...]}`.

API code raises `ApiError` subclasses (or DRF's exceptions); `api_exception_handler`
renders them. Django-level failures (unknown URL, CSRF, oversized bodies refused before
a view runs, server errors) go through the handlers below so they look the same.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig
from django.core.files.uploadhandler import FileUploadHandler
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from engine.spec.jsonpath import element, member

log = logging.getLogger(__name__)


def error_body(message: str, details: list[Any] | None = None) -> dict[str, Any]:
    return {"error": message, "details": details or []}


class ApiError(exceptions.APIException):
    """An API error with a message and a list of details (each a string or an object)."""

    status_code = status.HTTP_400_BAD_REQUEST
    default_detail = "bad request"

    def __init__(self, message: str | None = None, details: list[Any] | None = None) -> None:
        super().__init__(message or self.default_detail)
        self.message = message or str(self.default_detail)
        self.details = details or []


class BadRequest(ApiError):
    status_code = status.HTTP_400_BAD_REQUEST


class Forbidden(ApiError):
    status_code = status.HTTP_403_FORBIDDEN
    default_detail = "forbidden"


class LoginFailed(ApiError):
    status_code = status.HTTP_401_UNAUTHORIZED
    default_detail = "invalid username or password"


class NotFound(ApiError):
    """No such object; `details` may name the field (or URL part) that names it."""

    status_code = status.HTTP_404_NOT_FOUND
    default_detail = "not found"


class Conflict(ApiError):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "conflict"


class PayloadTooLarge(ApiError):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "request body too large"


class Unprocessable(ApiError):
    status_code = status.HTTP_422_UNPROCESSABLE_ENTITY
    default_detail = "the request is well-formed but cannot be carried out"


class Unavailable(ApiError):
    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_detail = "a service the request needs cannot be reached; try again"


def too_large_message(limit: int) -> str:
    return f"request body exceeds the upload limit of {limit} bytes (OMNIFLOW_MAX_UPLOAD_BYTES)"


def _flatten(detail: Any, field: str | None = None) -> list[dict[str, Any]]:
    """DRF's nested validation errors as a flat list of `{"field", "message"}`."""
    if isinstance(detail, dict):
        out = []
        for key, value in detail.items():
            # A list serializer's errors come keyed by the index of each bad item; DRF's
            # `non_field_errors` (of the body, or of a nested object or item) are the holder's own.
            name = element(field, key) if isinstance(key, int) else member(field, str(key))
            out.extend(_flatten(value, field if key == "non_field_errors" else name))
        return out
    if isinstance(detail, list):
        if all(isinstance(item, str) for item in detail):
            return [{"field": field, "message": str(item)} if field else {"message": str(item)} for item in detail]
        out = []
        for index, item in enumerate(detail):
            out.extend(_flatten(item, element(field, index)))
        return out
    return [{"field": field, "message": str(detail)} if field else {"message": str(detail)}]


def api_exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's EXCEPTION_HANDLER: the one place API errors become responses."""
    if isinstance(exc, RequestDataTooBig):
        exc = PayloadTooLarge(too_large_message(settings.OMNIFLOW.max_upload_bytes))
    elif isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is None:
        return None  # an unexpected exception: Django logs it and answers 500 (handler500)
    if isinstance(exc, ApiError):
        body = error_body(exc.message, exc.details)
    elif isinstance(exc, exceptions.ValidationError):
        body = error_body("invalid request", _flatten(exc.detail))
    elif isinstance(exc, exceptions.ParseError):
        body = error_body(str(exc.detail))
    else:
        detail = exc.detail if isinstance(exc, exceptions.APIException) else str(exc)
        body = error_body(str(detail) if not isinstance(detail, list | dict) else "error", _flatten(detail)
                          if isinstance(detail, list | dict) else [])
    response.data = body
    return response


# ---------------------------------------------------------------- Django-level handlers
def handler400(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    return JsonResponse(error_body("bad request"), status=400)


def handler403(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    return JsonResponse(error_body("forbidden"), status=403)


def handler404(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    return JsonResponse(error_body(f"not found: {request.path}"), status=404)


def handler500(request: HttpRequest) -> HttpResponse:
    return JsonResponse(error_body("internal server error"), status=500)


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    return JsonResponse(error_body("CSRF verification failed", [reason] if reason else []), status=403)


class UploadLimitMiddleware:
    """Refuse a body whose declared length passes OMNIFLOW_MAX_UPLOAD_BYTES with 413,
    before anything reads it. Bodies without a length are cut off by
    `LimitedUploadHandler` (files) and DATA_UPLOAD_MAX_MEMORY_SIZE (the rest)."""

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        limit = settings.OMNIFLOW.max_upload_bytes
        raw = request.META.get("CONTENT_LENGTH") or "0"
        try:
            length = int(raw)
        except ValueError:
            return JsonResponse(error_body(f"invalid Content-Length {raw!r}"), status=400)
        if length > limit:
            return JsonResponse(error_body(too_large_message(limit)), status=413)
        return self.get_response(request)


class NulQueryMiddleware:
    """Refuse with 400 a query string holding a NUL character (`%00`) in a parameter's name or
    value, before a view compares it with a column: PostgreSQL stores no NUL in text, and none
    of the API's parameters means one. (JSON bodies are checked as they are read:
    `studio.jsonbody`; form fields by their serializers.)"""

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        for name, values in request.GET.lists():
            if "\x00" in name or any("\x00" in value for value in values):
                return JsonResponse(error_body(f"query parameter {name!r} holds a NUL character"), status=400)
        return self.get_response(request)


class LimitedUploadHandler(FileUploadHandler):
    """Stops a multipart upload once its bytes pass the limit (for bodies sent without
    Content-Length); the view answers 413."""

    def __init__(self, request: HttpRequest | None = None) -> None:
        super().__init__(request)
        self._received = 0

    def receive_data_chunk(self, raw_data: bytes, start: int) -> bytes:
        self._received += len(raw_data)
        limit = settings.OMNIFLOW.max_upload_bytes
        if self._received > limit:
            raise PayloadTooLarge(too_large_message(limit))
        return raw_data

    def file_complete(self, file_size: int) -> None:
        return None
