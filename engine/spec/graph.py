"""GraphSpec: the versioned JSON document a workflow compiles to.

The studio stores it, the editor edits it and the executor runs it. Encoding is
canonical (defaults omitted, declaration order kept) so two equal specs encode to
the same bytes; `graphspec.schema.json` beside this module is generated from these
types (see `json_schema()`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

SPEC_VERSION = 1

PortType = Literal["text", "tokens", "image", "audio", "tensor", "kv", "json", "any"]
PORT_TYPES: tuple[str, ...] = ("text", "tokens", "image", "audio", "tensor", "kv", "json", "any")
JoinMode = Literal["all", "ordered", "dynamic"]

Ident = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^[A-Za-z_][A-Za-z0-9_\-]*$",
        max_length=64,
        description="identifier: a letter or underscore, then letters, digits, '_' or '-'",
    ),
]

MAX_ITERATIONS = 1_000_000
"""The hard ceiling of a node's `max_iterations` (a studio's per-user quota is lower)."""

MAX_IMAGE_PIXELS = 4096 * 4096
"""The most pixels an encoded `image` value may decode to (width times height): a small
compressed file can claim a picture of gigabytes, so readers check the size its header gives
before decoding it."""

SCHEMA_PATH = Path(__file__).with_name("graphspec.schema.json")


class PortSpec(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """A typed port. `join` (inputs only) says how several arrivals on the port are gathered:
    `all` one value per incoming edge, in edge order; `ordered` every streamed frame in
    sequence order; `dynamic` frames as they arrive until each source ends its stream."""

    type: PortType
    optional: bool = False
    join: JoinMode | None = None
    description: str = ""


class RoleSpec(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """A deployable unit: `replicas` copies of one compute unit of `kind`. With `tp_size` N > 1
    each replica is N tensor-parallel rank processes (a kind that can shard: see
    `engine.spec.kinds.RoleKind.tensor_parallel`); rank 0 is the replica's one endpoint."""

    name: Ident
    kind: str
    model: str | None = None
    replicas: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=64, description="tensor-parallel ranks per replica")] = 1
    device: str = "cpu"
    balance: str = "round_robin"
    balance_params: dict[str, Any] = {}
    resources: dict[str, Any] = {}
    params: dict[str, Any] = {}


class NodeSpec(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """One step of the graph.

    `trigger` is an OR of AND-groups of predecessor ids: the node fires when every
    predecessor of any one group has finished (delivered, or skipped) and at least one
    of them delivered. Without it: one group of all predecessors outside the node's
    cycle, plus one group per predecessor inside it (so a loop body fires on its entry
    or on its back edge). `routes` makes the node a router: its result names which of
    these successors run; the others are skipped. `max_iterations` bounds how often a
    node on a cycle may fire.
    """

    id: Ident
    kind: str
    role: str | None = None
    op: str | None = None
    params: dict[str, Any] = {}
    inputs: dict[str, PortSpec] = {}
    outputs: dict[str, PortSpec] = {}
    trigger: list[list[str]] | None = None
    routes: list[str] | None = None
    stream: bool = False
    max_iterations: Annotated[int, msgspec.Meta(ge=1, le=MAX_ITERATIONS)] | None = None
    retries: Annotated[int, msgspec.Meta(ge=0, le=100)] = 0
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    description: str = ""


class EdgeSpec(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """`source.source_port -> target.target_port`. With `stream`, the target subscribes
    to the source's frames and starts on the first one."""

    source: str
    source_port: str
    target: str
    target_port: str
    stream: bool = False

    @property
    def id(self) -> str:
        return f"{self.source}.{self.source_port}->{self.target}.{self.target_port}"


class GraphSpec(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """The whole workflow document (format `version` SPEC_VERSION)."""

    version: Literal[1]
    name: Ident
    roles: list[RoleSpec]
    nodes: list[NodeSpec]
    edges: list[EdgeSpec]
    description: str = ""
    meta: dict[str, Any] = {}

    def node(self, node_id: str) -> NodeSpec:
        for node in self.nodes:
            if node.id == node_id:
                return node
        raise KeyError(node_id)

    def role(self, name: str) -> RoleSpec:
        for role in self.roles:
            if role.name == name:
                return role
        raise KeyError(name)


_ENCODER = msgspec.json.Encoder(order="deterministic")


def encode_spec(spec: GraphSpec) -> bytes:
    """Canonical JSON bytes of a spec (defaults omitted, dict keys sorted)."""
    return _ENCODER.encode(spec)


def spec_to_dict(spec: GraphSpec) -> dict[str, Any]:
    return msgspec.json.decode(encode_spec(spec))


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a GraphSpec document, generated from the types above."""
    schema = msgspec.json.schema(GraphSpec)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "Omni-Flow GraphSpec"
    return schema


def render_json_schema() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"
