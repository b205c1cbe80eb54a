"""Paths to a place inside a user's JSON, as errors name it: `$.nodes[2].params["a.b"]`.

A member whose key is a plain name reads `.key`; any other key (one holding `.`, `[`, a quote,
a space, or empty) is written JSON-quoted in brackets, so no two places share a path. Elements
read `[index]`.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable

_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def member(path: str | None, key: str) -> str:
    """The path of member `key` of the object at `path` (None: a top-level field, named bare)."""
    if _PLAIN.match(key):
        return key if path is None else f"{path}.{key}"
    return f"{path or ''}[{json.dumps(key, ensure_ascii=False)}]"


def element(path: str | None, index: int) -> str:
    """The path of element `index` of the list at `path` (None: the top-level list)."""
    return f"{path or ''}[{index}]"


def json_path(parts: Iterable[str | int], root: str = "$") -> str:
    """The path of `parts` (keys and indexes, outermost first, as jsonschema's `absolute_path`) below `root`."""
    out = root
    for part in parts:
        out = element(out, part) if isinstance(part, int) else member(out, part)
    return out
