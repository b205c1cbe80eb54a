"""Write a GraphSpec as Python DSL source.

The source rebuilds exactly the same spec: `to_python` followed by loading the module
is the identity on GraphSpecs (tested on every workflow in `workflows/`).
"""

from __future__ import annotations

from typing import Any

from engine.spec.graph import GraphSpec, NodeSpec, PortSpec, RoleSpec

_WIDTH = 100


def _lit(value: Any) -> str:
    """A Python literal for a JSON value."""
    return repr(value)


def _port(spec: PortSpec) -> str:
    if spec == PortSpec(type=spec.type):
        return _lit(spec.type)
    fields: dict[str, Any] = {"type": spec.type}
    if spec.optional:
        fields["optional"] = True
    if spec.join is not None:
        fields["join"] = spec.join
    if spec.description:
        fields["description"] = spec.description
    return _lit(fields)


def _ports(ports: dict[str, PortSpec]) -> str:
    return "{" + ", ".join(f"{_lit(name)}: {_port(p)}" for name, p in ports.items()) + "}"


def _call(func: str, args: list[str], kwargs: list[tuple[str, str]]) -> str:
    parts = args + [f"{k}={v}" for k, v in kwargs]
    line = f"{func}({', '.join(parts)})"
    if len(line) <= _WIDTH:
        return line
    return f"{func}(\n" + "".join(f"    {p},\n" for p in parts) + ")"


def _role(role: RoleSpec) -> str:
    default = RoleSpec(name=role.name, kind=role.kind)
    kwargs = [("kind", _lit(role.kind))]
    for field in ("model", "replicas", "tp_size", "device", "balance", "balance_params", "resources", "params"):
        value = getattr(role, field)
        if value != getattr(default, field):
            kwargs.append((field, _lit(value)))
    return _call("wf.role", [_lit(role.name)], kwargs)


def _node(node: NodeSpec) -> str:
    default = NodeSpec(id=node.id, kind=node.kind)
    kwargs: list[tuple[str, str]] = []
    for field in ("role", "op", "params", "inputs", "outputs", "trigger", "routes", "stream", "max_iterations",
                  "retries", "timeout_s", "description"):
        value = getattr(node, field)
        if value == getattr(default, field):
            continue
        kwargs.append((field, _ports(value) if field in ("inputs", "outputs") else _lit(value)))
    return _call("wf.node", [_lit(node.id), _lit(node.kind)], kwargs)


def to_python(spec: GraphSpec) -> str:
    """DSL source that rebuilds `spec`; the module's `workflow` is the Workflow."""
    head = [f'"""{spec.name}: generated from its GraphSpec by Omni-Flow."""', "",
            "from engine.flow.dsl import Workflow", ""]
    kwargs = []
    if spec.description:
        kwargs.append(("description", _lit(spec.description)))
    if spec.meta:
        kwargs.append(("meta", _lit(spec.meta)))
    body = ["wf = " + _call("Workflow", [_lit(spec.name)], kwargs)]
    body += [_role(r) for r in spec.roles]
    body += [_node(n) for n in spec.nodes]
    for e in spec.edges:
        extra = ", stream=True" if e.stream else ""
        body.append(f"wf.edge({_lit(f'{e.source}.{e.source_port}')}, {_lit(f'{e.target}.{e.target_port}')}{extra})")
    body += ["", "workflow = wf", ""]
    return "\n".join(head + body)
