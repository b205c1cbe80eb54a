"""Whole numbers a client writes as text (query parameters, a run socket's `since`), read in one
place with bounds: `count` is a 400 naming the parameter for anything else, so no caller meets
`int()`'s own failures (`"²".isdigit()` is true and `int("²")` raises; thousands of digits take
quadratic time, and past 4300 `int` refuses) or a number no column holds."""

from __future__ import annotations

from typing import Final

from studio.errors import BadRequest

DB_INT_MAX: Final = 2**31 - 1
"""The largest value of the integer columns counts are compared with (PostgreSQL's `integer`:
event sequence numbers, version numbers)."""


def count(value: str, name: str, maximum: int, *, minimum: int = 0) -> int:
    """`value` as a whole number in `minimum..maximum`, written in ASCII digits (leading zeros
    allowed); BadRequest naming `name` otherwise."""
    digits = value.lstrip("0") or value[-1:]
    if value.isascii() and value.isdigit() and len(digits) <= len(str(maximum)):
        number = int(digits)
        if minimum <= number <= maximum:
            return number
    shown = value if len(value) <= 24 else f"{value[:20]}… ({len(value)} characters)"
    raise BadRequest(f"{name} must be a whole number from {minimum} to {maximum}, not {shown!r}")
