"""GraphSpec validation: every problem at once, each naming its node, edge, port or role.

`parse_spec` checks a raw document against the JSON Schema and decodes it;
`check_spec` checks the meaning of a decoded spec against the kind catalogue (and, given an
`OpConfig`, its python nodes' ops: `op_unknown`, `op_not_allowed`, their params against the op's
schema; each role's model: `model_missing` where its kind needs one and, given a `CheckpointLookup`,
`model_unknown` for a name that is neither one of the kind's built-in models nor a checkpoint).
Its wiring checks include `dangling_port` (a required input with no edge) and `missing_input` (a
node wiring none of a choice of inputs its kind needs one of, such as an llm node's prompt).
Both report all issues they find rather than stopping at the first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any

import jsonschema
import msgspec

from engine.flow.balance import POLICY_NAMES
from engine.flow.topology import Topology, reachable_from_roots, topology
from engine.spec.graph import GraphSpec, NodeSpec, json_schema
from engine.spec.jsonpath import json_path
from engine.spec.kinds import KindRegistry, NodeKind, RoleKind
from engine.spec.ops import OpConfig, OpNotAllowedError
from engine.spec.resources import ResourcesError, role_resources


@dataclass(frozen=True, slots=True)
class Issue:
    """One validation problem. `code` is stable for programs; `message` is for people."""

    code: str
    message: str
    node: str | None = None
    edge: str | None = None
    port: str | None = None
    role: str | None = None
    path: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


class GraphValidationError(ValueError):
    """A GraphSpec is invalid; `issues` lists every problem found."""

    def __init__(self, issues: list[Issue]) -> None:
        self.issues = issues
        lines = "\n".join(f"  - {i.message}" for i in issues)
        super().__init__(f"invalid workflow ({len(issues)} problem{'s' if len(issues) != 1 else ''}):\n{lines}")


@cache
def _schema_validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json_schema())


def _named(data: dict[str, Any], path: list[Any], section: str, key: str) -> str | None:
    """The id (`key`) of the `section` entry a schema error's `path` lies in, if it has one."""
    if len(path) < 2 or path[0] != section or not isinstance(path[1], int):
        return None
    items = data.get(section)
    item = items[path[1]] if isinstance(items, list) and path[1] < len(items) else None
    value = item.get(key) if isinstance(item, dict) else None
    return value if isinstance(value, str) else None


def parse_spec(document: bytes | str | dict[str, Any]) -> GraphSpec:
    """Decode a GraphSpec document; raise GraphValidationError listing every schema error."""
    if isinstance(document, bytes | str):
        try:
            data = json.loads(document)
        except json.JSONDecodeError as exc:
            raise GraphValidationError(
                [Issue("malformed_json", f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")]
            ) from None
    else:
        data = document
    if not isinstance(data, dict):
        raise GraphValidationError([Issue("schema", "a GraphSpec is a JSON object", path="$")])
    issues = []
    for err in sorted(_schema_validator().iter_errors(data), key=lambda e: list(map(str, e.absolute_path))):
        path = list(err.absolute_path)
        node = _named(data, path, "nodes", "id")
        role = _named(data, path, "roles", "name")
        where = f"node {node!r}: " if node else f"role {role!r}: " if role else ""
        issues.append(Issue("schema", f"{where}{json_path(path)}: {err.message}", node=node, role=role,
                            path=json_path(path)))
    if issues:
        raise GraphValidationError(issues)
    try:
        return msgspec.convert(data, GraphSpec)
    except msgspec.ValidationError as exc:
        raise GraphValidationError([Issue("schema", str(exc))]) from None


def _compatible(source: str, target: str) -> bool:
    return source == target or "any" in (source, target)


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")

CheckpointLookup = Callable[[str], bool]
"""Whether a role's `model` names a checkpoint folder this process can load (a studio: one under
its model roots)."""


def check_spec(spec: GraphSpec, kinds: KindRegistry, ops: OpConfig | None = None,
               checkpoints: CheckpointLookup | None = None) -> list[Issue]:
    """Every semantic problem of a decoded spec; an empty list when it is valid. `ops`: also check
    that each python node's op may run there (None: ops are not checked). `checkpoints`: also check
    that each role's model is a built-in one of its kind or a checkpoint (None: only that a kind
    needing a model has one)."""
    issues: list[Issue] = []
    add = issues.append
    if not spec.nodes:
        add(Issue("empty", "the workflow has no nodes"))
    roles = _check_roles(spec, kinds, checkpoints, add)
    _check_resources(spec, add)
    nodes = _check_nodes(spec, kinds, roles, ops, add)
    topo = topology(spec)
    incoming = _check_edges(spec, nodes, add)
    _check_wiring(nodes, kinds, incoming, topo, add)
    _check_cycles(nodes, topo, add)
    return issues


def _check_roles(spec: GraphSpec, kinds: KindRegistry, checkpoints: CheckpointLookup | None,
                 add: Callable[[Issue], None]) -> dict[str, Any]:
    """The roles by name (the first of a duplicated name), each checked against its kind."""
    roles: dict[str, Any] = {}
    for role in spec.roles:
        if role.name in roles:
            add(Issue("duplicate_id", f"role {role.name!r} is declared twice", role=role.name))
            continue
        roles[role.name] = role
        if not kinds.has_role_kind(role.kind):
            known = ", ".join(k.name for k in kinds.role_kinds)
            add(Issue("unknown_role_kind", f"role {role.name!r} has unknown kind {role.kind!r} (known: {known})",
                      role=role.name))
        else:
            for err in jsonschema.Draft202012Validator(kinds.role_kind(role.kind).params_schema).iter_errors(
                role.params
            ):
                add(Issue("bad_param", f"role {role.name!r}: {json_path(err.absolute_path, root='params')}: {err.message}",
                          role=role.name))
            _check_model(role, kinds.role_kind(role.kind), checkpoints, add)
        if role.tp_size > 1 and kinds.has_role_kind(role.kind):
            role_kind = kinds.role_kind(role.kind)
            if role_kind.tensor_parallel is None or role_kind.tp_runner is None:  # as the catalogue says
                add(Issue("tp_unsupported", f"role {role.name!r}: tp_size {role.tp_size}, but role kind"
                          f" {role.kind!r} cannot shard over tensor-parallel ranks (use tp_size 1)", role=role.name))
            else:
                for problem in role_kind.tp_problems(role.model, role.tp_size):
                    add(Issue("tp_indivisible", f"role {role.name!r}: tp_size {role.tp_size}: {problem}",
                              role=role.name))
        if role.balance not in POLICY_NAMES:
            add(Issue("unknown_policy", f"role {role.name!r} names unknown load-balancing policy {role.balance!r}"
                      f" (known: {', '.join(POLICY_NAMES)})", role=role.name))
    return roles


def _check_nodes(spec: GraphSpec, kinds: KindRegistry, roles: dict[str, Any], ops: OpConfig | None,
                 add: Callable[[Issue], None]) -> dict[str, NodeSpec]:
    """The nodes by id (the first of a duplicated id), each checked against its kind (and op)."""
    nodes: dict[str, NodeSpec] = {}
    for node in spec.nodes:
        if node.id in nodes:
            add(Issue("duplicate_id", f"node id {node.id!r} is used twice", node=node.id))
            continue
        nodes[node.id] = node
        if not kinds.has_node_kind(node.kind):
            add(Issue("unknown_kind", f"node {node.id!r} has unknown kind {node.kind!r}", node=node.id))
            continue
        kind = kinds.node_kind(node.kind)
        _check_node(node, kind, roles, kinds, add)
        if ops is not None and kind.name == "python" and node.op:
            _check_op(node, ops, add)
    return nodes


def _check_edges(spec: GraphSpec, nodes: dict[str, NodeSpec],
                 add: Callable[[Issue], None]) -> dict[tuple[str, str], list[str]]:
    """Each edge's ends, ports, types and stream mode; the edges into each (node, input port)."""
    seen_edges: set[str] = set()
    incoming: dict[tuple[str, str], list[str]] = {}
    for edge in spec.edges:
        eid = edge.id
        if eid in seen_edges:
            add(Issue("duplicate_edge", f"edge {eid} is declared twice", edge=eid))
            continue
        seen_edges.add(eid)
        src, dst = nodes.get(edge.source), nodes.get(edge.target)
        if src is None:
            add(Issue("unknown_node", f"edge {eid}: no node {edge.source!r}", edge=eid, node=edge.source))
        if dst is None:
            add(Issue("unknown_node", f"edge {eid}: no node {edge.target!r}", edge=eid, node=edge.target))
        if src is None or dst is None:
            continue
        out = src.outputs.get(edge.source_port)
        inp = dst.inputs.get(edge.target_port)
        if out is None:
            add(Issue("unknown_port", f"edge {eid}: node {src.id!r} has no output port {edge.source_port!r}"
                      f" (outputs: {', '.join(src.outputs) or 'none'})", edge=eid, node=src.id, port=edge.source_port))
        if inp is None:
            add(Issue("unknown_port", f"edge {eid}: node {dst.id!r} has no input port {edge.target_port!r}"
                      f" (inputs: {', '.join(dst.inputs) or 'none'})", edge=eid, node=dst.id, port=edge.target_port))
        if out is None or inp is None:
            continue
        incoming.setdefault((dst.id, edge.target_port), []).append(eid)
        if not _compatible(out.type, inp.type):
            add(Issue("type_mismatch", f"edge {eid}: output {src.id}.{edge.source_port} is {out.type} but input"
                      f" {dst.id}.{edge.target_port} expects {inp.type}", edge=eid, node=dst.id, port=edge.target_port))
        if edge.stream and not src.stream:
            add(Issue("not_a_stream", f"edge {eid} subscribes to a stream but node {src.id!r} does not stream"
                      " (set stream=True on it, or make the edge a plain one)", edge=eid, node=src.id))
        if edge.stream and inp.join is not None:
            add(Issue("stream_join", f"edge {eid}: port {dst.id}.{edge.target_port} gathers with join"
                      f" {inp.join!r}, so it cannot also subscribe in stream mode", edge=eid, node=dst.id,
                      port=edge.target_port))
        if src.stream and not edge.stream and inp.join not in ("ordered", "dynamic"):
            add(Issue("stream_needs_join", f"edge {eid}: node {src.id!r} streams frames; subscribe in stream"
                      f" mode or give port {dst.id}.{edge.target_port} join 'ordered' or 'dynamic'", edge=eid,
                      node=dst.id, port=edge.target_port))
    return incoming


def _check_wiring(nodes: dict[str, NodeSpec], kinds: KindRegistry, incoming: dict[tuple[str, str], list[str]],
                  topo: Topology, add: Callable[[Issue], None]) -> None:
    """Required inputs connected, and one of each of the kind's input choices; triggers name
    predecessors and routes successors."""
    for node in nodes.values():
        for port, pspec in node.inputs.items():
            if (node.id, port) not in incoming and not pspec.optional:
                add(Issue("dangling_port", f"input port {node.id}.{port} is not connected (connect it or mark it"
                          " optional)", node=node.id, port=port))
        for choice in kinds.node_kind(node.kind).needs if kinds.has_node_kind(node.kind) else ():
            # A port of the choice the node itself makes required is wired or already dangling.
            required = any(port in node.inputs and not node.inputs[port].optional for port in choice.ports)
            if not required and not any((node.id, port) in incoming for port in choice.ports):
                ports = " or ".join(f"{node.id}.{port}" for port in choice.ports)
                add(Issue("missing_input", f"node {node.id!r} needs {choice.what}: connect its input port {ports}",
                          node=node.id, port=choice.ports[0]))
        preds = set(topo.preds.get(node.id, ()))
        succs = set(topo.succs.get(node.id, ()))
        for group in node.trigger or ():
            if not group:
                add(Issue("bad_trigger", f"node {node.id!r} has an empty trigger group", node=node.id))
            for member in group:
                if member not in preds:
                    add(Issue("trigger_not_predecessor", f"node {node.id!r}: trigger names {member!r}, which has"
                              f" no edge into {node.id!r}", node=node.id))
        for target in node.routes or ():
            if target not in succs:
                add(Issue("route_not_successor", f"router {node.id!r} names {target!r}, which is not one of its"
                          f" successors ({', '.join(sorted(succs)) or 'none'})", node=node.id))


def _check_cycles(nodes: dict[str, NodeSpec], topo: Topology, add: Callable[[Issue], None]) -> None:
    """Every cycle bounded; every node reachable from a root."""
    for index in sorted(topo.cyclic):
        members = topo.components[index]
        if not any(nodes[m].max_iterations for m in members if m in nodes):
            loop = " -> ".join((*members, members[0]))
            add(Issue("unbounded_cycle", f"cycle {loop} has no bound: set max_iterations on one of its nodes",
                      node=members[0]))
    if nodes:
        reached = reachable_from_roots(topo)
        for node_id in topo.nodes:
            if node_id not in reached:
                add(Issue("unreachable", f"node {node_id!r} can never run: nothing outside its cycle leads to it",
                          node=node_id))


def _check_model(role: Any, kind: RoleKind, checkpoints: CheckpointLookup | None, add) -> None:
    """A role of a kind that needs a model names one, and (with `checkpoints`) one it can load."""
    uses = kind.models
    if uses is None:
        return
    where = " or a checkpoint folder" if uses.checkpoints else ""
    if not role.model:
        if uses.required:
            names = ", ".join(m.name for m in uses.builtin_models())
            add(Issue("model_missing", f"role {role.name!r} of kind {kind.name!r} needs a model: a built-in one"
                      f" ({names or 'none'}){where}", role=role.name, path="model"))
        return
    if checkpoints is None:
        return
    builtin = [m.name for m in uses.builtin_models()]
    if role.model in builtin or (uses.checkpoints and checkpoints(role.model)):
        return
    add(Issue("model_unknown", f"role {role.name!r}: model {role.model!r} is neither a built-in model of kind"
              f" {kind.name!r} ({', '.join(builtin) or 'none'})"
              f"{' nor a checkpoint folder in the model directories' if uses.checkpoints else ''}",
              role=role.name, path="model"))


def _check_resources(spec: GraphSpec, add) -> None:
    """Each role's `resources` read (`engine.spec.resources`), and the roles of one colocate group
    asking for labels a single node can have."""
    groups: dict[str, dict[str, tuple[str, str]]] = {}  # group -> label -> (value, role asking)
    for role in spec.roles:
        try:
            wanted = role_resources(role.resources)
        except ResourcesError as exc:
            for name, message in exc.problems:
                add(Issue("bad_resources", f"role {role.name!r}: resources.{name}: {message}", role=role.name,
                          path=f"resources.{name}"))
            continue
        if wanted.colocate is None:
            continue
        labels = groups.setdefault(wanted.colocate, {})
        for name, value in wanted.labels.items():
            if name in labels and labels[name][0] != value:
                other_value, other = labels[name]
                add(Issue("colocate_conflict", f"role {role.name!r}: colocate group {wanted.colocate!r} puts it on"
                          f" one node with role {other!r}, but it asks for label {name}={value} and {other!r}"
                          f" for {name}={other_value}", role=role.name))
            else:
                labels.setdefault(name, (value, role.name))


def _check_node(node: NodeSpec, kind: NodeKind, roles: dict[str, Any], kinds: KindRegistry, add) -> None:
    if kind.role_kinds:
        if node.role is None:
            add(Issue("missing_role", f"node {node.id!r} of kind {kind.name!r} needs a role", node=node.id))
        elif node.role not in roles:
            add(Issue("unknown_role", f"node {node.id!r} names unknown role {node.role!r}", node=node.id,
                      role=node.role))
        elif roles[node.role].kind not in kind.role_kinds:
            add(Issue("role_kind_mismatch", f"node {node.id!r} of kind {kind.name!r} cannot run on role"
                      f" {node.role!r} of kind {roles[node.role].kind!r} (needs {', '.join(kind.role_kinds)})",
                      node=node.id, role=node.role))
    elif node.role is not None:
        add(Issue("unexpected_role", f"node {node.id!r} of kind {kind.name!r} runs in the executor and takes no"
                  " role", node=node.id))
    if kind.op == "required" and not node.op:
        add(Issue("missing_op", f"node {node.id!r} of kind {kind.name!r} needs an op", node=node.id,
                  path="op"))
    if kind.op == "forbidden" and node.op:
        add(Issue("unexpected_op", f"node {node.id!r} of kind {kind.name!r} takes no op", node=node.id))
    for err in jsonschema.Draft202012Validator(kind.params_schema).iter_errors(node.params):
        add(Issue("bad_param", f"node {node.id!r}: {json_path(err.absolute_path, root='params')}: {err.message}",
                  node=node.id))
    if node.kind == "input" and "default" in node.params and node.params["default"] is not None:
        if problem := input_type_problem(node, node.params["default"]):
            add(Issue("bad_default", f"node {node.id!r}: params.default: {problem}", node=node.id,
                      path="params.default"))
    for direction, fixed, declared in (("input", kind.inputs, node.inputs), ("output", kind.outputs, node.outputs)):
        for port in declared:
            if not _IDENT.match(port):
                add(Issue("bad_port_name", f"node {node.id!r}: {direction} port name {port!r} is not an identifier",
                          node=node.id, port=port))
        if fixed is None:
            continue
        # A node may leave out the kind's optional ports (graphs written before the kind grew them).
        needed = {p for p, spec in fixed.items() if not spec.optional}
        if not needed <= set(declared) <= set(fixed):
            add(Issue("wrong_ports", f"node {node.id!r} of kind {kind.name!r} must have {direction} ports"
                      f" {sorted(fixed) or 'none'}, not {sorted(declared) or 'none'}", node=node.id))
            continue
        for port, spec in declared.items():
            if fixed[port].type != "any" and spec.type != fixed[port].type:
                add(Issue("type_mismatch", f"node {node.id!r}: {direction} port {port!r} of kind {kind.name!r}"
                          f" is {fixed[port].type}, not {spec.type}", node=node.id, port=port))
    for port, spec in node.outputs.items():
        if spec.join is not None:
            add(Issue("bad_join", f"node {node.id!r}: join applies to input ports, not output {port!r}",
                      node=node.id, port=port))
    if kind.name == "python":
        for name in node.params:
            if name in node.inputs:
                add(Issue("param_shadows_port", f"node {node.id!r}: param {name!r} has the name of an input port",
                          node=node.id, port=name))
    if node.routes is not None and node.stream:
        add(Issue("stream_router", f"node {node.id!r} cannot both stream and route", node=node.id))


def _check_op(node: NodeSpec, ops: OpConfig, add) -> None:
    """The node's op is registered (its params fit the op's schema), or a `module:function` op
    where those are allowed. Imports nothing."""
    assert node.op is not None
    problem = ops.problem(node.op)
    if problem is not None:
        code = "op_not_allowed" if isinstance(problem, OpNotAllowedError) else "op_unknown"
        add(Issue(code, f"node {node.id!r}: {problem}", node=node.id, path="op"))
        return
    if node.op not in ops.registry:
        return
    schema = ops.registry.get(node.op).info.params_json_schema()
    for err in jsonschema.Draft202012Validator(schema).iter_errors(node.params):
        add(Issue("bad_param", f"node {node.id!r}: op {node.op!r}: {json_path(err.absolute_path, root='params')}:"
                  f" {err.message}", node=node.id))


def validate(spec: GraphSpec, kinds: KindRegistry, ops: OpConfig | None = None,
             checkpoints: CheckpointLookup | None = None) -> None:
    """Raise GraphValidationError when `check_spec` finds anything."""
    issues = check_spec(spec, kinds, ops, checkpoints)
    if issues:
        raise GraphValidationError(issues)


def input_type_problem(node: NodeSpec, value: Any) -> str | None:
    """Why `value` cannot be input node `node`'s value (its port type says text or tokens and the
    value is no such thing), or None. Other types are their consumers' to read."""
    port = node.outputs.get("value")
    kind = None if port is None else port.type
    if kind == "text" and not isinstance(value, str):
        return f"input {node.id!r} is text: give it a string, not {_what(value)}"
    if kind == "tokens" and not _token_ids(value):
        return f"input {node.id!r} takes tokens: give it a list of token ids (whole numbers), not {_what(value)}"
    return None


def _token_ids(value: Any) -> bool:
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # a tensor of ids, from the Python API
        return True
    return isinstance(value, list | tuple) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _what(value: Any) -> str:
    """A value's JSON kind, as a user who typed it knows it."""
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list" if not value or all(not isinstance(t, bool) and isinstance(t, int) for t in value) else \
            "a list holding other things than whole numbers"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
