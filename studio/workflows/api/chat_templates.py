"""A model's chat template over REST: which one it is, and chat messages rendered with it.

`GET /api/models/<model>/chat-template/` says how `model` (a built-in name, or a checkpoint under
the model roots by its relative name: what a role's `model` names) renders chat messages: with
its own template (`"model"`: the packaged `smollm2-135m`, a checkpoint whose tokenizer has one) or
the simple one (`"simple"`: the tiny built-in models), and what its generation prompt adds at the
end of a rendered conversation (so a client can tell text that is rendered already).

`POST` renders `{"messages": [{"role", "content"}, ...], "add_generation_prompt": true}` into
`{"prompt": ...}`: the text `/v1/chat/completions` puts into a chat workflow's prompt input for
the same messages (`studio.workflows.chat.templates`). An llm node's prompt input reads its text as
the model's tokens, so a plain question there gets an empty reply from an instruct model; the New
run form sends what the user types through this endpoint (its "Chat message" toggle).

The messages are bounded (`MAX_MESSAGES`, `MAX_CHARACTERS` of content in all) and text only; a
bad field is a 400 naming it (`messages[1].role`). A model the studio cannot resolve, or whose
tokenizer it cannot read, is a 404 naming the model, never the server folder it looked in.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from engine.client.models import ModelLoadError
from studio.errors import BadRequest, NotFound
from studio.workflows.api.workflows import ERRORS
from studio.workflows.apps import engine
from studio.workflows.chat.openai import ROLES
from studio.workflows.chat.templates import ChatTemplate, TemplateError
from studio.workflows.paths import PathRefused, PathRoots, model_reference, without_roots

MAX_MESSAGES = 256
MAX_CHARACTERS = 256 * 1024
"""Characters of content over all the messages of one rendering (a context window's worth for
the models the studio runs, and a bound on the template's work)."""
MAX_MODEL_NAME = 512
TEMPLATE_ROLE_KIND = "llm"
"""The role kind a model name resolves as: the kind whose nodes read a prompt (its checkpoints are
also `sglang_llm`'s)."""


class Text(serializers.CharField):
    """A JSON string, taken as it is: a number or a list is refused, not turned into text."""

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class ChatMessageSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=ROLES, help_text="developer is rendered as system")
    content = Text(allow_blank=True, trim_whitespace=False, max_length=MAX_CHARACTERS)


class ChatRenderSerializer(serializers.Serializer):
    messages = ChatMessageSerializer(many=True, allow_empty=False, max_length=MAX_MESSAGES)
    add_generation_prompt = serializers.BooleanField(
        default=True, help_text="end with the assistant's turn opening (what a prompt for a reply ends with)")

    def validate_messages(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        total = sum(len(m["content"]) for m in messages)
        if total > MAX_CHARACTERS:
            raise serializers.ValidationError(f"the messages hold {total} characters of content; at most"
                                              f" {MAX_CHARACTERS} are rendered at once")
        return messages


class ChatTemplateSerializer(serializers.Serializer):
    model = serializers.CharField(help_text="the model, as the URL names it")
    template = serializers.ChoiceField(choices=["model", "simple"],
                                       help_text="model: its own chat template; simple: the studio's simple one")
    generation_prompt = serializers.CharField(
        allow_blank=True, help_text="what the template adds after a conversation for the reply to follow")


class RenderedPromptSerializer(serializers.Serializer):
    model = serializers.CharField()
    template = serializers.ChoiceField(choices=["model", "simple"])
    prompt = serializers.CharField(allow_blank=True, help_text="the messages as the llm node's prompt text")


def _not_found(model: str, why: str) -> NotFound:
    return NotFound(f"no chat template for model {model!r}", [{"field": "model", "message": why}])


def model_template(model: str) -> ChatTemplate:
    """The chat template of the model a role names `model`; NotFound (naming the model, without
    server paths) when there is no such model here or its tokenizer cannot be read."""
    if len(model) > MAX_MODEL_NAME:
        raise _not_found(f"{model[:40]}…", f"a model name has at most {MAX_MODEL_NAME} characters")
    studio = engine()
    roots = PathRoots.of(studio.config)
    try:
        return studio.templates.get(model_reference(roots, TEMPLATE_ROLE_KIND, model))
    except PathRefused as exc:
        problem = str(exc).removeprefix("model: ")  # "'x' is neither a built-in model nor ..."
        raise _not_found(model, without_roots(problem, roots)) from None
    except ModelLoadError as exc:
        raise _not_found(model, without_roots(str(exc), roots)) from None


class ChatTemplateView(APIView):
    @extend_schema(summary="How a model renders chat messages: its own chat template or the simple one",
                   responses={200: ChatTemplateSerializer, **ERRORS})
    def get(self, request: Request, model: str) -> Response:
        template = model_template(model)
        return Response({"model": model, "template": template.name, "generation_prompt": template.generation_prompt()})

    @extend_schema(summary="Chat messages rendered with a model's chat template, as an llm node's prompt",
                   request=ChatRenderSerializer, responses={200: RenderedPromptSerializer, **ERRORS})
    def post(self, request: Request, model: str) -> Response:
        template = model_template(model)
        body = ChatRenderSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            prompt = template.render(body.validated_data["messages"],
                                     add_generation_prompt=body.validated_data["add_generation_prompt"])
        except TemplateError as exc:
            raise BadRequest(f"model {model!r} cannot render these messages",
                             [{"field": "messages", "message": str(exc)}]) from None
        return Response({"model": model, "template": template.name, "prompt": prompt})
