"""The workflow DSL: build a GraphSpec in Python.

    from engine.flow.dsl import Workflow

    wf = Workflow("diamond", description="square and cube, summed")
    py = wf.role("py", kind="python")
    n = wf.input("n", "json", default=6)
    square = wf.python(square_fn, role=py)          # ports from the op, or the signature
    wf.edge(n, square.inp("x"))
    wf.output("total", square)

A function decorated with `@op(name)` (`engine.spec.ops`) is recorded by its registered name
(`op="diamond.square"`) and gives the node its ports; any other function is recorded as
`module:function` (a function at its module's top level), which only trusted runs (the command
line) may execute.

A node of a kind that fixes its ports (e.g. `llm`, `llm.prefill`, `llm.decode`) gets them
from the kind catalogue when none are given:

    llm = wf.role("llm", kind="llm", model="tiny-llama")
    gen = wf.node("gen", "llm", role=llm, params={"max_new_tokens": 32})
    wf.edge(prompt, gen.inp("prompt"))

Everything the DSL builds is plain data: `to_spec()` returns the GraphSpec, and
`engine.flow.pysrc.to_python` writes any GraphSpec back as DSL source.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.spec.calls import Route
from engine.spec.graph import SPEC_VERSION, EdgeSpec, GraphSpec, NodeSpec, PortSpec, RoleSpec
from engine.spec.kinds import KindRegistry, default_kinds
from engine.spec.ops import op_info

__all__ = ["Workflow", "Route", "NodeRef", "PortRef", "RoleRef"]

PortDecl = str | Mapping[str, Any] | PortSpec


def port(decl: PortDecl) -> PortSpec:
    """A PortSpec from `"json"`, `{"type": "json", "optional": True}` or a PortSpec."""
    if isinstance(decl, PortSpec):
        return decl
    if isinstance(decl, str):
        return PortSpec(type=decl)  # type: ignore[arg-type]
    return PortSpec(**dict(decl))


def _ports(decls: Mapping[str, PortDecl] | None) -> dict[str, PortSpec]:
    return {name: port(d) for name, d in (decls or {}).items()}


@dataclass(frozen=True, slots=True)
class RoleRef:
    name: str


@dataclass(frozen=True, slots=True)
class PortRef:
    node: str
    port: str
    direction: str  # "in" | "out"

    def __str__(self) -> str:
        return f"{self.node}.{self.port}"


@dataclass(frozen=True, slots=True)
class NodeRef:
    id: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def out(self, name: str | None = None) -> PortRef:
        """An output port; the name may be left out when there is only one."""
        return PortRef(self.id, _pick(self.id, name, self.outputs, "output"), "out")

    def inp(self, name: str | None = None) -> PortRef:
        """An input port; the name may be left out when there is only one."""
        return PortRef(self.id, _pick(self.id, name, self.inputs, "input"), "in")


def _pick(node: str, name: str | None, ports: tuple[str, ...], what: str) -> str:
    if name is not None:
        if name not in ports:
            raise ValueError(f"node {node!r} has no {what} port {name!r} ({what}s: {list(ports) or 'none'})")
        return name
    if len(ports) != 1:
        raise ValueError(f"node {node!r} has {what} ports {list(ports)}: name the one you mean")
    return ports[0]


_TEXT_ANNOTATIONS = {str, "str"}


def _function_ref(fn: Callable[..., Any] | str) -> str:
    if isinstance(fn, str):
        return fn
    info = op_info(fn)
    if info is not None:
        return info.name
    module = fn.__module__
    if module == "__main__":
        raise ValueError(f"{fn.__qualname__} lives in __main__; put it in an importable module")
    if "." in fn.__qualname__:
        raise ValueError(f"{module}:{fn.__qualname__} is not a function of its module: a module op names one"
                         " (define it at the module's top level, or register it with @op)")
    return f"{module}:{fn.__qualname__}"


class Workflow:
    """A workflow under construction. Every call checks what it can locally (unknown
    ports, duplicate ids); the whole graph is checked by `engine.flow.validate`."""

    def __init__(self, name: str, *, description: str = "", meta: Mapping[str, Any] | None = None,
                 kinds: KindRegistry | None = None) -> None:
        self.name = name
        self.description = description
        self.meta = dict(meta or {})
        self._kinds = kinds  # the catalogue fixed ports come from; built on first need
        self._roles: dict[str, RoleSpec] = {}
        self._nodes: dict[str, NodeSpec] = {}
        self._edges: list[EdgeSpec] = []

    # ------------------------------------------------------------------ roles
    def role(
        self,
        name: str,
        kind: str = "python",
        *,
        model: str | None = None,
        replicas: int = 1,
        tp_size: int = 1,
        device: str = "cpu",
        balance: str = "round_robin",
        balance_params: Mapping[str, Any] | None = None,
        resources: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> RoleRef:
        if name in self._roles:
            raise ValueError(f"role {name!r} is already declared")
        self._roles[name] = RoleSpec(
            name=name,
            kind=kind,
            model=model,
            replicas=replicas,
            tp_size=tp_size,
            device=device,
            balance=balance,
            balance_params=dict(balance_params or {}),
            resources=dict(resources or {}),
            params=dict(params or {}),
        )
        return RoleRef(name)

    # ------------------------------------------------------------------ nodes
    def node(
        self,
        id: str,
        kind: str,
        *,
        role: RoleRef | str | None = None,
        op: Callable[..., Any] | str | None = None,
        params: Mapping[str, Any] | None = None,
        inputs: Mapping[str, PortDecl] | None = None,
        outputs: Mapping[str, PortDecl] | None = None,
        trigger: Sequence[Sequence[NodeRef | str]] | None = None,
        routes: Sequence[NodeRef | str] | None = None,
        stream: bool = False,
        max_iterations: int | None = None,
        retries: int = 0,
        timeout_s: float | None = None,
        description: str = "",
    ) -> NodeRef:
        """Add a node of any kind. Ports left out (None) are the kind's fixed ports, if it has any."""
        if id in self._nodes:
            raise ValueError(f"node id {id!r} is already used")
        if inputs is None or outputs is None:
            fixed = self._fixed_ports(kind)
            inputs = fixed[0] if inputs is None else inputs
            outputs = fixed[1] if outputs is None else outputs
        spec = NodeSpec(
            id=id,
            kind=kind,
            role=role.name if isinstance(role, RoleRef) else role,
            op=None if op is None else _function_ref(op),
            params=dict(params or {}),
            inputs=_ports(inputs),
            outputs=_ports(outputs),
            trigger=None if trigger is None else [[_id(m) for m in group] for group in trigger],
            routes=None if routes is None else [_id(r) for r in routes],
            stream=stream,
            max_iterations=max_iterations,
            retries=retries,
            timeout_s=timeout_s,
            description=description,
        )
        self._nodes[id] = spec
        return NodeRef(id, tuple(spec.inputs), tuple(spec.outputs))

    def _fixed_ports(self, kind: str) -> tuple[dict[str, PortSpec] | None, dict[str, PortSpec] | None]:
        if self._kinds is None:
            self._kinds = default_kinds()
        if not self._kinds.has_node_kind(kind):
            return None, None  # validation names the unknown kind
        spec = self._kinds.node_kind(kind)
        return spec.inputs, spec.outputs

    def python(
        self,
        fn: Callable[..., Any],
        *,
        role: RoleRef | str,
        id: str | None = None,
        inputs: Mapping[str, PortDecl] | None = None,
        outputs: Mapping[str, PortDecl] | None = None,
        params: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> NodeRef:
        """A `python` node calling `fn`. Unless given, the ports are those of `fn`'s `OpInfo`
        (less any named in `params`) for an `@op` function; for any other function input ports
        come from the signature (`str` parameters are `text`, others `json`; parameters with
        defaults are optional; `ctx` and params are not ports) and the output is one `json`
        port named `out`."""
        params = dict(params or {})
        info = op_info(fn)
        if info is not None:
            if inputs is None:
                inputs = {name: p for name, p in info.inputs.items() if name not in params}
            if outputs is None:
                outputs = dict(info.outputs)
        if inputs is None:
            inputs = {}
            for name, p in inspect.signature(fn).parameters.items():
                if name == "ctx" or name in params or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                    continue
                ptype = "text" if p.annotation in _TEXT_ANNOTATIONS else "json"
                inputs[name] = {"type": ptype, "optional": True} if p.default is not p.empty else ptype
        return self.node(
            id or fn.__name__,
            "python",
            role=role,
            op=fn,
            params=params,
            inputs=inputs,
            outputs=outputs if outputs is not None else {"out": "json"},
            **options,
        )

    def input(self, name: str, type: str = "json", *, default: Any = inspect.Parameter.empty,
              description: str = "", example: str | None = None) -> NodeRef:
        """A workflow input named `name`, with an optional default value; `example`: what a run form
        pre-fills for a person to edit instead of the default (runs never read it)."""
        params = {} if default is inspect.Parameter.empty else {"default": default}
        if example is not None:
            params["example"] = example
        return self.node(name, "input", outputs={"value": type}, params=params, description=description)

    def output(self, name: str, source: NodeRef | PortRef | str, type: str = "any", *,
               description: str = "") -> NodeRef:
        """A workflow output named `name`, fed from `source`."""
        ref = self.node(name, "output", inputs={"value": type}, description=description)
        self.edge(source, ref.inp("value"))
        return ref

    # ------------------------------------------------------------------ edges
    def edge(self, source: NodeRef | PortRef | str, target: NodeRef | PortRef | str, *, stream: bool = False) -> None:
        """Connect an output port to an input port ("node.port" strings work too)."""
        src = self._port(source, "out")
        dst = self._port(target, "in")
        self._edges.append(EdgeSpec(source=src.node, source_port=src.port, target=dst.node,
                                    target_port=dst.port, stream=stream))

    def _port(self, ref: NodeRef | PortRef | str, direction: str) -> PortRef:
        if isinstance(ref, PortRef):
            if ref.direction != direction:
                raise ValueError(f"{ref} is an {'input' if ref.direction == 'in' else 'output'} port")
            return ref
        if isinstance(ref, NodeRef):
            return ref.out() if direction == "out" else ref.inp()
        node, sep, name = ref.rpartition(".")
        if not sep:
            node, name = ref, ""
        if node not in self._nodes:
            raise ValueError(f"{ref!r}: no node {node!r}")
        spec = self._nodes[node]
        ports = tuple(spec.outputs if direction == "out" else spec.inputs)
        return PortRef(node, _pick(node, name or None, ports, "output" if direction == "out" else "input"), direction)

    # ----------------------------------------------------------------- result
    def to_spec(self) -> GraphSpec:
        return GraphSpec(
            version=SPEC_VERSION,
            name=self.name,
            description=self.description,
            roles=list(self._roles.values()),
            nodes=list(self._nodes.values()),
            edges=list(self._edges),
            meta=dict(self.meta),
        )


def _id(ref: NodeRef | str) -> str:
    return ref.id if isinstance(ref, NodeRef) else ref
