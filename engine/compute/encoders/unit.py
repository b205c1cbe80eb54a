"""The `vision_encoder` and `audio_encoder` compute units.

A role names its encoder in `model` (a built-in: `tiny-vit`, `tiny-audio-encoder`) and
the LLM it feeds in `params`: `llm` (a built-in LLM name; its hidden size is the
projection's output) or `hidden_size`. Node inputs: `image` (PNG/JPEG bytes or an array)
or `audio` (WAV bytes or float samples). Outputs: `embeds`, a `(length, hidden)` float32
tensor, and `item`, `{"kind", "hash", "length", "hidden"}`: what an `llm` node needs to
splice the embeddings in at `length` placeholder positions and to key its prefix cache.
"""

from __future__ import annotations

from typing import Any

from engine.compute.catalog import Catalog
from engine.compute.context import UnitContext
from engine.compute.encoders.audio import AudioEncoder
from engine.compute.encoders.catalog import AUDIO_ENCODERS, VISION_ENCODERS
from engine.compute.encoders.errors import EncoderError
from engine.compute.encoders.items import EncodedItem
from engine.compute.encoders.vision import VisionEncoder
from engine.compute.media import MediaError
from engine.compute.models.catalog import BUILTIN_MODELS
from engine.compute.models.packaged import PACKAGED_MODELS
from engine.compute.threaded import UnitInputError
from engine.compute.weighted import WeightedUnit
from engine.compute.weights.store import WeightKey
from engine.spec.calls import NodeCall, NodeContext, NodeResult, map_outputs
from engine.spec.graph import RoleSpec
from engine.spec.progress import ProgressMeter


def projection_size(role: RoleSpec) -> int:
    """The LLM hidden size an encoder role projects to (`params.hidden_size`, or that of `params.llm`)."""
    params = role.params
    if "hidden_size" in params:
        size = params["hidden_size"]
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise EncoderError(f"role {role.name!r}: hidden_size must be a positive int, got {size!r}")
        return size
    name = params.get("llm", "tiny-llama")
    if name in PACKAGED_MODELS:
        return PACKAGED_MODELS[name].hidden_size
    if name not in BUILTIN_MODELS:
        raise EncoderError(f"role {role.name!r}: unknown llm {name!r}; give hidden_size for a checkpoint LLM")
    return BUILTIN_MODELS[name].hidden_size


class _EncoderUnit(WeightedUnit):
    kind: str
    port: str

    def __init__(self, role: RoleSpec, ctx: UnitContext | None = None) -> None:
        super().__init__(role, ctx)
        self.key, self.encoder = self._load(role)

    encoder_class: type[VisionEncoder] | type[AudioEncoder]
    default_model: str
    catalog: Catalog[Any]
    """The built-in encoders a role's `model` names."""

    def _load(self, role: RoleSpec) -> tuple[WeightKey, Any]:
        """The role's encoder, projecting to its LLM's hidden size: one copy per process (`WeightStore`)."""
        config = self.catalog.named(role.model or self.default_model)
        size = projection_size(role)
        key = WeightKey(self.kind, f"{config.name}->{size}", role.device)
        cls = self.encoder_class
        return key, self.shared.module(key, lambda: cls.build(config, size), skeleton=lambda: cls(config, size))

    def _encode(self, call: NodeCall, value: Any) -> EncodedItem:
        try:
            return self.encoder.encode(value)
        except MediaError as exc:
            raise UnitInputError(f"node {call.node_id!r}: input {self.port!r}: {exc}") from exc

    async def execute(self, call: NodeCall, ctx: NodeContext) -> NodeResult:
        inputs = await self.joined_inputs(call)
        value = inputs.get(self.port)
        if value is None:
            raise UnitInputError(f"node {call.node_id!r}: input {self.port!r} is required")
        meter = ProgressMeter(ctx.progress, 1, "items").start()
        item = await self.run_blocking(self._encode, call, value)
        meter.advance()
        values = {"embeds": item.embeds, "item": item.describe()}
        ports = call.output_ports
        return NodeResult(outputs=map_outputs(values[ports[0]] if len(ports) == 1 else
                                              {p: values[p] for p in ports if p in values}, ports, call.node_id))


class VisionEncoderUnit(_EncoderUnit):
    """`vision_encoder` role: a ViT; serves `vision_encode` nodes."""

    kind = "vision_encoder"
    port = "image"
    encoder_class = VisionEncoder
    default_model = "tiny-vit"
    catalog = VISION_ENCODERS


class AudioEncoderUnit(_EncoderUnit):
    """`audio_encoder` role: log-mel + a transformer encoder; serves `audio_encode` nodes."""

    kind = "audio_encoder"
    port = "audio"
    encoder_class = AudioEncoder
    default_model = "tiny-audio-encoder"
    catalog = AUDIO_ENCODERS
