"""Registered ops: the functions a `python` node may name, by a stable name.

    from engine.spec.ops import op

    @op("diamond.square")
    def square(x: int) -> int:
        return x * x

`@op(name)` only annotates the function: it attaches an immutable `OpInfo` (its ports,
its params' JSON schema and how it is called), derived from the signature and type hints.
Parameters without a default are input ports (`str` -> `text`, `list[int]` -> `tokens`,
`torch.Tensor` -> `tensor`, other hints -> `json`, `bytes`/`Any`/none -> `any`); parameters
with a default are params, each with a JSON schema from its hint; `ctx` (the `NodeContext`)
is neither; the return hint types the one output `out` (a generator's: the type of its
frames). `inputs=`/`outputs=` replace the derived ports where they are not what a graph
should see (an optional input port with a default, several outputs). `output_dirs=` names the
params that are folders the op writes into: a studio takes them as names under the run owner's
own folder and gives them one when the node does not (`studio.workflows.paths`).

There is no global registry. `default_ops()` builds an `OpRegistry` for a process from the
installed packages' entry points of the group `omniflow.ops`: each entry point names a module,
and the registry collects the `@op` functions defined in it. A GraphSpec names an op; the
registry looks the name up, and never imports or walks anything a spec names.

`OpConfig` is what a process decides about ops, passed down to validation and to the units that
run them: the registry, and whether `module:function` ops (code named by the spec itself) may
run at all: the command line allows them (a person running their own code), a studio does not
unless its operator says so.
"""

from __future__ import annotations

import collections.abc
import difflib
import inspect
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from engine.spec.calls import FinalNodeError
from engine.spec.graph import PortSpec, PortType

ENTRY_POINT_GROUP = "omniflow.ops"
OP_NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")
"""A registered op's name: dotted lower-case words, at least two (`text.join`)."""
MODULE_OP = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
"""A `module:function` op: code the spec names by its import path (trusted mode only), one
function of the module, never an attribute path through it."""
ATTRIBUTE_PATH_OP = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
"""`module:a.b`: an attribute path through what the module imported (`x:Path.write_text`),
refused everywhere, trusted mode included."""
_ATTRIBUTE = "__omniflow_op__"

PortDecl = str | Mapping[str, Any] | PortSpec


class OpError(FinalNodeError, LookupError):
    """A python node's op cannot be used: unknown, not allowed, or malformed (trying the node
    again cannot mend it)."""


class UnknownOpError(OpError):
    pass


class OpNotAllowedError(OpError):
    pass


class OpDefinitionError(ValueError):
    """An `@op` function, or a set of them, cannot be registered (bad name, duplicate, bad hints)."""


@dataclass(frozen=True, slots=True)
class OpInfo:
    """What `@op` records about a function. Immutable: the mappings are read-only views."""

    name: str
    description: str
    inputs: Mapping[str, PortSpec]
    outputs: Mapping[str, PortSpec]
    params_schema: Mapping[str, Any]
    takes_ctx: bool
    is_coroutine: bool
    is_generator: bool
    is_async_generator: bool
    output_dirs: tuple[str, ...] = ()
    """Params naming a folder the op writes into (`@op(output_dirs=...)`)."""

    def params_json_schema(self) -> dict[str, Any]:
        """`params_schema` as plain dicts and lists (a copy)."""
        return _thaw(self.params_schema)

    def to_dict(self) -> dict[str, Any]:
        def ports(p: Mapping[str, PortSpec]) -> dict[str, Any]:
            return {name: {"type": s.type, "optional": s.optional, **({"join": s.join} if s.join else {})}
                    for name, s in p.items()}

        return {
            "name": self.name,
            "description": self.description,
            "inputs": ports(self.inputs),
            "outputs": ports(self.outputs),
            "params_schema": self.params_json_schema(),
            "stream": self.is_generator or self.is_async_generator,
            "output_dirs": list(self.output_dirs),
        }


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return types.MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


# ------------------------------------------------------------------------- hints -> types
_NONE = type(None)


def _strip_optional(hint: Any) -> Any:
    """`X | None` -> `X`; any other hint as it is."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not _NONE]
        if len(rest) == 1:
            return rest[0]
    return hint


def _frame_hint(hint: Any) -> Any:
    """The item type of an (async) iterator or generator hint; the hint itself otherwise."""
    origin = typing.get_origin(hint)
    if origin in (collections.abc.Iterator, collections.abc.AsyncIterator, collections.abc.Generator,
                  collections.abc.AsyncGenerator, collections.abc.Iterable, collections.abc.AsyncIterable):
        args = typing.get_args(hint)
        return args[0] if args else Any
    return hint


def port_type(hint: Any) -> PortType:
    """The port type of a parameter or return hint."""
    hint = _strip_optional(hint)
    if hint is inspect.Parameter.empty or hint is Any or hint is bytes or hint is object:
        return "any"
    if hint is str:
        return "text"
    origin = typing.get_origin(hint)
    if origin is list and typing.get_args(hint) in ((int,),):
        return "tokens"
    if getattr(hint, "__module__", "") == "torch" and getattr(hint, "__name__", "") == "Tensor":
        return "tensor"
    return "json"


_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
                               tuple: "array", dict: "object"}


def param_schema(hint: Any) -> dict[str, Any]:
    """A JSON schema for a param's hint (`{}`: any JSON value)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [param_schema(a) for a in typing.get_args(hint)]
        return {} if {} in options else {"anyOf": options}
    if hint is _NONE or hint is None:
        return {"type": "null"}
    base = typing.get_origin(hint) or hint
    if base is typing.Literal:
        return {"enum": list(typing.get_args(hint))}
    json_type = _JSON_TYPES.get(base)
    if json_type is None:
        return {}
    schema: dict[str, Any] = {"type": json_type}
    args = typing.get_args(hint)
    if json_type == "array" and base is list and len(args) == 1:
        item = param_schema(args[0])
        if item:
            schema["items"] = item
    return schema


def _port(decl: PortDecl) -> PortSpec:
    if isinstance(decl, PortSpec):
        return decl
    if isinstance(decl, str):
        return PortSpec(type=decl)  # type: ignore[arg-type]
    return PortSpec(**dict(decl))


def describe(fn: Callable[..., Any], name: str, *, inputs: Mapping[str, PortDecl] | None = None,
             outputs: Mapping[str, PortDecl] | None = None, description: str | None = None,
             output_dirs: Iterable[str] = ()) -> OpInfo:
    """The `OpInfo` of `fn` registered as `name` (what `@op` attaches)."""
    if not isinstance(name, str) or not OP_NAME.match(name):
        raise OpDefinitionError(f"op name {name!r} of {_where(fn)}: expected dotted lower-case words such as"
                                " 'text.join' (letters, digits, _; at least two parts)")
    try:
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError) as exc:
        raise OpDefinitionError(f"op {name!r} ({_where(fn)}): its type hints cannot be read: {exc}") from None
    signature = inspect.signature(fn)
    params = {pname: param for pname, param in signature.parameters.items()
              if pname != "ctx" and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)}
    if inputs is not None:
        ports_in = {k: _port(v) for k, v in inputs.items()}
    else:
        ports_in = {pname: PortSpec(type=port_type(_frame_hint(_strip_optional(hints.get(pname, param.empty)))))
                    for pname, param in params.items() if param.default is param.empty}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in params.items():
        if pname in ports_in:
            continue
        hint = hints.get(pname, param.empty)
        schema = param_schema(hint) if hint is not param.empty else {}
        if param.default is param.empty:
            required.append(pname)
        elif _is_json(param.default):
            schema = {**schema, "default": param.default}
        properties[pname] = schema
    if outputs is not None:
        ports_out = {k: _port(v) for k, v in outputs.items()}
    else:
        returned = hints.get("return", inspect.Parameter.empty)
        kind = port_type(_frame_hint(returned))
        ports_out = {"out": PortSpec(type="json" if kind == "any" and returned is inspect.Parameter.empty else kind)}
    output_dirs = tuple(output_dirs)
    for pname in output_dirs:
        if pname not in properties or properties[pname].get("type", "string") != "string":
            raise OpDefinitionError(f"op {name!r} ({_where(fn)}): output_dirs names {pname!r}, which is not a"
                                    " string param of the function")
    return OpInfo(
        name=name,
        description=description if description is not None else _summary(fn),
        inputs=types.MappingProxyType(ports_in),
        outputs=types.MappingProxyType(ports_out),
        params_schema=_freeze({"type": "object", "properties": properties, **({"required": required} if required else {})}),
        takes_ctx="ctx" in signature.parameters,
        is_coroutine=inspect.iscoroutinefunction(fn),
        is_generator=inspect.isgeneratorfunction(fn),
        is_async_generator=inspect.isasyncgenfunction(fn),
        output_dirs=output_dirs,
    )


def _summary(fn: Callable[..., Any]) -> str:
    """The first paragraph of `fn`'s docstring, on one line."""
    doc = (inspect.getdoc(fn) or "").strip()
    return " ".join(doc.split("\n\n", 1)[0].split())


def _is_json(value: Any) -> bool:
    if value is None or isinstance(value, str | int | float | bool):
        return True
    if isinstance(value, list | tuple):
        return all(_is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    return False


def _where(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def op(name: str, *, inputs: Mapping[str, PortDecl] | None = None, outputs: Mapping[str, PortDecl] | None = None,
       description: str | None = None, output_dirs: Iterable[str] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a function as the op `name`; returns the function itself, with its `OpInfo` attached
    (read it with `op_info`). Registers nothing: a registry collects the module's ops.
    `output_dirs`: the (string) params naming folders the op writes into."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(fn, _ATTRIBUTE, describe(fn, name, inputs=inputs, outputs=outputs, description=description,
                                         output_dirs=output_dirs))
        return fn

    return mark


def op_info(fn: Any) -> OpInfo | None:
    """The `OpInfo` `@op` attached to `fn`, or None for an undecorated function."""
    info = getattr(fn, _ATTRIBUTE, None) if inspect.isfunction(fn) else None
    return info if isinstance(info, OpInfo) else None


# ------------------------------------------------------------------------------- registry
@dataclass(frozen=True, slots=True)
class RegisteredOp:
    fn: Callable[..., Any]
    info: OpInfo

    @property
    def where(self) -> str:
        return _where(self.fn)


class OpRegistry:
    """Registered ops by name. Built explicitly (see `default_ops`) and passed down; never global.
    Lookups never import: everything in it was collected when it was built."""

    def __init__(self, functions: Iterable[Callable[..., Any]] = ()) -> None:
        self._ops: dict[str, RegisteredOp] = {}
        for fn in functions:
            self.add(fn)

    def add(self, fn: Callable[..., Any]) -> RegisteredOp:
        info = op_info(fn)
        if info is None:
            raise OpDefinitionError(f"{_where(fn)} is not an op (decorate it with @op(name))")
        known = self._ops.get(info.name)
        if known is not None and known.fn is not fn:
            raise OpDefinitionError(f"op {info.name!r} is defined twice: by {known.where} and by {_where(fn)}")
        entry = self._ops[info.name] = RegisteredOp(fn, info)
        return entry

    def add_module(self, module: types.ModuleType) -> list[RegisteredOp]:
        """Register every `@op` function defined in `module` (not those it imports)."""
        found = [value for value in vars(module).values()
                 if op_info(value) is not None and getattr(value, "__module__", None) == module.__name__]
        return [self.add(fn) for fn in found]

    def get(self, name: str) -> RegisteredOp:
        try:
            return self._ops[name]
        except KeyError:
            raise UnknownOpError(self.unknown_message(name)) from None

    def find(self, op: str | None) -> RegisteredOp | None:
        """The registered op a node's `op` names: by its registered name, or as `module:function`
        naming a registered op's function (matched against what was collected: nothing is
        imported). None: no registered op."""
        if op is None:
            return None
        found = self._ops.get(op)
        if found is not None or not MODULE_OP.match(op):
            return found
        module, _, function = op.partition(":")
        return next((r for r in self._ops.values()
                     if getattr(r.fn, "__module__", None) == module and getattr(r.fn, "__name__", None) == function),
                    None)

    def unknown_message(self, name: str) -> str:
        close = difflib.get_close_matches(name, list(self._ops), n=3, cutoff=0.8)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        return f"op {name!r} is not a registered op{hint}"

    def __contains__(self, name: object) -> bool:
        return name in self._ops

    def __len__(self) -> int:
        return len(self._ops)

    @property
    def ops(self) -> list[RegisteredOp]:
        return sorted(self._ops.values(), key=lambda r: r.info.name)


def default_ops(*, load_entry_points: bool = True) -> OpRegistry:
    """A new registry of the ops installed packages declare under the `omniflow.ops` group
    (each entry point names a module)."""
    registry = OpRegistry()
    if load_entry_points:
        for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            module = ep.load()
            if not isinstance(module, types.ModuleType):
                raise OpDefinitionError(f"entry point {ep.name!r} of group {ENTRY_POINT_GROUP!r} names"
                                        f" {ep.value!r}, which is not a module")
            registry.add_module(module)
    return registry


# --------------------------------------------------------------------------------- policy
@dataclass(frozen=True, slots=True)
class OpConfig:
    """The ops one process may run: the registered ones, plus `module:function` ops when
    `allow_module_ops` (code named by the spec: only where whoever writes specs is trusted)."""

    registry: OpRegistry = field(repr=False)
    allow_module_ops: bool

    def problem(self, op: str) -> OpError | None:
        """Why `op` may not run here (None: it may). Imports nothing."""
        if op in self.registry:
            return None
        if MODULE_OP.match(op) or ATTRIBUTE_PATH_OP.match(op):
            if not self.allow_module_ops:
                return OpNotAllowedError(
                    f"op {op!r} names code by its module path, which this process does not run (module ops are"
                    " off: name a registered op instead)")
            if ATTRIBUTE_PATH_OP.match(op):
                return OpNotAllowedError(attribute_path_message(op))
            return None
        return UnknownOpError(self.registry.unknown_message(op))


def attribute_path_message(op: str) -> str:
    """Why `module:a.b` is refused, trusted mode included."""
    module, _, path = op.partition(":")
    return (f"op {op!r} walks the attribute path {path!r} through module {module!r}: a module op names one"
            f" function defined in its module ('{module}:{path.split('.')[-1]}' if it is defined there)")
