"""`DiffusionRunner`: image latents denoised by the LLM's transformer, attending to the prompt's KV.

The prompt's K/V come from the LLM path itself (`PagedForward.prefill`, the code the
`llm` role runs), from KV pages another role computed (pages by key from a
`PageSource`, or a prefill `KVHandoff`), or from both: pages cover the leading full
pages and the rest is prefilled on top of them. They are computed once per request and
reused at every step; `mode="recompute"` instead recomputes the prompt with the image
tokens at every step (the reference the reuse path is checked against).

A step: patchify the latents, embed them with the timestep (`DiffusionHead`), run the
transformer over them (`ImageTokenForward`), project to a velocity; with classifier-free
guidance the conditional and unconditional branches are one batch of two and
`v = v_uncond + g * (v_cond - v_uncond)`. `diffusers`' `FlowMatchEulerDiscreteScheduler`
steps the latents.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from engine.compute.diffusion.forward import DiffusionModelError, ImageTokenForward, KVBatch, PromptKV
from engine.compute.diffusion.head import DiffusionHead, patchify, unpatchify
from engine.compute.llm.forward import PagedForward, PrefillChunk
from engine.compute.llm.transfer import KVHandoff
from engine.compute.models.loader import LoadedModel
from engine.compute.prefix.keys import MultimodalItem, cache_key
from engine.compute.weights.seeding import build_seeded
from engine.data.kv.errors import KVPageNotFound, KVTransferError
from engine.data.kv.keys import ExtraKeys, PageHash, page_hashes
from engine.data.kv.layout import KVLayout, dtype_name
from engine.data.kv.source import PageSource
from engine.data.kv.store import KVStore

Mode = Literal["reuse", "recompute"]


@dataclass(frozen=True, slots=True)
class DiffusionConfig:
    """Latent geometry, sampling defaults and the head's seed.

    `(latent_size / patch_size) ** 2` image tokens per image; `shift` is the flow-matching
    schedule's time shift; `page_size` the KV layout's page size (that of the LLM role
    whose pages are reused).
    """

    latent_channels: int = 4
    latent_size: int = 16
    patch_size: int = 2
    steps: int = 20
    guidance_scale: float = 4.0
    shift: float = 1.0
    page_size: int = 16
    head_seed: int = 17
    freq_dim: int = 64

    def __post_init__(self) -> None:
        for name in ("latent_channels", "latent_size", "patch_size", "steps", "page_size", "freq_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DiffusionConfig.{name} must be a positive int, got {value!r}")
        if self.latent_size % self.patch_size:
            raise ValueError(f"latent_size {self.latent_size} is not a multiple of patch_size {self.patch_size}")

    @property
    def grid(self) -> int:
        return self.latent_size // self.patch_size

    @property
    def num_tokens(self) -> int:
        return self.grid**2

    @property
    def patch_dim(self) -> int:
        return self.latent_channels * self.patch_size**2


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as token ids (model ids: placeholders where items go) and its multimodal items."""

    token_ids: tuple[int, ...]
    items: tuple[MultimodalItem, ...] = ()

    @classmethod
    def of(cls, token_ids: Sequence[int], items: Sequence[MultimodalItem] = ()) -> Prompt:
        return cls(tuple(int(t) for t in token_ids), tuple(items))


@dataclass(slots=True)
class DiffusionStats:
    prompt_tokens_computed: int = 0
    prompt_tokens_reused: int = 0
    steps: int = 0
    images: int = 0


class DiffusionRunner:
    """Denoises latents with `model`'s transformer (shared, never copied) and a small head.

    Not thread-safe: one owner calls it (the `diffusion` unit runs it in one thread).
    """

    def __init__(self, model: LoadedModel, config: DiffusionConfig | None = None,
                 head: DiffusionHead | None = None) -> None:
        self.model = model
        self.config = config = config or DiffusionConfig()
        dtype = next(model.model.parameters()).dtype
        self.layout = KVLayout(config.page_size, model.num_layers, model.num_kv_heads, model.head_dim,
                               dtype_name(dtype))
        # Prompts only (prefills, which multiply by MKL): no packed float32 copy of the weights.
        self.prefill = PagedForward(model.model, self.layout, packed_float32=False, measure_products=False)
        self.transformer = ImageTokenForward(model.model)
        hidden = self.transformer.hidden_size
        self._device = next(model.model.parameters()).device
        self.head = head if head is not None else build_seeded(
            lambda: DiffusionHead(config.patch_dim, hidden, (config.grid, config.grid), config.freq_dim),
            config.head_seed,
        ).to(device=self._device, dtype=dtype)
        self.stats = DiffusionStats()
        self._empty_pool = torch.zeros((0, *self.layout.page_shape), dtype=dtype, device=self._device)

    @property
    def model_id(self) -> str:
        return self.model.model_id

    # -- the prompt's KV -------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt, pages: Sequence[torch.Tensor] = ()) -> PromptKV:
        """The prompt's K/V by the LLM's own prefill; `pages` (in the layout's page shape) hold
        the K/V of its leading full pages, computed elsewhere, and are not recomputed."""
        if not prompt.token_ids:
            raise DiffusionModelError("the prompt is empty")
        reused = min(len(pages), len(prompt.token_ids) // self.layout.page_size)
        if not reused:
            return self._encode_over(prompt, self._empty_pool, [])
        pool = torch.stack([self.layout.check_page(p).to(self._device) for p in pages[:reused]])
        return self._encode_over(prompt, pool, list(range(reused)))

    def page_keys(self, prompt: Prompt, tenant_salt: str | None = None,
                  known: Sequence[PageHash] = ()) -> list[PageHash]:
        """Keys of the prompt's full pages, as the `llm` role names them (same model, same salt,
        multimodal items as sentinels): a store shared with that role serves them to both.

        `known` are the keys of its leading pages as the `llm` role sent them, already checked
        to be these tokens' under this tenant (`KVRef.pages_for`): they are taken as they are and
        only the pages after them are hashed, continuing their chain."""
        key_ids = cache_key(prompt.token_ids, prompt.items)
        page = self.layout.page_size
        if len(known) * page > len(key_ids):
            raise DiffusionModelError(f"{len(known)} known page keys for a prompt of {len(key_ids)} tokens"
                                      f" ({page} a page)")
        if known:
            return [*known, *page_hashes(key_ids[len(known) * page:], page, prior=known[-1])]
        return page_hashes(key_ids, page, extra_keys=ExtraKeys(model_id=self.model_id, tenant_salt=tenant_salt))

    def encode_cached(self, prompt: Prompt, store: KVStore, *, tenant_salt: str | None = None,
                      known: Sequence[PageHash] = (), source: PageSource | None = None,
                      timeout_s: float = 10.0) -> PromptKV:
        """`encode_prompt` over a KV store: the leading pages the store holds (after pulling
        what `source` has of the rest, e.g. the `llm` worker that computed them) are read in
        place, the rest is prefilled on top of them and its full pages are stored for the next
        request. Pages are locked only while they are read. `known`: see `page_keys`."""
        if store.layout != self.layout:
            raise DiffusionModelError(f"store layout {store.layout.fingerprint()} is not {self.layout.fingerprint()}")
        keys = self.page_keys(prompt, tenant_salt, known)
        run = store.resident_run(keys)
        if source is not None and run < len(keys):
            run = source.pull(store, keys, timeout_s)
        try:
            slots = store.lock(keys[:run])
        except KVPageNotFound:  # evicted since: compute them
            run, slots = 0, []
        try:
            kv = self._encode_over(prompt, store.device_pool, slots)
        finally:
            store.unlock(keys[:run])
        for index in range(run, len(keys)):
            if not store.contains(keys[index]):
                store.put(keys[index], kv.page(index, self.layout))
        return kv

    def _encode_over(self, prompt: Prompt, pool: torch.Tensor, slots: Sequence[int]) -> PromptKV:
        ids = list(prompt.token_ids)
        page = self.layout.page_size
        reused = len(slots)
        start = reused * page
        prefix = pool[torch.tensor(list(slots), dtype=torch.long, device=pool.device)] if reused else None
        self.stats.prompt_tokens_reused += min(start, len(ids))
        if start >= len(ids):
            assert prefix is not None
            return PromptKV.from_pages(prefix, len(ids))
        embeds = []
        for item in prompt.items:
            if item.embeds is None or item.end <= start:
                continue
            if item.start < start:
                raise DiffusionModelError(f"reused pages end inside a {item.kind} item at {item.start}")
            embeds.append((item.start - start, item.embeds))
        chunk = PrefillChunk(token_ids=ids[start:], start=start, prefix_slots=list(slots), tail=None, embeds=embeds)
        _, fresh = self.prefill.prefill(chunk, pool, want_logits=False)
        self.stats.prompt_tokens_computed += len(ids) - start
        return PromptKV.from_pages(torch.cat((prefix, fresh)) if prefix is not None else fresh, len(ids))

    def from_handoff(self, handoff: KVHandoff, store: KVStore, source: PageSource,
                     timeout_s: float = 10.0) -> PromptKV:
        """A prompt prefilled by an `llm` role (`KVHandoff`): its pages pulled into `store` from
        `source` (the prefill worker), its partial last page appended from the handoff."""
        if handoff.model_id != self.model_id:
            raise DiffusionModelError(f"handoff of model {handoff.model_id!r} given to a runner of {self.model_id!r}")
        if handoff.layout != self.layout.to_dict():
            raise DiffusionModelError(f"handoff layout {handoff.layout} is not {self.layout.to_dict()}")
        keys = list(handoff.page_hashes)
        if keys and source.pull(store, keys, timeout_s) < len(keys):
            raise KVTransferError(f"the source lacks pages of the handoff {handoff.handoff_id!r}")
        slots = store.lock(keys)
        try:
            pages = store.device_pool[torch.tensor(slots, dtype=torch.long)] if keys else self._empty_pool
            if handoff.tail_len:
                assert handoff.tail is not None
                tail = self.layout.check_page(handoff.tail).to(pages.device)
                pages = torch.cat((pages, tail[None]))
            kv = PromptKV.from_pages(pages, handoff.num_tokens)
        finally:
            store.unlock(keys)
        self.stats.prompt_tokens_reused += handoff.num_tokens
        return kv

    # -- denoising -------------------------------------------------------------------------------

    def noise(self, seed: int) -> torch.Tensor:
        cfg = self.config
        gen = torch.Generator().manual_seed(seed)
        shape = (1, cfg.latent_channels, cfg.latent_size, cfg.latent_size)
        return torch.randn(shape, generator=gen).to(device=self._device, dtype=self._empty_pool.dtype)

    def scheduler(self, steps: int) -> FlowMatchEulerDiscreteScheduler:
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=self.config.shift)
        scheduler.set_timesteps(steps, device=self._device)
        return scheduler

    def _guide(self, velocity: torch.Tensor, guidance: float) -> torch.Tensor:
        if velocity.shape[0] == 1:
            return velocity
        return velocity[1:2] + guidance * (velocity[0:1] - velocity[1:2])

    @torch.inference_mode()
    def denoise(self, branches: Sequence[PromptKV], *, seed: int = 0, steps: int | None = None,
                guidance_scale: float | None = None, latents: torch.Tensor | None = None,
                on_step: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """Latents `(1, C, h, w)` denoised from `latents` (default: noise from `seed`).
        `on_step(i, steps)` is called after each step i (1-based), on this thread.

        `branches`: `[cond]`, or `[cond, uncond]` for classifier-free guidance. Their K/V are
        read, never modified, and reused by every step.
        """
        cfg = self.config
        steps = steps or cfg.steps
        guidance = cfg.guidance_scale if guidance_scale is None else guidance_scale
        batch = KVBatch.of(branches, cfg.num_tokens)
        x = self.noise(seed) if latents is None else latents.clone()
        scheduler = self.scheduler(steps)
        times = self.head.time_embeds(scheduler.timesteps, x.dtype)
        rotary = None
        for i, t in enumerate(scheduler.timesteps):
            # One row broadcast to the branches: `image_step` runs what they share once.
            hidden = self.head.embed(patchify(x, cfg.patch_size), t, times[i]).expand(len(branches), -1, -1)
            if rotary is None:
                rotary = self.transformer.image_rotary(hidden, batch)
            out = self.transformer.image_step(hidden, batch, rotary)
            velocity = self._guide(self.head.velocity(out), guidance)
            v = unpatchify(velocity, cfg.latent_channels, cfg.latent_size, cfg.latent_size, cfg.patch_size)
            x = scheduler.step(v, t, x, return_dict=False)[0]
            if on_step is not None:
                on_step(i + 1, steps)
        self.stats.steps += steps
        self.stats.images += 1
        return x

    @torch.inference_mode()
    def denoise_recompute(self, branches: Sequence[Prompt], *, seed: int = 0, steps: int | None = None,
                          guidance_scale: float | None = None, latents: torch.Tensor | None = None) -> torch.Tensor:
        """As `denoise`, but every step recomputes the prompts with the image tokens."""
        cfg = self.config
        steps = steps or cfg.steps
        guidance = cfg.guidance_scale if guidance_scale is None else guidance_scale
        ids = [list(p.token_ids) for p in branches]
        items = [list(p.items) for p in branches]
        x = self.noise(seed) if latents is None else latents.clone()
        scheduler = self.scheduler(steps)
        times = self.head.time_embeds(scheduler.timesteps, x.dtype)
        for i, t in enumerate(scheduler.timesteps):
            hidden = self.head.embed(patchify(x, cfg.patch_size), t, times[i])
            out = self.transformer.joint_forward(ids, hidden.expand(len(branches), -1, -1), items)
            velocity = self._guide(self.head.velocity(out), guidance)
            v = unpatchify(velocity, cfg.latent_channels, cfg.latent_size, cfg.latent_size, cfg.patch_size)
            x = scheduler.step(v, t, x, return_dict=False)[0]
        self.stats.prompt_tokens_computed += steps * sum(len(p) for p in ids)
        self.stats.steps += steps
        self.stats.images += 1
        return x

    def generate(self, prompt: Prompt, negative: Prompt | None = None, *, mode: Mode = "reuse", seed: int = 0,
                 steps: int | None = None, guidance_scale: float | None = None) -> torch.Tensor:
        """Latents for `prompt` (with CFG against `negative` when given and guidance != 1)."""
        guidance = self.config.guidance_scale if guidance_scale is None else guidance_scale
        prompts = [prompt] if negative is None or guidance == 1.0 else [prompt, negative]
        if mode == "recompute":
            return self.denoise_recompute(prompts, seed=seed, steps=steps, guidance_scale=guidance)
        kvs = [self.encode_prompt(p) for p in prompts]
        return self.denoise(kvs, seed=seed, steps=steps, guidance_scale=guidance)
