"""The OpenAI chat-completions request, checked, and the response shapes.

What is accepted: `model` (a deployment's name or id), `messages` with roles system,
developer, user and assistant, whose content is text or a list of parts (`text`, and
`image_url` with a base64 `data:` URL of an image that Pillow reads whole, e.g. PNG or JPEG:
the studio fetches nothing), `stream` with
`stream_options.include_usage`, `max_tokens`/`max_completion_tokens`, `temperature`,
`top_p`, `seed`, `stop`, `presence_penalty`, `frequency_penalty`, `n` = 1. Tools,
function calls, logprobs and non-text response formats are refused with 400; other
fields (`user`, `metadata`, ...) are ignored. A request is checked once, here, into a
`ChatRequest` (its sampling fields a `ChatSampling`), which goes down to where the run is built.

Errors on `/v1/` use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`,
which its clients parse; the rest of the API keeps `{"error", "details"}`.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field
from typing import Any

from studio.workflows.chat.templates import Message
from studio.workflows.pictures import PictureRefused, check_picture

ROLES = ("system", "developer", "user", "assistant")
MAX_NEW_TOKENS = 4096
_DATA_URL = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,")
_UNSUPPORTED = {
    "tools": "tool calls are not supported",
    "tool_choice": "tool calls are not supported",
    "functions": "function calls are not supported",
    "function_call": "function calls are not supported",
    "audio": "audio output is not supported",
}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


@dataclass(frozen=True, slots=True)
class ChatMessages:
    """Messages as text (for the template) and the images of their image parts, in order."""

    messages: list[Message]
    images: list[bytes] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ChatSampling:
    """A chat request's sampling fields, checked (`parse`), as the llm node's params they set
    (`max_tokens`/`max_completion_tokens` is `max_new_tokens`); None where the request gives none
    (the node's own, or its kind's default, holds)."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @classmethod
    def parse(cls, body: dict[str, Any]) -> ChatSampling:
        """The OpenAI sampling fields of `body`; 400 naming the first bad one."""
        max_new_tokens = None
        for name in ("max_completion_tokens", "max_tokens"):
            if body.get(name) is not None:
                max_new_tokens = _number(body, name, 1, MAX_NEW_TOKENS, integer=True)
                break
        temperature = _float(body, "temperature", 0, 2)
        top_p = _float(body, "top_p", 0, 1, low_open=True)
        seed = None if body.get("seed") is None else _number(body, "seed", 0, 2**63 - 1, integer=True)
        presence_penalty = _float(body, "presence_penalty", -2, 2)
        frequency_penalty = _float(body, "frequency_penalty", -2, 2)
        stop = body.get("stop")
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if stop is not None and (not isinstance(stops, list) or not 1 <= len(stops) <= 4 or not all(
                isinstance(s, str) and s for s in stops)):
            raise invalid("stop must be a non-empty string or an array of 1 to 4 of them", "stop")
        return cls(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=tuple(stops),
                   presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)

    def node_params(self) -> dict[str, Any]:
        """The llm node's params these set (only those given): what the run stores for its node."""
        params = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "seed": self.seed, "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty, "stop": list(self.stop) or None}
        return {name: value for name, value in params.items() if value is not None}


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    conversation: ChatMessages
    stream: bool = False
    include_usage: bool = False
    sampling: ChatSampling = ChatSampling()


def _image(url: Any, param: str) -> bytes:
    if not isinstance(url, str):
        raise invalid("image_url.url must be a string", param)
    match = _DATA_URL.match(url)
    if match is None:
        raise invalid("only data: URLs are accepted for images (the studio fetches nothing)", param)
    if not match.group("b64"):
        raise invalid("image data URLs must be base64 (data:image/png;base64,...)", param)
    if not (match.group("type") or "").startswith("image/"):
        raise invalid(f"the data URL holds {match.group('type') or 'text/plain'}, not an image"
                      " (data:image/png;base64,...)", param)
    try:
        data = base64.b64decode(url[match.end():], validate=True)
    except (binascii.Error, ValueError):
        raise invalid("the image data URL is not valid base64", param) from None
    _check_picture(data, param)
    return data


def _check_picture(data: bytes, param: str) -> None:
    """400 unless Pillow reads `data` as a whole image of a size the workers decode (the vision
    encoder decodes it with Pillow, so a broken picture is refused here rather than failing the
    run on a worker)."""
    try:
        check_picture(data)
    except PictureRefused as exc:
        raise invalid(str(exc), param) from None


def parse_messages(raw: Any, param: str = "messages", *, roles: tuple[str, ...] = ROLES) -> ChatMessages:
    """OpenAI messages -> text messages and images; 400 naming the first bad field."""
    if not isinstance(raw, list) or not raw:
        raise invalid(f"{param} must be a non-empty array of messages", param)
    messages: list[Message] = []
    images: list[bytes] = []
    for i, message in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object", where)
        role = message.get("role")
        if role in ("tool", "function") or message.get("tool_calls") or message.get("function_call"):
            raise invalid(f"{where}: tool and function messages are not supported", f"{where}.role")
        if role not in roles:
            raise invalid(f"{where}.role must be one of {', '.join(roles)}, not {role!r}", f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            text = content
        elif isinstance(content, list):
            pieces = []
            for j, part in enumerate(content):
                at = f"{where}.content[{j}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    pieces.append(part["text"])
                elif kind == "image_url":
                    if role != "user":
                        raise invalid(f"{at}: only user messages may carry images", at)
                    image = part.get("image_url")
                    images.append(_image(image.get("url") if isinstance(image, dict) else image, at))
                else:
                    raise invalid(f"{at} must be a text part or an image_url part", at)
            text = "".join(pieces)
        else:
            raise invalid(f"{where}.content must be a string or an array of content parts", f"{where}.content")
        messages.append({"role": role, "content": text})
    if not any(m["role"] == "user" for m in messages):
        raise invalid(f"{param} must hold at least one user message", param)
    return ChatMessages(messages, images)


def _number(body: dict[str, Any], name: str, low: float, high: float, *, integer: bool = False,
            low_open: bool = False) -> Any:
    value = body[name]
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or value > high or value < low or (
            low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise invalid(f"{name} must be {'an integer' if integer else 'a number'} in {bound}, not {value!r}", name)
    return value


def _float(body: dict[str, Any], name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    return None if body.get(name) is None else float(_number(body, name, low, high, low_open=low_open))


def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    for name, why in _UNSUPPORTED.items():
        if body.get(name):
            raise invalid(why, name)
    if body.get("logprobs"):
        raise invalid("logprobs are not supported", "logprobs")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise invalid("only response_format {\"type\": \"text\"} is supported", "response_format")
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise invalid("model must name a deployment of a chat workflow (see /v1/models)", "model")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise invalid("only n = 1 is supported", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("stream must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise invalid("stream_options is an object, and only with stream: true", "stream_options")
    include_usage = bool((options or {}).get("include_usage", False))
    return ChatRequest(model=model.strip(), conversation=parse_messages(body.get("messages")), stream=stream,
                       include_usage=include_usage, sampling=ChatSampling.parse(body))


# --------------------------------------------------------------------------- responses
def completion(completion_id: str, model: str, created: int, text: str, finish_reason: str,
               usage: dict[str, int] | None) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": finish_reason}],
        "usage": _usage(usage),
    }


def chunk(completion_id: str, model: str, created: int, delta: dict[str, Any], finish_reason: str | None = None,
          *, usage: dict[str, int] | None = None, choices: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}] if choices else [],
    }
    if usage is not None:
        body["usage"] = _usage(usage)
    return body


def _usage(usage: dict[str, int] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)}}


def model_entry(model_id: str, created: int, owner: str, **extra: Any) -> dict[str, Any]:
    """OpenAI's model object; `extra` keys (the deployment, its workflow, version and status) follow
    OpenAI's own, which clients read and ignore the rest."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": owner, **extra}
