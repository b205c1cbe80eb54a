"""JSON from clients, parsed in one place with a size and a depth limit.

`load_json` is what every surface uses: the API's parser (`LimitedJSONParser`, DRF's
`DEFAULT_PARSER_CLASSES`), the `/v1` and session-turn views and the WebSocket consumers'
`receive`. A document nested deeper than `OMNIFLOW_MAX_JSON_DEPTH` (or so deep the parser
itself gives up) is a 400, one longer than its limit a 413; neither ever reaches code that
would recurse over it.
"""

from __future__ import annotations

import json
from typing import IO, Any

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


def load_json(raw: str | bytes, *, max_depth: int, max_bytes: int | None = None, what: str = "the body") -> Any:
    """Parse `raw`; JsonRefused when it is not JSON, nests past `max_depth` or is longer than `max_bytes`."""
    if max_bytes is not None and len(raw) > max_bytes:
        raise JsonRefused(f"{what} is {len(raw)} bytes, over the limit of {max_bytes}", status=413)
    try:
        value = json.loads(raw)
    except RecursionError:
        raise JsonRefused(f"{what} nests deeper than {max_depth} levels (OMNIFLOW_MAX_JSON_DEPTH)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise JsonRefused(f"{what} is not valid JSON: {exc}") from None
    depth = json_depth(value)
    if depth > max_depth:
        raise JsonRefused(f"{what} nests {depth} levels deep, over the limit of {max_depth} (OMNIFLOW_MAX_JSON_DEPTH)")
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
