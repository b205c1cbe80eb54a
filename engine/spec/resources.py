"""What a role asks of the node it runs on: `RoleSpec.resources` read into one typed value.

    resources = {"gpus": 1, "cpus": 2, "memory_gb": 8, "gpu_memory_gb": 16,
                 "labels": {"kind": "gpu"}, "colocate": "weights"}

Every amount is per process: a replica of a role with `tp_size` N is N processes, so it needs
N times as much, all on one node (its ranks meet there), where it gets GPUs of its own
(`engine.flow.gpus`: each rank `gpus` of them). `labels` must all equal the node's
operator labels (`OMNIFLOW_NODE_LABELS`); `gpu_memory_gb` is the memory each of the node's
GPUs must have. Roles naming the same `colocate` group share a host: replica i of each of them
lands on one node (roles that share weights hold one copy of them there). Nothing else is
read: an unknown key is an error, as is a negative or non-numeric amount.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

KNOWN_KEYS = ("gpus", "cpus", "memory_gb", "gpu_memory_gb", "labels", "colocate")
MAX_GPUS = 1024
MAX_CPUS = 65536.0
MAX_MEMORY_GB = 1 << 20
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,62}$")
_GROUP = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,63}$")


class ResourcesError(ValueError):
    """`resources` of a role cannot be read; `problems` are (field, message) pairs, every one."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"resources.{f}: {m}" for f, m in problems))


class Amounts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Quantities of a node's resources: what something needs, or what a node has free (also
    on the wire, in a node's record)."""

    gpus: int = 0
    cpus: float = 0.0
    memory_gb: float = 0.0

    def __add__(self, other: Amounts) -> Amounts:
        return Amounts(self.gpus + other.gpus, self.cpus + other.cpus, self.memory_gb + other.memory_gb)

    def __sub__(self, other: Amounts) -> Amounts:
        return Amounts(self.gpus - other.gpus, self.cpus - other.cpus, self.memory_gb - other.memory_gb)

    def times(self, n: int) -> Amounts:
        return Amounts(self.gpus * n, self.cpus * n, self.memory_gb * n)

    def shortfalls(self, free: Amounts) -> list[str]:
        """What `free` lacks to hold these amounts (empty: it holds them), for people."""
        out = []
        eps = 1e-9
        if self.gpus > free.gpus:
            out.append(f"needs {self.gpus} GPU{'s' * (self.gpus != 1)}, {max(free.gpus, 0)} free")
        if self.cpus > free.cpus + eps:
            out.append(f"needs {_num(self.cpus)} CPUs, {_num(max(free.cpus, 0.0))} free")
        if self.memory_gb > free.memory_gb + eps:
            out.append(f"needs {_num(self.memory_gb)} GB of memory, {_num(max(free.memory_gb, 0.0))} GB free")
        return out

    def fits_in(self, free: Amounts) -> bool:
        return not self.shortfalls(free)

    def describe(self) -> str:
        return (f"{self.gpus} GPU{'s' * (self.gpus != 1)}, {_num(self.cpus)} CPU{'s' * (self.cpus != 1)},"
                f" {_num(self.memory_gb)} GB")

    def to_dict(self) -> dict[str, float]:
        return {"gpus": self.gpus, "cpus": round(self.cpus, 6), "memory_gb": round(self.memory_gb, 6)}


def _num(value: float) -> str:
    return f"{value:g}"


@dataclass(frozen=True, slots=True)
class RoleResources:
    """A role's `resources`, read: per-process amounts, node labels, GPU memory, colocate group."""

    per_process: Amounts = field(default_factory=Amounts)
    gpu_memory_gb: float = 0.0
    """Memory each GPU of the node must have (0: any)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    colocate: str | None = None

    def per_replica(self, tp_size: int) -> Amounts:
        return self.per_process.times(tp_size)


def _amount(raw: Mapping[str, Any], key: str, limit: float, problems: list[tuple[str, str]], *,
            integer: bool = False) -> float:
    if key not in raw:
        return 0
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or (integer and not isinstance(value, int)):
        problems.append((key, f"expected {'a whole number' if integer else 'a number'}, not {value!r}"))
        return 0
    if not math.isfinite(value) or not 0 <= value <= limit:
        problems.append((key, f"must be between 0 and {limit:g}, not {value!r}"))
        return 0
    return value


def role_resources(raw: Mapping[str, Any]) -> RoleResources:
    """Read a role's `resources`; raises `ResourcesError` naming every bad field."""
    problems: list[tuple[str, str]] = []
    if not isinstance(raw, Mapping):
        raise ResourcesError([("", f"expected an object, not {raw!r}")])
    for key in raw:
        if key not in KNOWN_KEYS:
            problems.append((str(key), f"unknown resource (known: {', '.join(KNOWN_KEYS)})"))
    gpus = int(_amount(raw, "gpus", MAX_GPUS, problems, integer=True))
    cpus = float(_amount(raw, "cpus", MAX_CPUS, problems))
    memory = float(_amount(raw, "memory_gb", MAX_MEMORY_GB, problems))
    gpu_memory = float(_amount(raw, "gpu_memory_gb", MAX_MEMORY_GB, problems))
    if gpu_memory and not gpus:
        problems.append(("gpu_memory_gb", "asks for GPU memory but no GPUs (set gpus)"))
    labels: dict[str, str] = {}
    raw_labels = raw.get("labels", {})
    if not isinstance(raw_labels, Mapping):
        problems.append(("labels", f"expected an object of label names to values, not {raw_labels!r}"))
    else:
        for name, value in raw_labels.items():
            if not isinstance(name, str) or not _LABEL.match(name):
                problems.append((f"labels.{name}", "a label name is letters, digits and _.-/ (at most 63)"))
            elif not isinstance(value, str) or not _LABEL.match(value):
                problems.append((f"labels.{name}", f"a label value is a string of letters, digits and _.-/"
                                                   f" (at most 63), not {value!r}"))
            else:
                labels[name] = value
    colocate = raw.get("colocate")
    if colocate is not None and (not isinstance(colocate, str) or not _GROUP.match(colocate)):
        problems.append(("colocate", f"a colocate group is an identifier, not {colocate!r}"))
        colocate = None
    if problems:
        raise ResourcesError(problems)
    return RoleResources(Amounts(gpus, cpus, memory), gpu_memory, labels, colocate)


def parse_labels(text: str) -> dict[str, str]:
    """`zone=a,kind=gpu` as a dict; raises ValueError naming a malformed entry."""
    labels: dict[str, str] = {}
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        name, sep, value = entry.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not _LABEL.match(name) or not _LABEL.match(value):
            raise ValueError(f"{entry!r}: expected NAME=VALUE, each letters, digits and _.-/ (at most 63)")
        if name in labels:
            raise ValueError(f"label {name!r} is given twice")
        labels[name] = value
    return labels
