"""Async HTTP views of chat: `/v1/models`, `/v1/chat/completions` (JSON or SSE) and a
session's turns (`POST /api/sessions/<id>/turns/`).

They are plain async Django views, not DRF's (which runs views synchronously): a turn
waits for its run, and a synchronous view would hold the one thread Django's ASGI handler
runs synchronous views on. Authentication is the API's: `Authorization: Bearer <token>`
(the only way on `/v1/`, as OpenAI clients send it), or the browser session with its CSRF
token on the session endpoints.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.middleware.csrf import CsrfViewMiddleware
from django.views.decorators.csrf import csrf_exempt

from studio.accounts.auth import bearer_token, user_for_token
from studio.dbcalls import orm
from studio.errors import ApiError, error_body
from studio.jsonbody import JsonRefused, load_json
from studio.throttles import run_throttle_wait
from studio.workflows.api.deployments import ChatSessionSerializer
from studio.workflows.apps import engine
from studio.workflows.chat import turns
from studio.workflows.chat.openai import (
    ChatSampling,
    OpenAIError,
    chunk,
    completion,
    model_entry,
    parse_chat_request,
    parse_messages,
)
from studio.workflows.chat.shape import NotAChatWorkflow
from studio.workflows.models import DeploymentStatus, Session
from studio.workflows.weights import model_weights

log = logging.getLogger(__name__)

_STARTING_POLL_S = 0.1
_STARTING_POLL_MAX_S = 1.0

View = Callable[..., Awaitable[HttpResponse]]


class _Unauthorized(Exception):
    pass


async def _user(request: HttpRequest, *, allow_session: bool) -> Any:
    header = request.headers.get("Authorization")
    if header and header.lower().startswith("bearer"):
        secret = bearer_token(header)
        user = None if secret is None else await orm(user_for_token)(secret)
        if user is None:
            raise _Unauthorized("invalid or revoked API token")
        return user
    if allow_session:
        user = await request.auser()
        if user.is_authenticated:
            rejected = CsrfViewMiddleware(lambda r: HttpResponse()).process_view(request, None, (), {})
            if rejected is not None:
                raise PermissionError("CSRF verification failed")
            return user
    raise _Unauthorized("authentication required: send 'Authorization: Bearer <token>'")


def _json_body(request: HttpRequest) -> Any:
    if request.content_type != "application/json":
        raise ValueError("send a JSON body (Content-Type: application/json)")
    config = engine().config
    try:
        return load_json(request.body or b"null", max_depth=config.max_json_depth, max_bytes=config.max_upload_bytes)
    except JsonRefused as exc:
        raise ValueError(exc.message) from None


def _openai_error(exc: OpenAIError) -> JsonResponse:
    return JsonResponse(exc.body(), status=exc.status)


def _from_api_error(exc: ApiError) -> OpenAIError:
    details = "; ".join(d.get("message", str(d)) if isinstance(d, dict) else str(d) for d in exc.details)
    message = f"{exc.message}: {details}" if details else exc.message
    return OpenAIError(exc.status_code, message, type="invalid_request_error" if exc.status_code < 500 else
                       "server_error")


def openai_view(method: str) -> Callable[[View], View]:
    """Bearer auth, method check and OpenAI-shaped errors around a `/v1/` view."""

    def wrap(view: View) -> View:
        @csrf_exempt
        async def handler(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            try:
                if request.method != method:
                    raise OpenAIError(405, f"use {method}", type="invalid_request_error")
                try:
                    user = await _user(request, allow_session=False)
                except _Unauthorized as exc:
                    raise OpenAIError(401, str(exc), type="authentication_error", code="invalid_api_key") from None
                return await view(request, user, *args, **kwargs)
            except OpenAIError as exc:
                return _openai_error(exc)
            except ApiError as exc:
                return _openai_error(_from_api_error(exc))

        return handler

    return wrap


# ------------------------------------------------------------------------------ models
@openai_view("GET")
async def models(request: HttpRequest, user: Any) -> HttpResponse:
    deployments = await orm(turns.chat_deployments)(user)
    data = [model_entry(turns.model_id(d), int(d.created_at.timestamp()), d.owner.username,
                        deployment=str(d.pk), workflow=d.version.workflow.name, version=d.version.number,
                        status=d.status, **model_weights(d.version.spec).fields()) for d in deployments]
    return JsonResponse({"object": "list", "data": data})


# -------------------------------------------------------------------- chat completions
@openai_view("POST")
async def chat_completions(request: HttpRequest, user: Any) -> HttpResponse:
    wait = await orm(run_throttle_wait, thread_sensitive=False)(request, user)
    if wait is not None:
        raise OpenAIError(429, f"too many runs submitted: retry in {wait:.0f} s (OMNIFLOW_THROTTLE_RUN)",
                          type="rate_limit_error", code="rate_limit_exceeded")
    try:
        body = _json_body(request)
    except ValueError as exc:
        raise OpenAIError(400, str(exc)) from None
    chat = parse_chat_request(body)
    deployment = await orm(turns.find_model)(user, chat.model)
    if deployment is None:
        raise OpenAIError(404, f"the model {chat.model!r} does not exist or is not running (see /v1/models)",
                          param="model", code="model_not_found")
    eng = engine()
    if deployment.status != DeploymentStatus.RUNNING:
        await _until_running(deployment.pk, chat.model, eng.config.chat_timeout_s)
    try:
        start = await orm(turns.start_completion)(user, deployment, chat, eng.config.chat_timeout_s)
    except NotAChatWorkflow as exc:
        raise OpenAIError(400, f"model {chat.model!r}: {exc}", param="model") from None
    completion_id = f"chatcmpl-{start.run_id.replace('-', '')}"
    created = int(time.time())
    if chat.stream:
        return _sse(_completion_stream(start, chat.model, completion_id, created, chat.include_usage))
    result = await _last(turns.follow_turn(start, eng.runs.bus), eng.config.chat_timeout_s)
    if result.status != "done":
        raise OpenAIError(500, f"the run {start.run_id} {result.status}: {result.error}", type="server_error")
    return JsonResponse(completion(completion_id, chat.model, created, result.text, result.finish_reason,
                                   result.usage))


async def _until_running(deployment_id: Any, model: str, timeout_s: float) -> None:
    """Wait for a deployment on its way to running (its workers start: after a deploy, or as the
    studio starts again and deploys what it hosted); 503 when it fails or stops instead, 504 when
    it is not running within `timeout_s`. The status is read from the database, where whatever
    hosts the workers (this process or a node's agent) writes it."""
    deadline = time.monotonic() + timeout_s
    pause = _STARTING_POLL_S
    while True:
        status = await orm(turns.deployment_status)(deployment_id)
        if status == DeploymentStatus.RUNNING:
            return
        if status not in turns.COMING:
            raise OpenAIError(503, f"the model {model!r} did not start (its deployment is {status})",
                              type="server_error", param="model")
        if time.monotonic() + pause > deadline:
            raise OpenAIError(504, f"the model {model!r} is still starting after {timeout_s} s; try again",
                              type="server_error", param="model")
        await asyncio.sleep(pause)  # its workers load the model: seconds; the database says when
        pause = min(pause * 2, _STARTING_POLL_MAX_S)


async def _last(stream: AsyncIterator[str | turns.TurnRestarted | turns.TurnResult],
                timeout_s: float) -> turns.TurnResult:
    async def drain() -> turns.TurnResult:
        async for item in stream:
            if isinstance(item, turns.TurnResult):
                return item
        raise RuntimeError("the run's events ended without run_finished")

    try:
        async with asyncio.timeout(timeout_s):
            return await drain()
    except TimeoutError:
        raise OpenAIError(504, f"no answer within {timeout_s} s", type="server_error") from None


def _sse(events: AsyncIterator[dict[str, Any] | str]) -> StreamingHttpResponse:
    async def encode() -> AsyncIterator[bytes]:
        async for event in events:
            data = event if isinstance(event, str) else json.dumps(event)
            yield f"data: {data}\n\n".encode()

    response = StreamingHttpResponse(encode(), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


async def _completion_stream(start: turns.TurnStart, model: str, completion_id: str, created: int,
                             include_usage: bool) -> AsyncIterator[dict[str, Any] | str]:
    """OpenAI's chunks: the role, each delta, the finish reason, usage if asked, [DONE]."""
    yield chunk(completion_id, model, created, {"role": "assistant", "content": ""})
    streamed = False
    try:
        async with asyncio.timeout(engine().config.chat_timeout_s):
            async for item in turns.follow_turn(start, engine().runs.bus):
                if isinstance(item, str):
                    streamed = True
                    yield chunk(completion_id, model, created, {"content": item})
                    continue
                if isinstance(item, turns.TurnRestarted):
                    if streamed:  # what the client holds cannot be taken back: end the stream
                        yield OpenAIError(500, f"the run {start.run_id} was restarted ({item.error}) after part"
                                          " of the reply was sent; send the request again", type="server_error").body()
                        return
                    continue
                if item.status != "done":
                    yield OpenAIError(500, f"the run {start.run_id} {item.status}: {item.error}",
                                      type="server_error").body()
                    return
                yield chunk(completion_id, model, created, {}, item.finish_reason)
                if include_usage:
                    yield chunk(completion_id, model, created, {}, usage=item.usage, choices=False)
    except TimeoutError:
        yield OpenAIError(504, "no answer in time", type="server_error").body()
        return
    yield "[DONE]"


# -------------------------------------------------------------------------- sessions
@csrf_exempt
async def session_turns(request: HttpRequest, pk: uuid.UUID) -> HttpResponse:
    """`POST {"content": text or content parts, max_tokens?, temperature?, ...}`: send the next
    turn of a session and wait for the reply. 201 with the reply, the turn's run and the
    session; 409 while the session is closed or busy, 502 when the run failed."""
    if request.method != "POST":
        return JsonResponse(error_body("use POST"), status=405)
    try:
        user = await _user(request, allow_session=True)
    except _Unauthorized as exc:
        return JsonResponse(error_body(str(exc)), status=401, headers={"WWW-Authenticate": "Bearer"})
    except PermissionError as exc:
        return JsonResponse(error_body(str(exc)), status=403)
    wait = await orm(run_throttle_wait, thread_sensitive=False)(request, user)
    if wait is not None:
        return JsonResponse(error_body(f"too many runs submitted: retry in {wait:.0f} s (OMNIFLOW_THROTTLE_RUN)"),
                            status=429, headers={"Retry-After": str(int(wait) or 1)})
    try:
        body = _json_body(request)
        if not isinstance(body, dict) or "content" not in body:
            raise OpenAIError(400, 'send {"content": "..."} (text, or OpenAI content parts)', param="content")
        new = parse_messages([{"role": "user", "content": body["content"]}], "content", roles=("user",))
        sampling = ChatSampling.parse(body)
        eng = engine()
        start = await orm(turns.start_session_turn)(user, pk, new, sampling,
                                                                       eng.config.chat_timeout_s)
    except ValueError as exc:  # bad JSON
        return JsonResponse(error_body(str(exc)), status=400)
    except OpenAIError as exc:
        return JsonResponse(error_body(exc.message, [{"field": exc.param, "message": exc.message}]),
                            status=exc.status)
    except Session.DoesNotExist:
        return JsonResponse(error_body(f"no session {pk}"), status=404)
    except ApiError as exc:
        return JsonResponse(error_body(exc.message, exc.details), status=exc.status_code)
    try:
        result = await _last(turns.follow_turn(start, eng.runs.bus), eng.config.chat_timeout_s)
    except OpenAIError as exc:
        result = turns.TurnResult(status="failed", text="", usage=None, finish_reason="stop", error=exc.message)
    session = await orm(turns.finish_session_turn)(pk, start.run_id, new.messages, result)
    data = await orm(lambda: ChatSessionSerializer(session).data)()
    if result.status != "done":
        return JsonResponse(error_body(f"the turn's run {result.status}: {result.error}",
                                       [{"run": start.run_id}]), status=502)
    return JsonResponse({"message": {"role": "assistant", "content": result.text}, "run": start.run_id,
                         "usage": result.usage, "finish_reason": result.finish_reason, "session": data},
                        status=201)
