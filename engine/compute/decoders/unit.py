"""The `vae_decoder` and `audio_decoder` compute units.

`vae_decode` nodes take `latents` (a `(C, h, w)` or `(1, C, h, w)` tensor, e.g. a
`diffusion` node's output) and return `image`, PNG bytes. `audio_decode` nodes take
`codes` (token ids, e.g. an `llm` node's `tokens`, or a tensor; param `code_offset` is
subtracted first, for LLMs whose audio codes sit above the text vocabulary) and return
`audio`, 16-bit PCM WAV bytes. Both open in a browser as they are.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.compute.context import UnitContext
from engine.compute.decoders.audio import AudioCodeDecoder
from engine.compute.decoders.catalog import AUDIO_DECODERS, IMAGE_DECODERS
from engine.compute.decoders.errors import DecoderError
from engine.compute.threaded import UnitInputError
from engine.compute.weighted import WeightedUnit
from engine.compute.weights.store import WeightKey
from engine.spec.calls import NodeCall, NodeContext, NodeResult, map_outputs
from engine.spec.graph import RoleSpec
from engine.spec.progress import ProgressMeter


class _DecoderUnit(WeightedUnit):
    port: str
    output: str

    def __init__(self, role: RoleSpec, ctx: UnitContext | None = None) -> None:
        super().__init__(role, ctx)
        self.key = self._load(role)

    def _load(self, role: RoleSpec) -> WeightKey:
        raise NotImplementedError

    def _decode(self, call: NodeCall, value: Any) -> bytes:
        raise NotImplementedError

    async def execute(self, call: NodeCall, ctx: NodeContext) -> NodeResult:
        inputs = await self.joined_inputs(call)
        value = inputs.get(self.port)
        if value is None:
            raise UnitInputError(f"node {call.node_id!r}: input {self.port!r} is required")

        def run() -> bytes:
            try:
                return self._decode(call, value)
            except DecoderError as exc:
                raise UnitInputError(f"node {call.node_id!r}: input {self.port!r}: {exc}") from exc

        meter = ProgressMeter(ctx.progress, 1, "items").start()
        data = await self.run_blocking(run)
        meter.advance()
        return NodeResult(outputs=map_outputs(data, call.output_ports, call.node_id))


class VAEDecoderUnit(_DecoderUnit):
    """`vae_decoder` role: a `diffusers` `AutoencoderKL` (model: `tiny-vae`)."""

    port = "latents"

    def _load(self, role: RoleSpec) -> WeightKey:
        from engine.compute.decoders.image import ImageDecoder, build_vae, vae_module

        config = IMAGE_DECODERS.named(role.model or "tiny-vae")
        key = WeightKey("vae_decoder", config.name, role.device)
        vae = self.shared.module(key, lambda: build_vae(config), skeleton=lambda: vae_module(config))
        self.decoder = ImageDecoder(config, vae)
        return key

    def _decode(self, call: NodeCall, value: Any) -> bytes:
        latents = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        if latents.ndim == 4 and latents.shape[0] != 1:
            raise UnitInputError(f"node {call.node_id!r}: one image per node, got a batch of {latents.shape[0]}")
        return self.decoder.decode_png(latents)[0]


class AudioDecoderUnit(_DecoderUnit):
    """`audio_decoder` role: a convolutional code decoder (model: `tiny-audio-decoder`)."""

    port = "codes"

    def _load(self, role: RoleSpec) -> WeightKey:
        config = AUDIO_DECODERS.named(role.model or "tiny-audio-decoder")
        key = WeightKey("audio_decoder", config.name, role.device)
        self.decoder = self.shared.module(key, lambda: AudioCodeDecoder.build(config),
                                          skeleton=lambda: AudioCodeDecoder(config))
        return key

    def _decode(self, call: NodeCall, value: Any) -> bytes:
        codes = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        offset = call.params.get("code_offset", 0)
        return self.decoder.decode_wav(codes.long() - int(offset))
