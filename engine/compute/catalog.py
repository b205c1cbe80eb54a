"""Named built-in configurations: one read-only table per family, one lookup rule."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol, TypeVar


class Named(Protocol):
    @property
    def name(self) -> str: ...


C = TypeVar("C", bound=Named)


def catalog(*configs: C) -> MappingProxyType[str, C]:
    """A read-only name -> config table."""
    return MappingProxyType({cfg.name: cfg for cfg in configs})


def lookup(table: Mapping[str, C], name: str, what: str, error: type[Exception]) -> C:
    """`table[name]`, or `error` naming `what` and the built-in names."""
    try:
        return table[name]
    except KeyError:
        raise error(f"unknown {what} {name!r} (built-in: {', '.join(sorted(table))})") from None
