"""The catalogue of role kinds and node kinds.

A *role kind* is a compute unit a role deploys (`python`, later `llm`, `diffusion`…),
named by a lazily imported runner (`"module:Class"`). A *node kind* is an operation a
node performs on a role of a matching kind, with its parameter JSON schema and, where
the kind fixes them, its ports. The flow layer validates GraphSpecs against this
catalogue; the studio's editor shows it as its palette.

There is no global catalogue: `default_kinds()` builds a fresh `KindRegistry` with the
built-in kinds plus whatever installed packages declare under the
`omniflow.kinds` entry-point group (each entry point names a callable that takes the
registry and adds its kinds).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from engine.spec.graph import PortSpec

ENTRY_POINT_GROUP = "omniflow.kinds"

MAX_CAPACITY = 4096
"""The most node executions one replica of a role may run at once (a hard ceiling of `capacity`)."""


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    """A model a role kind knows by name, with no file to point at (what the editor's picker offers)."""

    name: str
    random_weights: bool
    """Seeded random weights (a tiny test model): it runs, but what it says is noise."""
    description: str = ""


@dataclass(frozen=True, slots=True)
class RoleModels:
    """What the `model` of a role of some kind names."""

    required: bool
    """A role of the kind cannot run without one (validation: `model_missing`)."""
    builtin: str | None = None
    """`"module:function"` returning the kind's `BuiltinModel`s; imported only when asked."""
    checkpoints: bool = False
    """Whether a checkpoint folder (a local one, or in a studio one under its model roots) serves too."""

    def builtin_models(self) -> list[BuiltinModel]:
        return [] if self.builtin is None else list(_import_ref(self.builtin)())


@dataclass(frozen=True, slots=True)
class RoleKind:
    name: str
    description: str
    runner: str
    """`"module:Class"` of the compute unit; imported only when a role of this kind runs."""
    params_schema: dict[str, Any] = field(default_factory=lambda: {"type": "object"})
    tensor_parallel: str | None = None
    """`"module:function"` of the kind's tensor-parallel check, `check(model, tp_size) -> list[str]`
    (the problems that make `model` unsplittable over `tp_size` ranks, where they can be known
    without loading it); None: the kind cannot shard (`tp_size` must be 1)."""
    tp_runner: str | None = None
    """`"module:Class"` of the unit rank 0 of a `tp_size > 1` replica hosts, built as
    `Class(role, tp=seat)`; its module's `follow(role, seat, ready=..., parent_pid=...)` runs
    ranks 1.. (see `engine.compute.tp.unit`)."""
    models: RoleModels | None = None
    """What its roles' `model` names; None: the kind takes no model."""

    def load_runner(self) -> Any:
        """Import the compute unit class named by `runner`."""
        return _import_ref(self.runner)

    def load_tp_runner(self) -> tuple[Any, Any]:
        """The rank-0 unit class and the follower entry point of a tensor-parallel replica."""
        if self.tp_runner is None:
            raise UnknownKindError(f"role kind {self.name!r} has no tensor-parallel runner")
        unit = _import_ref(self.tp_runner)
        return unit, _import_ref(f"{unit.__module__}:follow")

    def tp_problems(self, model: str | None, tp_size: int) -> list[str]:
        """Why `model` cannot run over `tp_size` ranks (empty: it can, or it cannot be known yet)."""
        if self.tensor_parallel is None:
            return [f"role kind {self.name!r} cannot shard over tensor-parallel ranks"] if tp_size > 1 else []
        return list(_import_ref(self.tensor_parallel)(model, tp_size))


def _import_ref(ref: str) -> Any:
    module_name, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module_name), attr)


@dataclass(frozen=True, slots=True)
class InputChoice:
    """Optional input ports of a node kind that are alternatives to each other, of which a node
    needs at least one connected (an llm node's prompt: as text on `prompt` or as token ids on
    `tokens`). Validation reports a node with none of them wired (`missing_input`); which of them
    a run may deliver at once is the runner's business (a router may feed either one)."""

    ports: tuple[str, ...]
    what: str
    """What the ports carry, for people: "a prompt"."""


@dataclass(frozen=True, slots=True)
class NodeKind:
    name: str
    description: str
    role_kinds: tuple[str, ...]
    """Role kinds that can host the node; empty for nodes the executor runs itself."""
    params_schema: dict[str, Any] = field(default_factory=lambda: {"type": "object"})
    inputs: dict[str, PortSpec] | None = None
    """Fixed input ports (a node may narrow an `any` type); None: the node declares them."""
    outputs: dict[str, PortSpec] | None = None
    op: str = "forbidden"
    """`required`: the node names an operation (for `python`, a registered op, see
    `engine.spec.ops`); `forbidden`: it must not."""
    category: str = "general"
    needs: tuple[InputChoice, ...] = ()
    """Groups of optional inputs of which a node must wire at least one each."""

    def param_default(self, name: str) -> Any:
        """The default of param `name` as the kind's schema declares it; KeyError when it declares
        none (the param is required, or not the kind's)."""
        declared = self.params_schema.get("properties", {}).get(name, {})
        if "default" not in declared:
            raise KeyError(f"node kind {self.name!r} declares no default for param {name!r}")
        return declared["default"]

    def to_dict(self) -> dict[str, Any]:
        def ports(p: dict[str, PortSpec] | None) -> dict[str, Any] | None:
            if p is None:
                return None
            return {name: {"type": spec.type, "optional": spec.optional} for name, spec in p.items()}

        return {
            "name": self.name,
            "description": self.description,
            "category": self.category,
            "role_kinds": list(self.role_kinds),
            "params_schema": self.params_schema,
            "inputs": ports(self.inputs),
            "outputs": ports(self.outputs),
            "op": self.op,
            "needs": [{"ports": list(choice.ports), "what": choice.what} for choice in self.needs],
        }


class UnknownKindError(KeyError):
    pass


class KindRegistry:
    """Role and node kinds by name. Built explicitly and passed down; never global."""

    def __init__(self) -> None:
        self._roles: dict[str, RoleKind] = {}
        self._nodes: dict[str, NodeKind] = {}

    def add_role_kind(self, kind: RoleKind) -> None:
        if kind.name in self._roles:
            raise ValueError(f"role kind {kind.name!r} is already registered")
        self._roles[kind.name] = kind

    def add_node_kind(self, kind: NodeKind) -> None:
        if kind.name in self._nodes:
            raise ValueError(f"node kind {kind.name!r} is already registered")
        unknown = [rk for rk in kind.role_kinds if rk not in self._roles]
        if unknown:
            raise ValueError(f"node kind {kind.name!r} names unknown role kinds {unknown}")
        for choice in kind.needs:  # a required port needs no choice; an undeclared one cannot be wired
            fixed = kind.inputs or {}
            if not choice.ports or any(p not in fixed or not fixed[p].optional for p in choice.ports):
                raise ValueError(f"node kind {kind.name!r}: a choice of inputs names only optional input ports"
                                 f" of the kind, not {list(choice.ports)}")
        self._nodes[kind.name] = kind

    def role_kind(self, name: str) -> RoleKind:
        try:
            return self._roles[name]
        except KeyError:
            raise UnknownKindError(name) from None

    def node_kind(self, name: str) -> NodeKind:
        try:
            return self._nodes[name]
        except KeyError:
            raise UnknownKindError(name) from None

    def has_role_kind(self, name: str) -> bool:
        return name in self._roles

    def has_node_kind(self, name: str) -> bool:
        return name in self._nodes

    @property
    def role_kinds(self) -> list[RoleKind]:
        return list(self._roles.values())

    @property
    def node_kinds(self) -> list[NodeKind]:
        return list(self._nodes.values())


_ANY = PortSpec(type="any")

PYTHON_NODE_PARAMS: dict[str, Any] = {
    "type": "object",
    "description": "Keyword arguments passed to the function after its input ports.",
}


def add_builtin_kinds(registry: KindRegistry) -> None:
    """The kinds every installation has: workflow inputs/outputs and Python functions."""
    registry.add_role_kind(
        RoleKind(
            name="python",
            description="Runs the Python functions registered as ops (`engine.spec.ops`).",
            runner="engine.compute.python:PythonUnit",
            params_schema={
                "type": "object",
                "properties": {
                    "capacity": {"type": "integer", "minimum": 1, "maximum": MAX_CAPACITY, "default": 64,
                                 "description": "node executions one replica runs at once"},
                },
                "additionalProperties": False,
            },
        )
    )
    registry.add_node_kind(
        NodeKind(
            name="input",
            description="A workflow input; the node id is the input's name.",
            role_kinds=(),
            category="io",
            inputs={},
            outputs={"value": _ANY},
            params_schema={
                "type": "object",
                "properties": {
                    "default": {"description": "value used when the run gives none"},
                    "example": {"type": "string", "description": "what a run form pre-fills for a person to"
                                " edit, in place of the default (a plain chat message where the default is"
                                " a rendered conversation); runs never read it"},
                },
                "additionalProperties": False,
            },
        )
    )
    registry.add_node_kind(
        NodeKind(
            name="output",
            description="A workflow output; the node id is the output's name.",
            role_kinds=(),
            category="io",
            inputs={"value": _ANY},
            outputs={},
            params_schema={"type": "object", "additionalProperties": False},
        )
    )
    registry.add_node_kind(
        NodeKind(
            name="python",
            description="Calls a Python function: input ports and params become keyword arguments.",
            role_kinds=("python",),
            op="required",
            params_schema=PYTHON_NODE_PARAMS,
        )
    )


def default_kinds(*, load_entry_points: bool = True) -> KindRegistry:
    """A new registry with the built-in kinds and those of installed plug-ins."""
    registry = KindRegistry()
    add_builtin_kinds(registry)
    if load_entry_points:
        for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            ep.load()(registry)
    return registry
