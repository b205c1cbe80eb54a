"""One chat turn: a run of a chat deployment, followed to its end.

`start_completion` (stateless, `/v1/chat/completions`) renders the whole conversation into
the prompt input; the LLM's prefix cache reuses the KV of what it has seen. A session turn
(`start_session_turn`) sends only what is new and sets the llm node's `session` param (and
`session_history`, what the session holds, for a worker that no longer does), so
the LLM keeps the history (tokens and KV) server-side; the studio keeps the messages
(`Session.messages`) for the history endpoint and for rendering the next turn.

`follow_turn` yields the reply's text deltas as the run's events bring them (the llm
node's `text` frames when it streams; its whole text at once when it does not), then one
`TurnResult`: the reply (the run's reply output), token usage and finish reason, both as the
llm node's `usage` output says (`engine.spec.usage.Usage`). A graph saved before that output
existed has its usage counted from its `usage` output or the node's `kv` reference, and its
finish reason inferred: "stop" when the reply's last token is one of the model's EOS tokens or
the reply is shorter than `max_new_tokens` (a stop string), else "length". A reply that ended on
the EOS token (the llm node's last `tokens` frame) carries its text (`eos`), which the session
keeps, since the LLM holds that token. A run executed again after its executor stopped (`run_restarted`) yields
`TurnRestarted`, and the deltas start over.

A session has a turn in flight while `Session.turn` names a run that is pending or running;
any end of that run (done, failed, cancelled, or failed after its lease lapsed) frees it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import transaction
from django.db.models import Q

from engine.client.models import ModelLoadError
from engine.spec.usage import Usage
from studio.dbcalls import orm
from studio.errors import BadRequest, Conflict, Unavailable
from studio.workflows.apps import engine
from studio.workflows.chat.openai import ChatMessages, ChatRequest, ChatSampling
from studio.workflows.chat.shape import ChatShape, NotAChatWorkflow, chat_shape
from studio.workflows.chat.templates import ChatTemplate, Message, TemplateError
from studio.workflows.models import Deployment, DeploymentStatus, Run, RunStatus, Session
from studio.workflows.operations import create_run
from studio.workflows.paths import PathRefused, PathRoots, model_reference, without_roots
from studio.workflows.runs.bus import RunEventBus
from studio.workflows.runs.follow import follow_run
from studio.workflows.runs.lease import RUN_RESTARTED


def engine_session_id(session: Session) -> str:
    return f"studio-{session.pk}"


@dataclass(frozen=True, slots=True)
class TurnStart:
    run_id: str
    shape: ChatShape
    max_new_tokens: int
    template: ChatTemplate


@dataclass(frozen=True, slots=True)
class TurnRestarted:
    """The turn's run is being executed again from the start: the deltas so far are void."""

    error: str


@dataclass(frozen=True, slots=True)
class TurnResult:
    status: str
    text: str
    usage: dict[str, int] | None
    finish_reason: str
    error: str = ""
    eos: str = ""
    """The text of the EOS token the reply ended on ("" when it did not end on one)."""


# ------------------------------------------------------------------------- deployments
def chat_deployments(user: Any) -> list[Deployment]:
    """The deployments of chat workflows `user` can use: running, or on their way to it."""
    out = []
    coming = [DeploymentStatus.PENDING, DeploymentStatus.STARTING, DeploymentStatus.RUNNING]
    for deployment in (Deployment.objects.visible_to(user).filter(status__in=coming)
                       .select_related("version", "version__workflow", "owner").order_by("created_at")):
        try:
            chat_shape(deployment.version.spec)
        except NotAChatWorkflow:
            continue
        out.append(deployment)
    return out


def model_id(deployment: Deployment) -> str:
    """The OpenAI model id of a deployment: its name (every deployment made since names were given
    has one), or its id when it has none."""
    return deployment.name or str(deployment.pk)


COMING = (DeploymentStatus.PENDING, DeploymentStatus.STARTING)
"""Statuses of a deployment on its way to running (e.g. deployed again as the studio started)."""


def find_model(user: Any, model: str) -> Deployment | None:
    """The chat deployment `model` names, by its name or its id: a running one, or one on its way
    (see `COMING`; the caller waits for it). Names are unique among a user's live deployments; where
    `user` sees others' too (staff), their own comes first."""
    qs = (Deployment.objects.visible_to(user).filter(status__in=[DeploymentStatus.RUNNING, *COMING])
          .select_related("version"))
    try:
        qs = qs.filter(Q(name=model) | Q(pk=uuid.UUID(model)))
    except ValueError:
        qs = qs.filter(name=model)
    mine = qs.filter(owner=user).order_by("-created_at").first()
    return mine or qs.order_by("-created_at").first()


def deployment_status(deployment_id: Any) -> str | None:
    return Deployment.objects.filter(pk=deployment_id).values_list("status", flat=True).first()


@dataclass(frozen=True, slots=True)
class LLMTurn:
    """What a turn sets on the chat workflow's llm node: the request's sampling and, for a session
    turn, its session (`engine_session_id`) and what the session holds, for a worker that does not
    (`history` rendered, and its number of `turns`)."""

    sampling: ChatSampling
    session: str | None = None
    history: str = ""
    turns: int = 0

    def node_params(self) -> dict[str, Any]:
        """The llm node's params for this run (what the run row stores)."""
        params = self.sampling.node_params()
        if self.session is not None:
            params["session"] = self.session
        if self.history:
            params["session_history"] = self.history
            params["session_turns"] = self.turns
        return params

    def max_new_tokens(self, shape: ChatShape) -> int:
        """The turn's token limit: the request's, else the llm node's own, else its kind's default."""
        if self.sampling.max_new_tokens is not None:
            return self.sampling.max_new_tokens
        if shape.max_new_tokens is not None:
            return shape.max_new_tokens
        return int(engine().kinds.node_kind("llm").param_default("max_new_tokens"))


def _image_files(shape: ChatShape, images: list[bytes]) -> dict[str, SimpleUploadedFile]:
    if len(images) > len(shape.image_inputs):
        raise BadRequest(f"the workflow takes {len(shape.image_inputs)} image(s); {len(images)} were given")
    return {name: SimpleUploadedFile(f"{name}.bin", data, "application/octet-stream")
            for name, data in zip(shape.image_inputs, images, strict=False)}


def chat_template(deployment: Deployment, shape: ChatShape) -> ChatTemplate:
    """The chat template of the model the deployment's llm role runs (BadRequest when the model is
    no longer where the deployment found it; Unavailable when it cannot be loaded here)."""
    if not shape.model:
        raise BadRequest(f"the llm role of deployment {deployment.pk} names no model")
    roots = PathRoots.of(engine().config)
    try:
        return engine().templates.get(model_reference(roots, "llm", shape.model))
    except PathRefused as exc:
        raise BadRequest(without_roots(str(exc), roots)) from None
    except ModelLoadError as exc:  # a checkpoint's tokenizer error names its files: their folder is hidden
        raise Unavailable(f"the chat template of model {shape.model!r} cannot be loaded:"
                          f" {without_roots(str(exc), roots)}") from None


def _rendered(render: Callable[[], str]) -> str:
    """A rendering of the messages; BadRequest when the model's template refuses them."""
    try:
        return render()
    except TemplateError as exc:
        raise BadRequest(str(exc)) from None


def _start(user: Any, deployment: Deployment, shape: ChatShape, template: ChatTemplate, prompt: str,
           images: list[bytes], turn: LLMTurn, timeout_s: float) -> TurnStart:
    params = turn.node_params()
    run = create_run(user, deployment.version, {shape.prompt_input: prompt}, files=_image_files(shape, images),
                     deployment=deployment, timeout_s=timeout_s,
                     node_params={shape.sampled_node: params} if params else {})
    return TurnStart(str(run.pk), shape, turn.max_new_tokens(shape), template)


def start_completion(user: Any, deployment: Deployment, chat: ChatRequest, timeout_s: float) -> TurnStart:
    """Submit a stateless completion of `chat`'s conversation (NotAChatWorkflow, or the API errors
    of `create_run`)."""
    shape = chat_shape(deployment.version.spec)
    template = chat_template(deployment, shape)
    prompt = _rendered(lambda: template.render(chat.conversation.messages))
    return _start(user, deployment, shape, template, prompt, chat.conversation.images, LLMTurn(chat.sampling),
                  timeout_s)


# ---------------------------------------------------------------------------- sessions
def open_session(user: Any, deployment: Deployment, *, title: str = "", system: str = "") -> Session:
    if deployment.status != DeploymentStatus.RUNNING:
        raise Conflict(f"deployment {deployment.pk} is {deployment.status}, not running")
    try:
        shape = chat_shape(deployment.version.spec)
    except NotAChatWorkflow as exc:
        raise BadRequest(str(exc), exc.problems) from None
    if not shape.sessions:
        raise BadRequest(f"deployment {deployment.pk} keeps no sessions: its workflow generates with an"
                         " llm.prefill -> llm.decode pair, whose kinds take no session; use /v1/chat/completions")
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    return Session.objects.create(owner=user, deployment=deployment, title=title, messages=messages)


def turn_in_flight(session: Session) -> bool:
    """Whether the session's turn is in flight: `Session.turn` names a run still pending or running
    (any end of it, a lapsed lease's included, frees the session)."""
    return session.turn_id is not None and Run.objects.filter(
        pk=session.turn_id, status__in=[RunStatus.PENDING, RunStatus.RUNNING]).exists()


def start_session_turn(user: Any, session_id: Any, new: ChatMessages, sampling: ChatSampling,
                       timeout_s: float) -> TurnStart:
    """Submit the next turn of a session; Conflict while it is closed, its deployment is not
    running, or another turn is in flight."""
    with transaction.atomic():
        session = Session.objects.visible_to(user).select_for_update().filter(pk=session_id).first()
        if session is None:
            raise Session.DoesNotExist(session_id)
        if session.closed:
            raise Conflict(f"session {session.pk} is closed")
        deployment = Deployment.objects.select_related("version", "version__workflow").get(pk=session.deployment_id)
        if deployment.status != DeploymentStatus.RUNNING:
            raise Conflict(f"the session's deployment {deployment.pk} is {deployment.status}, not running")
        if turn_in_flight(session):
            raise Conflict(f"session {session.pk} has a turn in flight (run {session.turn_id})")
        shape = chat_shape(deployment.version.spec)
        template = chat_template(deployment, shape)
        prompt = _rendered(lambda: template.turn(session.messages, new.messages))
        # What the session holds: a worker without it (its replica was replaced), or with a stale copy, rebuilds it.
        turn = LLMTurn(sampling, engine_session_id(session), _rendered(lambda: template.held(session.messages)),
                       sum(1 for m in session.messages if m["role"] == "assistant"))
        start = _start(user, deployment, shape, template, prompt, new.images, turn, timeout_s)
        session.turn_id = start.run_id
        session.save(update_fields=["turn", "updated_at"])
    return start


def finish_session_turn(session_id: Any, run_id: str, new: list[Message], result: TurnResult) -> Session:
    """Append the turn to the history when it succeeded; the session takes turns again."""
    with transaction.atomic():
        session = Session.objects.select_for_update().get(pk=session_id)
        if str(session.turn_id) == run_id:
            if result.status == RunStatus.DONE:
                reply: Message = {"role": "assistant", "content": result.text}
                if result.eos:  # the LLM holds the EOS token the reply ended on: the next turn follows it
                    reply["eos"] = result.eos
                session.messages = [*session.messages, *new, reply]
            session.turn = None
            session.save(update_fields=["messages", "turn", "updated_at"])
    return session


# ------------------------------------------------------------------------------ follow
def _text(value: Any) -> str:
    if isinstance(value, list):
        return "".join(v for v in value if isinstance(v, str))
    return value if isinstance(value, str) else ""


def _usage_from_kv(kv: Any) -> dict[str, int] | None:
    if isinstance(kv, list) and kv:
        kv = kv[-1]
    if not isinstance(kv, dict) or not isinstance(kv.get("prompt_tokens"), int) or not isinstance(
            kv.get("tokens"), int):
        return None  # absent, or cut short in the event (see `engine.flow.events.preview`)
    prompt, total = kv["prompt_tokens"], kv["tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": total - prompt, "total_tokens": total,
            "cached_tokens": int(kv.get("cached_tokens") or 0)}


def _openai_usage(usage: Usage) -> dict[str, int]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "cached_tokens": usage.cached_tokens}


@orm
def _stored_outputs(run_id: str) -> dict[str, Any]:
    outputs = Run.objects.filter(pk=run_id).values_list("outputs", flat=True).first() or {}
    return {k: v for k, v in outputs.items() if not (isinstance(v, dict) and "$file" in v)}


def _last_token(value: Any) -> int | None:
    """The last id of a `tokens` frame or output (None: empty, or cut short in the event)."""
    if isinstance(value, list) and value and isinstance(value[-1], int):
        return value[-1]
    return None


async def follow_turn(start: TurnStart, bus: RunEventBus) -> AsyncIterator[str | TurnRestarted | TurnResult]:
    shape = start.shape
    deltas: list[str] = []
    kv_usage = None
    llm_usage: Usage | None = None
    last_token: int | None = None
    async for event in follow_run(start.run_id, bus):
        kind = event.get("type")
        if kind == RUN_RESTARTED:
            deltas, kv_usage, llm_usage, last_token = [], None, None, None
            yield TurnRestarted(str(event.get("error") or ""))
        elif kind == "node_output" and event.get("node") == shape.llm_node:
            port = event.get("port")
            if port == "text" and (shape.streams == (event.get("frame") is not None)):
                delta = _text(event.get("value"))
                if delta:
                    deltas.append(delta)
                    yield delta
            elif port == "tokens" and (shape.streams == (event.get("frame") is not None)):
                last_token = _last_token(event.get("value")) if event.get("value") else last_token
            elif port == "usage":
                llm_usage = Usage.from_value(event.get("value"))
            elif port == "kv" and not shape.llm_usage:
                kv_usage = _usage_from_kv(event.get("value")) or kv_usage
        elif kind == "run_finished":
            # The stored outputs are whole; the event's are previews (long texts cut short).
            outputs = {**(event.get("outputs") or {}), **await _stored_outputs(start.run_id)}
            status = event.get("status", "failed")
            text = _text(outputs.get(shape.reply_output)) or "".join(deltas)
            eos = start.template.eos_text(last_token)
            if shape.llm_usage:  # the llm node says what it took and why it ended
                usage = None if llm_usage is None else _openai_usage(llm_usage)
                finish = "stop" if llm_usage is None else llm_usage.finish_reason
            else:  # a graph saved before the llm node had `usage`: counted from its outputs or kv reference
                usage = outputs.get(shape.usage_output) if shape.usage_output else None
                if not (isinstance(usage, dict) and all(isinstance(usage.get(k), int) for k in
                                                        ("prompt_tokens", "completion_tokens", "total_tokens"))):
                    usage = kv_usage
                length = eos is None and usage is not None and usage["completion_tokens"] >= start.max_new_tokens
                finish = "length" if length else "stop"
            yield TurnResult(status=status, text=text, usage=usage, finish_reason=finish,
                             error=event.get("error") or "", eos=eos or "")
            return
