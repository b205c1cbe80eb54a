"""How a node execution is handed to a compute unit and what comes back.

A compute unit (`engine.compute.*`) receives a `NodeCall` and either returns a
`NodeResult` or, for a streaming node, yields `Frame`s. Input values are plain Python
values (or, for stream-mode ports, async iterators of frames' values).

A call carries its run's tenant (`NodeCall.tenant`): whoever submits the run says whose it is
(the studio: the owning user, or a deployment's sharing scope), never the graph. Every unit that
keeps a cache across calls keys it by the tenant (page keys, prefix tree roots, sessions), so one
tenant's cached state is never a hit for another's call. It carries its run's owner too
(`NodeCall.owner`): whose folder its output folder names are relative to (`engine.spec.userfiles`).

A call is its `CallHeader` (what the node is and what it is asked) and its input values; the
header travels to a role worker as one struct inside the wire's `ExecuteRequest`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

import msgspec

SessionKey = NewType("SessionKey", str)
"""Where a session lives in a unit: a session id within its tenant (`session_key`)."""


@dataclass(frozen=True, slots=True)
class Route:
    """A router node's decision: run the successors in `to` and skip its other routes.

    `value` is the node's result, mapped to output ports as a normal return value is.
    """

    to: tuple[str, ...]
    value: Any = None

    def __init__(self, to: str | Sequence[str], value: Any = None) -> None:
        object.__setattr__(self, "to", (to,) if isinstance(to, str) else tuple(to))
        object.__setattr__(self, "value", value)


@dataclass(frozen=True, slots=True)
class RanOn:
    """Where a node execution ran: the worker that took it and that worker's host."""

    worker: str
    host: str


@dataclass(slots=True)
class NodeContext:
    """What a running node may ask of the executor. Passed to functions that take `ctx`."""

    run_id: str
    node_id: str
    iteration: int
    attempt: int
    report_progress: Callable[[float | None, str], None] = field(repr=False)

    def progress(self, fraction: float | None = None, message: str = "") -> None:
        """Report progress (0..1, or None when unknown) with a short message."""
        self.report_progress(fraction, message)


class CallHeader(msgspec.Struct, frozen=True):
    """A node call apart from its input values (see `NodeCall` for the fields)."""

    run_id: str
    node_id: str
    op: str | None
    params: dict[str, Any]
    output_ports: tuple[str, ...]
    stream: bool
    router: bool
    iteration: int
    attempt: int
    tenant: str | None = None
    kind: str | None = None
    owner: str | None = None


@dataclass(frozen=True, slots=True)
class NodeCall:
    run_id: str
    node_id: str
    op: str | None
    params: dict[str, Any]
    inputs: dict[str, Any]
    output_ports: tuple[str, ...]
    stream: bool
    router: bool
    iteration: int
    attempt: int
    tenant: str | None = None
    """Whose run this is: the salt of every cache the call reads or fills (`node_tenant`).
    None: no tenant (one person's own runs)."""
    kind: str | None = None
    """The node's kind (`llm`, `python`, ...), as the graph says; None where the caller did not."""
    owner: str | None = None
    """Whose folder the node's output folder names are relative to (`engine.spec.userfiles`: the
    writing process resolves them under its own users root). None: no owner (the command line);
    the names stay as they are."""

    @property
    def call_id(self) -> str:
        """The call's id, one format wherever a call is named (a dispatcher's balancing request,
        a unit's engine requests): `run/node/iteration/attempt`."""
        return f"{self.run_id}/{self.node_id}/{self.iteration}/{self.attempt}"

    def header(self) -> CallHeader:
        return CallHeader(self.run_id, self.node_id, self.op, self.params, self.output_ports, self.stream,
                          self.router, self.iteration, self.attempt, self.tenant, self.kind, self.owner)

    @classmethod
    def of(cls, header: CallHeader, inputs: dict[str, Any]) -> NodeCall:
        """The call `header` describes, with `inputs`."""
        return cls(header.run_id, header.node_id, header.op, header.params, inputs, header.output_ports,
                   header.stream, header.router, header.iteration, header.attempt, header.tenant, header.kind,
                   header.owner)

    def session_key(self) -> SessionKey | None:
        """The key of the session the call is a turn of (its `session` param, a string, within
        its tenant), or None when it is not a session turn."""
        session = self.params.get("session")
        return session_key(self.tenant, session) if isinstance(session, str) else None


def node_tenant(run_tenant: str | None, params: Mapping[str, Any]) -> str | None:
    """The tenant a node's calls run as: the run's when it has one (a server set it; a `tenant`
    param of the node counts for nothing then, so a graph never picks another's cache), else
    the node's own `tenant` param (the command line: a person namespacing their own runs)."""
    if run_tenant is not None:
        return run_tenant
    param = params.get("tenant")
    return param if isinstance(param, str) else None


def session_key(tenant: str | None, session: str) -> SessionKey:
    """The key of session `session` of `tenant`: two tenants' sessions of one id are two
    sessions (the pair is encoded, so no tenant and id make another pair's key). Without a
    tenant it is the id itself, so the command line's ids stay as they were; a run without a
    tenant comes only from whoever submits runs unscoped (never the studio, which scopes every run)."""
    if tenant is None:
        return SessionKey(session)
    return SessionKey(json.dumps([tenant, session], separators=(",", ":")))


@dataclass(frozen=True, slots=True)
class NodeResult:
    outputs: dict[str, Any]
    route: tuple[str, ...] | None = None


class FinalNodeError(Exception):
    """A node failure that trying again cannot mend: the executor does not retry it, whatever
    the node's `retries` (e.g. a node that brings down every worker it is sent to)."""


class NodeOutputError(ValueError):
    """A unit's result does not fit the node's declared output ports."""


def map_outputs(value: Any, output_ports: tuple[str, ...], node_id: str) -> dict[str, Any]:
    """Map a function's return (or yielded) value onto the node's output ports.

    One port: the value is that port's value. Several: the value must be a dict with
    exactly those keys. No ports: the value must be None.
    """
    if not output_ports:
        if value is not None:
            raise NodeOutputError(f"node {node_id!r} has no output ports but returned {type(value).__name__}")
        return {}
    if len(output_ports) == 1:
        return {output_ports[0]: value}
    if not isinstance(value, dict):
        raise NodeOutputError(
            f"node {node_id!r} has output ports {list(output_ports)} and must return a dict with"
            f" those keys, not {type(value).__name__}"
        )
    missing = [p for p in output_ports if p not in value]
    extra = [k for k in value if k not in output_ports]
    if missing or extra:
        raise NodeOutputError(
            f"node {node_id!r} returned keys {sorted(value)}; expected {list(output_ports)}"
            + (f" (missing {missing})" if missing else "")
            + (f" (unknown {extra})" if extra else "")
        )
    return dict(value)


def map_frame(value: Any, output_ports: tuple[str, ...], node_id: str) -> dict[str, Any]:
    """Map one yielded frame: like `map_outputs`, but a frame may carry a subset of ports."""
    if len(output_ports) == 1:
        return {output_ports[0]: value}
    if not isinstance(value, dict) or any(k not in output_ports for k in value):
        raise NodeOutputError(
            f"node {node_id!r} yielded {type(value).__name__}; a frame of a node with ports"
            f" {list(output_ports)} is a dict with some of those keys"
        )
    return dict(value)


class ComputeUnit:
    """What every compute unit provides; constructed from its `RoleSpec` by the runner
    named in its role kind. Units are owned by one dispatcher and closed by it."""

    async def execute(self, call: NodeCall, ctx: NodeContext) -> NodeResult:
        raise NotImplementedError

    def execute_stream(self, call: NodeCall, ctx: NodeContext) -> AsyncIterator[dict[str, Any]]:
        """Yield frames (port -> value dicts) of a streaming node."""
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        """Counters and gauges for the worker's heartbeats (plain numbers). Called from
        the worker's liveness thread: read, never block."""
        return {}

    def refused(self) -> int:
        """Connections refused so far by server sockets the unit itself opened (a seat on the
        transfer plane of its own, a tensor-parallel replica's link and what its follower ranks
        report): the worker adds them to its own (`plane.refused`). Called from the worker's
        liveness thread: read, never block."""
        return 0

    def health(self) -> str | None:
        """Why this unit can serve no more calls (its engine thread died, its tensor-parallel
        group broke), or None. Called from the worker's liveness thread each heartbeat: read,
        never block. A worker whose unit gives a reason stops, so that it can be replaced."""
        return None

    async def close(self) -> None:
        return None
