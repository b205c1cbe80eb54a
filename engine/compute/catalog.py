"""Named built-in configurations: one read-only table per family, one lookup rule."""

from __future__ import annotations

from types import MappingProxyType
from typing import Generic, Protocol, TypeVar


class Named(Protocol):
    @property
    def name(self) -> str: ...


C = TypeVar("C", bound=Named)


class Catalog(Generic[C]):
    """A family's built-in configurations: `configs`, a read-only name -> config table, and
    `named(name)`, the lookup a role's `model` goes through (an unknown name raises the family's
    `error`, naming the family, `what`, and its built-in names)."""

    __slots__ = ("configs", "error", "what")

    def __init__(self, what: str, error: type[Exception], *configs: C) -> None:
        self.what = what
        self.error = error
        self.configs: MappingProxyType[str, C] = MappingProxyType({cfg.name: cfg for cfg in configs})

    def named(self, name: str) -> C:
        """The config called `name`, or the family's error naming the built-in names."""
        try:
            return self.configs[name]
        except KeyError:
            raise self.error(f"unknown {self.what} {name!r} (built-in: {', '.join(sorted(self.configs))})") from None
