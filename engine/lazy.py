"""Packages whose names load their module on first use (PEP 562 `__getattr__`).

A package that re-exports names from heavy modules (torch, transformers) makes every importer pay
for them; `lazy_attributes` gives it a `__getattr__` that imports a name's module when the name is
first read, and keeps the value in the package so that later reads are plain attribute lookups.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_attributes(package: str, homes: Mapping[str, Iterable[str]]) -> Callable[[str], Any]:
    """The `__getattr__` of `package`: `homes` maps each submodule to the names it provides."""
    module_of = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
