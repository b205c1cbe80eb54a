"""The `diffusion` compute unit: hosts a `DiffusionRunner` on an LLM's transformer.

The role's `model` is the LLM (a built-in name or a checkpoint directory) whose
transformer denoises; taken from the worker's `WeightStore`, it is the very module an
`llm` role of the same model in the same process runs. The prompt's K/V live in a
`KVStore` — the worker's (shared with its `llm` roles: a prompt that role already
computed is read, not recomputed) or one of the unit's own — and pages missing there
are pulled from `page_source` (e.g. the `llm` worker that computed them) when the
worker gives one. Full prompt pages the unit computes stay in the store, so a repeated
(negative) prompt is computed once.

Node inputs: `prompt` (text) or `tokens` (ids; the `llm` role's model ids for the
same context), optional `negative_prompt` (text; else the param, else empty: just BOS)
and optional `kv` (an `llm` node's `KVRef`: checked to be of this model and layout;
its pages are found by key and pulled from its holder). Without `prompt` and `tokens` the
prompt is the context `kv` carries (the llm node's prompt and output ids), and the keys of its
leading pages are the ones `kv` carries (`node_prompt`, `kv_pages`), checked against those ids under the call's
tenant: a `kv` naming pages of other tokens or of another tenant is refused, never read. The
keys of any other prompt, and of the context's pages after those, are hashed here under the
call's tenant. Output: `latents`, a `(C, h, w)` float32 tensor for a `vae_decode` node.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.compute.context import UnitContext
from engine.compute.diffusion.head import DiffusionHead
from engine.compute.diffusion.runner import DiffusionConfig, DiffusionRunner, Prompt
from engine.compute.models.tokenizer import BOS_ID
from engine.compute.threaded import ThreadedUnit, UnitInputError
from engine.compute.weights.seeding import build_seeded
from engine.compute.weights.store import WeightKey, WeightStore
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout
from engine.data.kv.ref import KVRef, KVRefError
from engine.data.kv.source import HolderPageSource, IndexPageSource, PageSource
from engine.data.kv.store import KVStore, KVStoreConfig
from engine.data.kv.tier import Capacity
from engine.data.peer import Peer
from engine.spec.calls import NodeCall, NodeContext, NodeResult, map_outputs
from engine.spec.graph import RoleSpec
from engine.spec.progress import ProgressMeter, Report, on_loop

CONFIG_PARAMS = ("latent_channels", "latent_size", "patch_size", "steps", "guidance_scale", "shift",
                 "page_size", "head_seed")


def prompt_ids(call: NodeCall, runner: DiffusionRunner, text: Any, tokens: Any, what: str) -> list[int]:
    """A prompt's token ids: `tokens` as given (checked), else `text` through the model's tokenizer."""
    if tokens is not None:
        if not isinstance(tokens, list | tuple) or not all(isinstance(t, int) for t in tokens):
            raise UnitInputError(f"node {call.node_id!r}: {what} tokens must be a list of token ids")
        return [int(t) for t in tokens]
    if not isinstance(text, str):
        raise UnitInputError(f"node {call.node_id!r}: {what} must be text, not {type(text).__name__}")
    return list(runner.model.tokenizer(text).input_ids)


def kv_input(call: NodeCall, kv: Any, model_id: str, layout: KVLayout) -> KVRef:
    """An input `kv`: an `llm` node's `KVRef` of this model, in this (whole) layout."""
    try:
        return KVRef.for_role(kv, model_id, layout)
    except KVRefError as exc:
        raise UnitInputError(f"node {call.node_id!r}: input 'kv': {exc}") from None


@dataclass(frozen=True, slots=True)
class NodePrompt:
    """A node's (conditional) prompt: its token ids, and the keys of its leading pages as input
    `kv` named them, checked (empty where this role hashes the prompt's pages itself)."""

    ids: list[int]
    known: tuple[PageHash, ...] = ()


def kv_pages(call: NodeCall, kv: KVRef) -> tuple[PageHash, ...]:
    """The keys of the leading pages of the context `kv` carries: its `page_hashes`, checked to be
    those of its token ids under the call's tenant (`KVRef.pages_for`; UnitInputError naming the
    node and field when they are not). None when `kv` names its pages in another keying (no
    layout: SGLang's own, unseeded keys) or when its context holds image or audio items (keyed as
    sentinels, whose K/V this role does not compute): then this role hashes the context itself."""
    if kv.layout is None or (kv.key_ids and kv.key_ids != kv.prompt_ids):
        return ()
    try:
        return kv.pages_for(call.tenant)
    except KVRefError as exc:
        raise UnitInputError(f"node {call.node_id!r}: input 'kv': {exc}") from None


def node_prompt(call: NodeCall, runner: DiffusionRunner, inputs: dict[str, Any], kv: KVRef | None) -> NodePrompt:
    """The prompt: input `prompt` (tokenized) or `tokens`, else the context `kv` carries (the llm
    node's prompt and output ids: not tokenized again, its pages named by `kv`: `kv_pages`)."""
    prompt, tokens = inputs.get("prompt"), inputs.get("tokens")
    if prompt is not None and tokens is not None:
        raise UnitInputError(f"node {call.node_id!r}: give exactly one of the inputs 'prompt' or 'tokens'")
    if prompt is None and tokens is None:
        if kv is None or not (kv.prompt_ids or kv.output_ids):
            raise UnitInputError(f"node {call.node_id!r}: give exactly one of the inputs 'prompt' or 'tokens', or a"
                                 " 'kv' carrying its context's token ids")
        return NodePrompt([*kv.prompt_ids, *kv.output_ids], kv_pages(call, kv))
    return NodePrompt(prompt_ids(call, runner, prompt, tokens, "prompt"))


class DiffusionUnit(ThreadedUnit):
    """Built as `DiffusionUnit(role, ctx)` (`engine.compute.context`): the context's weights, KV
    store and seat on the transfer plane where given (a private weight store and KV store are made
    when absent). `page_source`: where missing prompt pages come from when a `kv` input names no
    holder (default: the KV index of the seat, if any)."""

    def __init__(self, role: RoleSpec, ctx: UnitContext | None = None, *,
                 page_source: PageSource | None = None) -> None:
        super().__init__(role)
        ctx = ctx or UnitContext()
        shared, kv_store, seat = ctx.weights, ctx.kv_store, ctx.seat
        if not role.model:
            raise UnitInputError(f"diffusion role {role.name!r} needs a model (the LLM whose transformer denoises)")
        params = role.params
        try:
            self.config = DiffusionConfig(**{k: params[k] for k in CONFIG_PARAMS if k in params})
        except (TypeError, ValueError) as exc:
            raise UnitInputError(f"diffusion role {role.name!r}: {exc}") from exc
        self._own_weights = shared is None
        self.shared = shared if shared is not None else WeightStore()
        self.model_ref = str(Path(role.model).resolve()) if Path(role.model).is_dir() else role.model
        model = self.shared.llm(self.model_ref, role.device)
        self._keys = [WeightStore.llm_key(self.model_ref, role.device)]
        cfg = self.config
        hidden = int(model.config.hidden_size)
        head_key = WeightKey("diffusion_head", f"{model.model_id}:p{cfg.patch_size}c{cfg.latent_channels}"
                             f"g{cfg.grid}s{cfg.head_seed}", role.device)

        def head() -> DiffusionHead:
            return DiffusionHead(cfg.patch_dim, hidden, (cfg.grid, cfg.grid), cfg.freq_dim)

        self.runner = DiffusionRunner(model, cfg, head=self.shared.module(
            head_key, lambda: build_seeded(head, cfg.head_seed), skeleton=head))
        self._keys.append(head_key)
        self._own_kv = kv_store is None
        if kv_store is None:
            kv_store = KVStore(KVStoreConfig(layout=self.runner.layout,
                                             device_capacity=Capacity(pages=int(params.get("device_pages", 256))),
                                             device=str(next(model.model.parameters()).device)))
        self.kv_store = kv_store
        if page_source is None and seat is not None and seat.index is not None:
            page_source = IndexPageSource(seat.peer, seat.index)
        self.page_source = page_source
        self._peer: Peer | None = seat.peer if seat else None
        self.worker_id: str | None = seat.worker_id if seat else None

    # -- worker integration (`engine.worker.kv.KVHostUnit`) ------------------------------------------

    def kv_meta(self) -> dict[str, Any]:
        return {"model_id": self.runner.model_id, "page_size": self.runner.layout.page_size,
                "layout": self.runner.layout.fingerprint(), "prefix_cache": True}

    def _source(self, kv: KVRef | None) -> PageSource | None:
        """Where missing prompt pages come from: the worker that computed `kv` (its `holder`), if
        the unit is on the transfer plane and that is another worker; else `page_source`."""
        holder = kv.holder if kv is not None else None
        if self._peer is not None and holder is not None and holder.address != self._peer.address:
            return HolderPageSource(self._peer, holder.address)
        return self.page_source

    def _generate(self, call: NodeCall, inputs: dict[str, Any], report: Report) -> torch.Tensor:
        params = call.params
        kv = None
        if inputs.get("kv") is not None:
            kv = kv_input(call, inputs["kv"], self.runner.model_id, self.runner.layout)
        prompt = node_prompt(call, self.runner, inputs, kv)
        if not prompt.ids:
            raise UnitInputError(f"node {call.node_id!r}: the prompt is empty")
        guidance = float(params.get("guidance_scale", self.config.guidance_scale))
        branches = [(Prompt.of(prompt.ids), prompt.known)]
        if guidance != 1.0:
            negative = inputs.get("negative_prompt", params.get("negative_prompt", ""))
            branches.append((Prompt.of(prompt_ids(call, self.runner, negative, None, "negative_prompt") or [BOS_ID]),
                             ()))
        source = self._source(kv)
        kvs = [self.runner.encode_cached(p, self.kv_store, tenant_salt=call.tenant, known=pages, source=source)
               for p, pages in branches]
        steps = int(params.get("steps") or self.config.steps)
        meter = ProgressMeter(report, steps, "steps").start()
        latents = self.runner.denoise(kvs, seed=int(params.get("seed", 0)), steps=steps,
                                      guidance_scale=guidance, on_step=lambda i, n: meter.advance())
        return latents[0]

    async def execute(self, call: NodeCall, ctx: NodeContext) -> NodeResult:
        inputs = await self.joined_inputs(call)
        latents = await self.run_blocking(self._generate, call, inputs, on_loop(ctx, asyncio.get_running_loop()))
        return NodeResult(outputs=map_outputs(latents, call.output_ports, call.node_id))

    def metrics(self) -> dict[str, float]:
        """The runner's `diffusion.*` counters: prompt tokens computed here and reused (read from
        pages this worker held or pulled from another, never recomputed), steps, images. The KV
        store's metrics, pulls included (`kv.pull.pages`, `kv.pull.bytes`), come from the
        worker's KV hosting."""
        stats = self.runner.stats
        return {"diffusion.prompt_tokens_computed": float(stats.prompt_tokens_computed),
                "diffusion.prompt_tokens_reused": float(stats.prompt_tokens_reused),
                "diffusion.steps": float(stats.steps), "diffusion.images": float(stats.images)}

    async def close(self) -> None:
        await super().close()
        if self._own_kv:
            self.kv_store.close()
        for key in self._keys:
            self.shared.release(key)
        if self._own_weights:
            self.shared.close()
