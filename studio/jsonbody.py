"""JSON from clients, parsed in one place with a size and a depth limit.

`load_json` is what every surface uses: the API's parser (`LimitedJSONParser`, DRF's
`DEFAULT_PARSER_CLASSES`), the `/v1` and session-turn views and the WebSocket consumers'
`receive`. A document nested deeper than `OMNIFLOW_MAX_JSON_DEPTH` (or so deep the parser
itself gives up) is a 400, one longer than its limit a 413; neither ever reaches code that
would recurse over it. So is a document holding what no part of the studio can keep or pass on,
named by its place (`$.inputs.n`): an integer outside the signed 64-bit range (PostgreSQL's
`bigint`, the workers' msgpack wire; Python would not even print one of 4300 digits), a number
that is not finite (`NaN`, `Infinity`: Python's parser reads them though JSON has none, and
`1e400` reads as an infinity; PostgreSQL's jsonb takes none), or text holding a NUL character
(PostgreSQL stores none in text or jsonb).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import IO, Any, Final

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from engine.spec.jsonpath import element, member


class JsonRefused(ValueError):
    """A client's JSON is malformed, too deep (`status` 400) or too long (413)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


INT_MIN: Final = -(2**63)
INT_MAX: Final = 2**63 - 1
"""The integers a client's JSON may hold: a signed 64-bit one."""
_INT_DIGITS: Final = len(str(INT_MAX))
_NUL_TEXT: Final = "the text holds a NUL character (\\u0000)"
_NOT_FINITE: Final = "the number is not finite (NaN, Infinity, or past the largest float)"


class _LongInteger:
    """An integer's digits, where a second reading of a document (`load_json`) leaves those
    Python would not convert to an int, so that `scan` names their place."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _marked_integer(text: str) -> int | _LongInteger:
    return int(text) if len(text.lstrip("-")) <= _INT_DIGITS else _LongInteger(text)


def _integer_problem(text: str) -> str:
    shown = text if len(text) <= 24 else f"{text[:20]}… ({len(text)} characters)"
    return f"the integer {shown} is outside the signed 64-bit range"


@dataclass(frozen=True, slots=True)
class Scan:
    """What `scan` found in a parsed JSON value."""

    depth: int
    """How deeply it nests lists and objects (a scalar: 0)."""
    unfit: str | None
    """The first place found holding what a client's JSON may not, and why (`$.a[1]: ...`);
    None when there is none."""


def _itself(path: str, _key: object) -> str:
    return path


def scan(value: Any) -> Scan:
    """Walk `value` once, without recursion: its depth, and whether it holds an integer outside
    the signed 64-bit range, a number that is not finite, or text (a key too) with a NUL character. Paths are written only for
    lists and objects, and for the place refused."""
    deepest, unfit = 0, None
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, dict):
            if unfit is None and any("\x00" in key for key in item):
                unfit = f"${path}: a key holds a NUL character (\\u0000)"
            children, where = item.items(), member
        elif isinstance(item, list):
            children, where = enumerate(item), element
        else:  # the document is a scalar
            children, where = (("", item),), _itself
            depth -= 1
        deepest = max(deepest, depth + 1)
        for key, child in children:
            kind = type(child)  # exact types: what `json.loads` makes
            if kind is dict or kind is list:
                stack.append((child, depth + 1, where(path, key)))
            elif unfit is not None:
                continue
            elif kind is str:
                if "\x00" in child:
                    unfit = f"${where(path, key)}: {_NUL_TEXT}"
            elif kind is int:
                if not INT_MIN <= child <= INT_MAX:
                    unfit = f"${where(path, key)}: {_integer_problem(str(child))}"
            elif kind is float:
                if not math.isfinite(child):
                    unfit = f"${where(path, key)}: {_NOT_FINITE}"
            elif kind is _LongInteger:
                unfit = f"${where(path, key)}: {_integer_problem(child.text)}"
    return Scan(depth=deepest, unfit=unfit)


def json_depth(value: Any) -> int:
    """How deeply `value` nests lists and objects (a scalar: 0), without recursion."""
    return scan(value).depth


def load_json(raw: str | bytes, *, max_depth: int, max_bytes: int | None = None, what: str = "the body") -> Any:
    """Parse `raw`; JsonRefused when it is not JSON, nests past `max_depth`, is longer than
    `max_bytes`, or holds what `scan` refuses (the message names its place)."""
    if max_bytes is not None and len(raw) > max_bytes:
        raise JsonRefused(f"{what} is {len(raw)} bytes, over the limit of {max_bytes}", status=413)
    try:
        value = json.loads(raw)
    except RecursionError:
        raise JsonRefused(f"{what} nests deeper than {max_depth} levels (OMNIFLOW_MAX_JSON_DEPTH)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise JsonRefused(f"{what} is not valid JSON: {exc}") from None
    except ValueError:  # an integer of more digits than Python converts: read again to find it
        value = json.loads(raw, parse_int=_marked_integer)
    found = scan(value)
    if found.depth > max_depth:
        raise JsonRefused(f"{what} nests {found.depth} levels deep, over the limit of {max_depth}"
                          " (OMNIFLOW_MAX_JSON_DEPTH)")
    if found.unfit is not None:
        raise JsonRefused(f"{what} holds what the studio does not take: {found.unfit}")
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
