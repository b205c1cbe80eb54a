"""Load-balancing policies: which replica of a role runs the next request.

A policy is a pure function of (request, candidates) plus its own deterministic state (a
round-robin counter, a seeded RNG, a cached hash ring). It never reads the registry or the
clock, so it is unit-testable without processes. The dispatcher builds the candidates, usually
with :func:`candidates_from`, and asks ``policy.choose(request, candidates)`` for a worker id.

Every policy is independent of the order of ``candidates``: it sorts by ``worker_id`` first.
Worker ids within one call must be unique.

One policy instance serves one role (its state, e.g. the round-robin counter, is per role);
the role name is given to the constructor and appears in :class:`NoWorkerError`.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import jsonschema

from engine.flow.discovery import WorkerSnapshot


class NoWorkerError(RuntimeError):
    """No live worker can take a request for ``role``."""

    def __init__(self, role: str) -> None:
        super().__init__(f"no live worker for role {role!r}")
        self.role = role


@dataclass(frozen=True, slots=True)
class BalanceRequest:
    """What a policy may know about a request.

    ``session_key`` groups requests that should stick to one worker (``ConsistentHash`` falls
    back to ``request_id``); ``prefix_pages`` are the page hashes of the prompt, in order.
    """

    request_id: str
    session_key: str | None = None
    prefix_pages: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Candidate:
    """One live worker as a policy sees it.

    ``outstanding``: requests dispatched to it and not finished; ``capacity``: concurrent
    executions it runs (>= 1); ``cached_prefix_pages``: how many *leading* pages of this
    request's prefix it already holds in any KV tier (0 if unknown).
    """

    worker_id: str
    outstanding: int = 0
    capacity: int = 1
    cached_prefix_pages: int = 0

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"Candidate {self.worker_id!r}: capacity must be >= 1, got {self.capacity}")
        if self.outstanding < 0 or self.cached_prefix_pages < 0:
            raise ValueError(f"Candidate {self.worker_id!r}: counts must be >= 0")

    @property
    def load(self) -> float:
        """Outstanding requests per execution slot: 1.0 means every slot is busy."""
        return self.outstanding / self.capacity


def candidates_from(
    snapshots: Iterable[WorkerSnapshot],
    outstanding: Mapping[str, int] | None = None,
    cached: Mapping[str, int] | None = None,
) -> list[Candidate]:
    """Candidates for ``snapshots``, in the same order.

    ``outstanding`` is the dispatcher's own count of in-flight requests per worker, fresher than
    a heartbeat; a worker missing from it falls back to its last reported
    ``load.outstanding``. ``cached`` gives leading prefix pages held per worker; missing -> 0.
    Capacity comes from the worker's registration.
    """
    outstanding = outstanding or {}
    cached = cached or {}
    return [
        Candidate(
            worker_id=s.info.worker_id,
            outstanding=outstanding.get(s.info.worker_id, s.load.outstanding),
            capacity=s.info.capacity,
            cached_prefix_pages=cached.get(s.info.worker_id, 0),
        )
        for s in snapshots
    ]


class Policy(Protocol):
    """Chooses a worker for a request.

    ``choose`` returns the ``worker_id`` of one of ``candidates`` and raises
    :class:`NoWorkerError` (naming the policy's role) when ``candidates`` is empty. It does not
    modify the candidates; it may advance the policy's own state.
    """

    name: str
    role: str

    def choose(self, request: BalanceRequest, candidates: Sequence[Candidate]) -> str: ...


def _sorted(candidates: Sequence[Candidate], role: str) -> list[Candidate]:
    if not candidates:
        raise NoWorkerError(role)
    return sorted(candidates, key=lambda c: c.worker_id)


def _least_loaded_key(c: Candidate) -> tuple[int, float, str]:
    return (c.outstanding, c.load, c.worker_id)


def _seed_schema() -> dict[str, Any]:
    return {
        "type": ["integer", "null"],
        "default": None,
        "description": "RNG seed; the same seed and inputs give the same choices. null: seeded from the OS.",
    }


class RoundRobin:
    """Cycles through the candidates in ``worker_id`` order; exactly even over a stable set."""

    name = "round_robin"

    def __init__(self, *, role: str) -> None:
        self.role = role
        self._counter = 0

    @staticmethod
    def param_schema() -> dict[str, Any]:
        return {}

    def choose(self, request: BalanceRequest, candidates: Sequence[Candidate]) -> str:
        ordered = _sorted(candidates, self.role)
        choice = ordered[self._counter % len(ordered)]
        self._counter += 1
        return choice.worker_id


class _Seeded:
    """A policy that draws from a private RNG seeded by its ``seed`` param."""

    def __init__(self, *, role: str, seed: int | None = None) -> None:
        self.role = role
        self.seed = seed
        self._rng = random.Random(seed)  # load spreading, not cryptography

    @staticmethod
    def param_schema() -> dict[str, Any]:
        return {"seed": _seed_schema()}


class RandomChoice(_Seeded):
    """Uniformly random candidate, from a private RNG seeded by ``seed``."""

    name = "random"

    def choose(self, request: BalanceRequest, candidates: Sequence[Candidate]) -> str:
        return self._rng.choice(_sorted(candidates, self.role)).worker_id


class LeastOutstanding:
    """Fewest outstanding requests; ties go to the lowest outstanding/capacity, then worker_id."""

    name = "least_outstanding"

    def __init__(self, *, role: str) -> None:
        self.role = role

    @staticmethod
    def param_schema() -> dict[str, Any]:
        return {}

    def choose(self, request: BalanceRequest, candidates: Sequence[Candidate]) -> str:
        return min(_sorted(candidates, self.role), key=_least_loaded_key).worker_id


class PowerOfTwoChoices(_Seeded):
    """Samples two distinct candidates at random and keeps the less loaded one.

    "Less loaded" is fewer outstanding, then lower outstanding/capacity; an exact tie goes to
    the first of the (randomly ordered) pair, so equally loaded workers share evenly. The single
    most loaded candidate is never chosen when there are two or more.
    """

    name = "power_of_two"

    def choose(self, request: BalanceRequest, candidates: Sequence[Candidate]) -> str:
        ordered = _sorted(candidates, self.role)
        if len(ordered) == 1:
            return ordered[0].worker_id
        return min(self._rng.sample(ordered, 2), key=lambda c: (c.outstanding, c.load)).worker_id


def _hash64(text: str) -> int:
    """A process-independent 64-bit hash (Python's ``hash()`` is salted per process)."""
    return int.from_bytes(hashlib.sha1(text.encode("utf-8"), usedforsecurity=False).digest()[:8], "big")


class ConsistentHash:
    """Session affinity on a hash ring with ``vnodes`` virtual nodes per worker.

    The key is ``request.session_key`` or else ``request.request_id``; the same key maps to the
    same worker while the worker set is unchanged. Adding or removing one of N workers moves
    only the keys that land on (or left) that worker, about 1/N of them. Load is ignored.
    The ring for the last worker set is cached.
    """

    name = "consistent_hash"

    def __init__(self, *, role: str, vnodes: int = 128) -> None:
        if isinstance(vnodes, bool) or not isinstance(vnodes, int) or vnodes < 1:
            raise ValueError(f"vnodes must be an integer >= 1, got {vnodes!r}")
        self.role = role
        self.vnodes = vnodes
        self._ring_ids: tuple[str, ...] = ()
        self._ring_points: list[int] = []
        self._ring_owners: list[str] = []

    @staticmethod
    def param_schema() -> dict[str, Any]:
        return {
            "vnodes": {
                "type": "integer",
                "minimum": 1,
                "maximum": 4096,
                "default": 128,
                "description": "Virtual nodes per worker; more spreads keys more evenly.",
            }
        }

    def _ring(self, worker_ids: tuple[str, ...]) -> tuple[list[int], list[str]]:
        if worker_ids != self._ring_ids:
            # Ties between equal points (astronomically rare) resolve by worker_id, deterministically.
            points = sorted((_hash64(f"{wid}#{i}"), wid) for wid in worker_ids for i in range(self.vnodes))
            self._ring_ids = worker_ids
            self._ring_points = [p for p, _ in points]
            self._ring_owners = [wid for _, wid in points]
        return self._ring_points, self._ring_owners

    def choose(self, request: BalanceRequest, candidates: Sequence[Candidate]) -> str:
        ordered = _sorted(candidates, self.role)
        points, owners = self._ring(tuple(c.worker_id for c in ordered))
        key = request.session_key if request.session_key is not None else request.request_id
        index = bisect.bisect_left(points, _hash64(key)) % len(points)
        return owners[index]


class KVAware:
    """Prefix-cache-aware choice: the lowest ``cost`` wins (Dynamo-style).

    ``cost = overlap_weight * uncached_pages + load_weight * load`` where
    ``uncached_pages = len(prefix_pages) - cached_prefix_pages`` (pages this worker would have
    to prefill; cached counts above the prefix length are clamped) and
    ``load = outstanding / capacity`` (requests per execution slot, so a worker with twice the
    slots counts as half as loaded). ``load_weight`` is therefore "how many prefill pages one
    fully-busy slot's worth of queued work is worth". Ties go to the fewest outstanding, then
    the lowest worker_id. With an empty prefix this is least-load.
    """

    name = "kv_aware"

    def __init__(self, *, role: str, overlap_weight: float = 1.0, load_weight: float = 1.0) -> None:
        for label, value in (("overlap_weight", overlap_weight), ("load_weight", load_weight)):
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(f"{label} must be a finite number >= 0, got {value!r}")
        self.role = role
        self.overlap_weight = float(overlap_weight)
        self.load_weight = float(load_weight)

    @staticmethod
    def param_schema() -> dict[str, Any]:
        return {
            "overlap_weight": {
                "type": "number",
                "minimum": 0,
                "default": 1.0,
                "description": "Cost per prefix page the worker does not hold and would prefill.",
            },
            "load_weight": {
                "type": "number",
                "minimum": 0,
                "default": 1.0,
                "description": "Cost per unit of load (outstanding requests per execution slot).",
            },
        }

    def cost(self, request: BalanceRequest, candidate: Candidate) -> float:
        """The cost of sending ``request`` to ``candidate``; lower is better."""
        total = len(request.prefix_pages)
        uncached = total - min(candidate.cached_prefix_pages, total)
        return self.overlap_weight * uncached + self.load_weight * candidate.load

    def choose(self, request: BalanceRequest, candidates: Sequence[Candidate]) -> str:
        ordered = _sorted(candidates, self.role)
        return min(ordered, key=lambda c: (self.cost(request, c), c.outstanding, c.worker_id)).worker_id


_POLICIES: Mapping[str, Any] = MappingProxyType(
    {
        cls.name: cls
        for cls in (RoundRobin, RandomChoice, LeastOutstanding, PowerOfTwoChoices, ConsistentHash, KVAware)
    }
)

POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)
"""Every name ``make_policy`` accepts, in a stable order."""


def _policy_class(name: str) -> Any:
    try:
        return _POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown balancing policy {name!r}; valid names: {', '.join(POLICY_NAMES)}"
        ) from None


def policy_param_schema(name: str) -> dict[str, Any]:
    """A JSON Schema (draft 2020-12) of ``name``'s parameters, as ``make_policy`` takes them.

    ``role`` is not in it: the caller supplies the role, not the user. Returns a fresh dict the
    caller may modify. Raises ``ValueError`` for an unknown name.
    """
    cls = _policy_class(name)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": name,
        "description": (cls.__doc__ or "").strip().split("\n\n")[0],
        "type": "object",
        "properties": cls.param_schema(),
        "additionalProperties": False,
    }


def make_policy(name: str, *, role: str, **params: Any) -> Policy:
    """A new policy ``name`` for ``role`` with ``params`` (validated against its schema).

    Raises ``ValueError`` listing the valid names for an unknown name, and listing every
    problem for invalid params.
    """
    cls = _policy_class(name)
    validator = jsonschema.Draft202012Validator(policy_param_schema(name))
    errors = sorted(validator.iter_errors(params), key=lambda e: list(e.path))
    if errors:
        details = "; ".join(f"{'.'.join(str(p) for p in e.path) or '<params>'}: {e.message}" for e in errors)
        raise ValueError(f"invalid parameters for policy {name!r}: {details}")
    return cls(role=role, **params)
