"""GraphSpec handling at the studio's edge: parse, validate, read DSL source safely, diff.

Untrusted input never runs as Python here. `spec_from_source` reads DSL source (what
`engine.flow.pysrc.to_python` writes, and hand-written modules in the same style) by
walking its syntax tree: it accepts `Workflow(...)` and the `role/node/input/output/edge`
calls with literal arguments and names bound to their results, and rejects anything
else with the line it is on. Given the studio's `OpRegistry`, it also accepts
`from <module> import <function>` where that function is a registered op (looked up among the
functions the registry already holds: nothing is imported), and `wf.python(<that function>, ...)`,
so a workflow written as the README's quick start imports as it runs on the command line. (`engine.flow.loader.load_source` would `exec` the text,
which is fine for a user's own files on their own machine and not for a server.)

A `python` node names a registered op (`engine.spec.ops`): `check` reports `op_unknown` for
a name the studio's registry lacks, and `op_not_allowed` for a `module:function` op unless
`OMNIFLOW_ALLOW_MODULE_OPS` is set (a `module:function` lets its author run any code on the
server). Nothing a spec names is imported to check it.
Nor may a node set `tenant` (whose caches it uses): the server gives every run its tenant.
Nor may a workflow input be a KV reference (`kv_input_issues`, `kv_ref_paths`): a `KVRef` names
the worker address its pages are pulled from, so one written by a user would point a role worker
at any address; only an llm node of the same run makes one.

An `sglang_llm` role is reported too (`sglang_role_issues`): its HiCache backend's KV index
settings (`hicache.redis_url`, ...) are the operator's; its SGLang host pool (`hicache_ratio`
times its device pool) must have a size the quotas can count, so the role must cap its device
pool (`sglang.max_total_tokens`, `size_unbounded` on the role otherwise); and its runner serves
only runs without a tenant (one prefix cache for every caller), while every studio run has one;
saying so at validation beats a deployment whose every run fails.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import msgspec
from django.conf import settings

from engine.client.graphs import (
    CheckpointLookup,
    GraphValidationError,
    Issue,
    NodeRef,
    PortRef,
    RoleRef,
    Workflow,
    check_spec,
    parse_spec,
)
from engine.spec.graph import GraphSpec, encode_spec
from engine.spec.jsonpath import element, member
from engine.spec.kinds import KindRegistry
from engine.spec.ops import OpConfig, OpRegistry
from studio.jsonbody import JsonRefused, load_json, scan
from studio.workflows.paths import spec_path_issues


@dataclass(frozen=True, slots=True)
class CheckedSpec:
    """A decoded spec with its canonical form and every semantic/policy issue found."""

    spec: GraphSpec
    document: dict[str, Any]
    spec_hash: str
    issues: tuple[Issue, ...]

    @property
    def valid(self) -> bool:
        return not self.issues

    def issue_dicts(self) -> list[dict[str, Any]]:
        return [issue.to_dict() for issue in self.issues]


def canonical(spec: GraphSpec) -> tuple[dict[str, Any], str]:
    raw = encode_spec(spec)
    return json.loads(raw), hashlib.sha256(raw).hexdigest()


def tenant_param_issues(spec: GraphSpec) -> list[Issue]:
    """A node may not name its cache tenant here: the server gives every run its tenant (the
    owning user, or a deployment's shared scope), which the engine puts over any node param."""
    return [Issue("tenant_param", f"node {node.id!r}: param 'tenant' is set by the server (the run's owner, or"
                                  " its deployment's cache scope), not by the workflow", node=node.id)
            for node in spec.nodes if "tenant" in node.params]


def kv_ref_paths(value: Any, path: str) -> list[str]:
    """Where `value` (JSON from a user) holds something shaped as a KV reference (an object with
    `"type": "kv"`), as paths below `path`."""
    if isinstance(value, dict):
        here = [path] if value.get("type") == "kv" else []
        return here + [found for key, item in value.items() for found in kv_ref_paths(item, member(path, key))]
    if isinstance(value, list):
        return [found for index, item in enumerate(value) for found in kv_ref_paths(item, element(path, index))]
    return []


def kv_input_issues(spec: GraphSpec) -> list[Issue]:
    """An input node may not take a KV reference (a `kv` port, or a default shaped as one): its
    holder address would come from the user, and a role worker pulls pages from it."""
    issues = []
    for node in spec.nodes:
        if node.kind != "input":
            continue
        issues.extend(Issue("kv_input", f"node {node.id!r}: output {port!r} is of type 'kv'; a KV reference"
                            " comes only from an llm node of the same run, never from a run's inputs",
                            node=node.id, port=port)
                      for port, decl in node.outputs.items() if decl.type == "kv")
        issues.extend(Issue("kv_input", f"node {node.id!r}: {where} is shaped as a KV reference; a KV reference"
                            " comes only from an llm node of the same run", node=node.id, path=where)
                      for where in kv_ref_paths(node.params.get("default"), "params.default"))
    return issues


SGLANG_ROLE_KIND = "sglang_llm"
OPERATOR_HICACHE_OPTIONS = ("redis_url", "index_namespace", "worker_id", "worker_ttl_s")
"""`hicache` options of an sglang_llm role that name the operator's KV index (a Redis host, its keys)."""


def sglang_role_issues(spec: GraphSpec) -> list[Issue]:
    """Issues on each `sglang_llm` role: KV index options a workflow may not set, a host pool
    without a size (no `sglang.max_total_tokens`), and the tenant it cannot serve (SGLang 0.5.23's
    requests take a `cache_salt`, which the runner does not use yet)."""
    issues = []
    for role in spec.roles:
        if role.kind != SGLANG_ROLE_KIND:
            continue
        hicache = role.params.get("hicache")
        for option in OPERATOR_HICACHE_OPTIONS:
            if isinstance(hicache, dict) and option in hicache:
                issues.append(Issue("operator_param", f"role {role.name!r}: params.hicache.{option} is set by the"
                                    " server's operator (the KV index's Redis and keys), not by a workflow",
                                    role=role.name, path=f"params.hicache.{option}"))
        engine_params = role.params.get("sglang")
        if not (isinstance(engine_params, dict) and "max_total_tokens" in engine_params):
            issues.append(Issue("size_unbounded", f"role {role.name!r}: set params.sglang.max_total_tokens: SGLang"
                                " keeps a host pool of hicache_ratio times its device pool, which without this cap"
                                " it sizes from whatever GPU it gets, so the host memory it takes could not be"
                                " counted against your HiCache quota", role=role.name,
                                path="params.sglang.max_total_tokens"))
        issues.append(Issue("tenant_unsupported", f"role {role.name!r}: kind {SGLANG_ROLE_KIND!r} keeps one prefix"
                            " cache for every caller, so it serves only runs without a tenant (the command line);"
                            " every studio run has its tenant, so use kind 'llm' here", role=role.name, path="kind"))
    return issues


def check(spec: GraphSpec, kinds: KindRegistry, ops: OpConfig,
          checkpoints: CheckpointLookup | None = None) -> CheckedSpec:
    """`spec` canonicalised, with every problem `check_spec` finds, its ops' included (and its
    models', given `checkpoints`), nodes naming a tenant, KV inputs, sglang roles, and names that are not
    relative."""
    document, digest = canonical(spec)
    paths = spec_path_issues(spec, ops.registry)
    refused = {issue.role for issue in paths if issue.path == "model"}
    found = [issue for issue in check_spec(spec, kinds, ops, checkpoints)
             if not (issue.code == "model_unknown" and issue.role in refused)]  # said once, as path_refused
    issues = [*found, *tenant_param_issues(spec), *kv_input_issues(spec), *sglang_role_issues(spec), *paths]
    return CheckedSpec(spec=spec, document=document, spec_hash=digest, issues=tuple(issues))


def parse_document(document: Any) -> GraphSpec:
    """Decode a GraphSpec JSON value (dict, or JSON text); GraphValidationError lists every schema issue."""
    if isinstance(document, str | bytes):
        try:  # the engine's parser has no depth limit: a client's text is read with the studio's
            document = load_json(document, max_depth=settings.OMNIFLOW.max_json_depth, what="the spec")
        except JsonRefused as exc:
            raise GraphValidationError([Issue("malformed_json", exc.message)]) from None
    if isinstance(document, dict):
        return parse_spec(document)
    raise GraphValidationError([Issue("schema", "a GraphSpec is a JSON object", path="$")])


# ------------------------------------------------------------------ safe DSL source reader
class _SourceError(Exception):
    def __init__(self, node: ast.AST | None, message: str) -> None:
        line = getattr(node, "lineno", None)
        super().__init__(f"line {line}: {message}" if line else message)


_WORKFLOW_METHODS = frozenset({"role", "node", "input", "output", "edge", "python"})
_REF_METHODS = frozenset({"inp", "out"})
_ALLOWED_IMPORTS = {"engine.flow.dsl": {"Workflow", "Route"}, "__future__": {"annotations"}}


def _as_json_shapes(value: Any) -> Any:
    """A Python literal with its tuples and sets as lists, for `scan` (which walks JSON's shapes)."""
    if isinstance(value, dict):
        return {str(key): _as_json_shapes(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_as_json_shapes(item) for item in value]
    return value


class _Reader:
    def __init__(self, ops: OpRegistry | None) -> None:
        self.names: dict[str, Any] = {}
        self.workflow: Workflow | None = None
        # (module, name) -> a registered op's function: what `from module import name` may bind
        self.op_functions: dict[tuple[str, str], Any] = {} if ops is None else {
            (entry.fn.__module__, entry.fn.__qualname__): entry.fn for entry in ops.ops}

    def value(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Name):
            if node.id in self.names:
                return self.names[node.id]
            if node.id in ("True", "False", "None"):
                return ast.literal_eval(node)
            raise _SourceError(node, f"unknown name {node.id!r}")
        if isinstance(node, ast.Call):
            return self.call(node)
        try:
            literal = ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise _SourceError(node, f"only literals, names and DSL calls are allowed, not {ast.unparse(node)!r}") from None
        unfit = scan(_as_json_shapes(literal)).unfit
        if unfit is not None:  # what load_json refuses in a JSON spec: NUL, 1e400, integers past 64 bits
            raise _SourceError(node, f"the literal holds what the studio does not take: {unfit}")
        return literal

    def call(self, node: ast.Call) -> Any:
        args = [self.value(a) for a in node.args if not isinstance(a, ast.Starred)]
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            raise _SourceError(node, "*args and **kwargs are not allowed")
        kwargs = {k.arg: self.value(k.value) for k in node.keywords}
        func = node.func
        if isinstance(func, ast.Name) and func.id == "Workflow" and "Workflow" not in self.names:
            if self.workflow is not None:
                raise _SourceError(node, "only one Workflow per source")
            self.workflow = Workflow(*args, **kwargs)
            return self.workflow
        if isinstance(func, ast.Attribute):
            target = self.value(func.value)
            if isinstance(target, Workflow) and func.attr in _WORKFLOW_METHODS:
                if func.attr == "python" and not (args and args[0] in self.op_functions.values()):
                    raise _SourceError(node, "wf.python(...) takes a registered op imported from its module")
                return getattr(target, func.attr)(*args, **kwargs)
            if isinstance(target, NodeRef) and func.attr in _REF_METHODS:
                return getattr(target, func.attr)(*args, **kwargs)
        raise _SourceError(node, f"call {ast.unparse(func)!r} is not allowed (only Workflow(...) and"
                                 f" wf.{{{', '.join(sorted(_WORKFLOW_METHODS))}}}(...))")

    def statement(self, stmt: ast.stmt, first: bool) -> None:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
            if not first:
                raise _SourceError(stmt, "a string statement is allowed only as the module docstring")
            return
        if isinstance(stmt, ast.ImportFrom):
            allowed = _ALLOWED_IMPORTS.get(stmt.module or "")
            if allowed is not None and not any(a.name not in allowed or a.asname for a in stmt.names):
                return
            functions = [self.op_functions.get((stmt.module or "", a.name)) for a in stmt.names]
            if stmt.level or None in functions:
                raise _SourceError(stmt, f"import {ast.unparse(stmt)!r} is not allowed (only the DSL and registered"
                                         " ops can be imported)")
            for alias, fn in zip(stmt.names, functions, strict=True):
                self.names[alias.asname or alias.name] = fn
            return
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            self.call(stmt.value)
            return
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name = stmt.targets[0].id
            value = self.value(stmt.value)
            if not isinstance(value, Workflow | NodeRef | PortRef | RoleRef):
                raise _SourceError(stmt, f"{name} = ...: only DSL objects may be bound to names")
            self.names[name] = value
            return
        raise _SourceError(stmt, f"statement {ast.unparse(stmt).splitlines()[0]!r} is not allowed")


def spec_from_source(source: str, ops: OpRegistry | None = None) -> GraphSpec:
    """The GraphSpec described by DSL source, read without executing it (`ops`: the registry whose
    op functions it may import).

    Raises GraphValidationError (code `python_source`) naming the offending line."""
    try:
        tree = ast.parse(source, "<workflow source>")
    except SyntaxError as exc:
        raise GraphValidationError([Issue("python_source", f"line {exc.lineno}: syntax error: {exc.msg}")]) from None
    except (RecursionError, MemoryError):
        raise GraphValidationError([Issue("python_source", "the source nests too deeply to read")]) from None
    reader = _Reader(ops)
    try:
        for index, stmt in enumerate(tree.body):
            reader.statement(stmt, first=index == 0)
        if reader.workflow is None:
            raise _SourceError(None, "the source builds no Workflow")
        built = reader.workflow.to_spec()
        document = json.loads(encode_spec(built))
    except _SourceError as exc:
        raise GraphValidationError([Issue("python_source", str(exc))]) from None
    except (ValueError, TypeError, KeyError, msgspec.EncodeError) as exc:
        raise GraphValidationError([Issue("python_source", f"the DSL rejected the source: {exc}")]) from None
    # The DSL builds structs without checking them; decoding applies the schema.
    return parse_spec(document)


# ----------------------------------------------------------------------------------- diff
def _by_key(items: list[dict[str, Any]], key: Any) -> dict[str, dict[str, Any]]:
    return {key(item): item for item in items}


def _edge_id(edge: dict[str, Any]) -> str:
    return f"{edge['source']}.{edge['source_port']}->{edge['target']}.{edge['target_port']}"


def _fields(old: dict[str, Any], new: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The keys whose values differ, each `{from, to, change}`: `added` (absent before), `removed`
    (absent after) or `changed` (a canonical document leaves defaults out, so a field set to its
    default reads as removed)."""
    out = {}
    for k in sorted(set(old) | set(new)):
        if k in skip or old.get(k) == new.get(k):
            continue
        change = "added" if k not in old else "removed" if k not in new else "changed"
        out[k] = {"from": old.get(k), "to": new.get(k), "change": change}
    return out


def _section(old: list[dict[str, Any]], new: list[dict[str, Any]], key: Any) -> dict[str, Any]:
    a, b = _by_key(old, key), _by_key(new, key)
    changed = [{"id": k, "fields": _fields(a[k], b[k])} for k in a.keys() & b.keys() if a[k] != b[k]]
    return {
        "added": [k for k in b if k not in a],
        "removed": [k for k in a if k not in b],
        "changed": sorted(changed, key=lambda c: c["id"]),
    }


def diff_documents(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """What changed between two canonical GraphSpec documents, by role name, node id and edge id,
    plus a unified diff of their pretty-printed JSON. `old` empty: against nothing (every field and
    item of `new` is added)."""
    # Against nothing the old side has no lines (not a removed "{}").
    old_text = json.dumps(old, indent=2, sort_keys=True).splitlines(keepends=True) if old else []
    new_text = json.dumps(new, indent=2, sort_keys=True).splitlines(keepends=True)
    return {
        "fields": _fields(old, new, skip=("roles", "nodes", "edges")),
        "roles": _section(old.get("roles", []), new.get("roles", []), lambda r: r["name"]),
        "nodes": _section(old.get("nodes", []), new.get("nodes", []), lambda n: n["id"]),
        "edges": _section(old.get("edges", []), new.get("edges", []), _edge_id),
        "unified": "".join(difflib.unified_diff(old_text, new_text, "a/spec.json", "b/spec.json")),
    }
