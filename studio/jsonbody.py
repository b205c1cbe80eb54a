"""JSON from clients, parsed in one place with a size and a depth limit.

`load_json` is what every surface uses: the API's parser (`LimitedJSONParser`, DRF's
`DEFAULT_PARSER_CLASSES`), the `/v1` and session-turn views and the WebSocket consumers'
`receive`. A document nested deeper than `OMNIFLOW_MAX_JSON_DEPTH` (or so deep the parser
itself gives up) is a 400, one longer than its limit a 413; neither ever reaches code that
would recurse over it. So is a document holding what no part of the studio can keep or pass on,
named by its place (`$.inputs.n`): an integer outside the signed 64-bit range (PostgreSQL's
`bigint`, the workers' msgpack wire; Python would not even print one of 4300 digits).
"""

from __future__ import annotations

import json
from typing import IO, Any, Final

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser


class JsonRefused(ValueError):
    """A client's JSON is malformed, too deep (`status` 400) or too long (413)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def json_depth(value: Any) -> int:
    """How deeply `value` nests lists and objects (a scalar: 0), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


INT_MIN: Final = -(2**63)
INT_MAX: Final = 2**63 - 1
"""The integers a client's JSON may hold: a signed 64-bit one."""
_INT_DIGITS: Final = len(str(INT_MAX))


class _Unfit:
    """What the parser met in place of a value a client's JSON may not hold; `unfit_place` names
    where it was left."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def _shown(text: str) -> str:
    return text if len(text) <= 24 else f"{text[:20]}… ({len(text)} characters)"


def _integer(text: str) -> int | _Unfit:
    """`parse_int`: the integer, unless it is past 64 bits (never converted when it is that long:
    a few thousand digits take Python quadratic time, and past 4300 it refuses)."""
    if len(text.lstrip("-")) <= _INT_DIGITS:
        value = int(text)
        if INT_MIN <= value <= INT_MAX:
            return value
    return _Unfit(f"the integer {_shown(text)} is outside the signed 64-bit range")


def unfit_place(value: Any) -> str | None:
    """Where `value` (as parsed by `load_json`) holds what a client's JSON may not, and why:
    `$.a[1]: ...` for the first place found; None when nothing."""
    stack: list[tuple[Any, str]] = [(value, "$")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, _Unfit):
            return f"{path}: {item.why}"
        if isinstance(item, dict):
            children = ((f"{path}.{key}", child) for key, child in item.items())
        elif isinstance(item, list):
            children = ((f"{path}[{index}]", child) for index, child in enumerate(item))
        else:
            continue
        for where, child in children:
            if isinstance(child, dict | list | _Unfit):
                stack.append((child, where))
    return None


def load_json(raw: str | bytes, *, max_depth: int, max_bytes: int | None = None, what: str = "the body") -> Any:
    """Parse `raw`; JsonRefused when it is not JSON, nests past `max_depth`, is longer than
    `max_bytes`, or holds a value past the limits above (the message names its place)."""
    if max_bytes is not None and len(raw) > max_bytes:
        raise JsonRefused(f"{what} is {len(raw)} bytes, over the limit of {max_bytes}", status=413)
    try:
        value = json.loads(raw, parse_int=_integer)
    except RecursionError:
        raise JsonRefused(f"{what} nests deeper than {max_depth} levels (OMNIFLOW_MAX_JSON_DEPTH)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise JsonRefused(f"{what} is not valid JSON: {exc}") from None
    depth = json_depth(value)
    if depth > max_depth:
        raise JsonRefused(f"{what} nests {depth} levels deep, over the limit of {max_depth} (OMNIFLOW_MAX_JSON_DEPTH)")
    unfit = unfit_place(value)
    if unfit is not None:
        raise JsonRefused(f"{what} holds what the studio does not take: {unfit}")
    return value


class LimitedJSONParser(JSONParser):
    """DRF's JSON parser with the limits of `load_json` (sizes past the upload limit are refused
    earlier, by `studio.errors.UploadLimitMiddleware`)."""

    def parse(self, stream: IO[bytes] | None, media_type: str | None = None,
              parser_context: dict[str, Any] | None = None) -> Any:
        config = settings.OMNIFLOW
        raw = stream.read() if stream is not None else b""
        try:
            return load_json(raw, max_depth=config.max_json_depth, max_bytes=config.max_upload_bytes)
        except JsonRefused as exc:
            if exc.status == 413:
                # studio.errors imports DRF's views, whose settings import this module.
                from studio.errors import PayloadTooLarge

                raise PayloadTooLarge(exc.message) from None
            raise ParseError(f"JSON parse error - {exc.message}") from None
