"""What the KV-aware load balancer is given: the prompt's page keys and the pages each worker holds.

The `kv_aware` policy (`engine.flow.balance.KVAware`) scores workers by how many leading
pages of a request's prompt they already hold (`Candidate.cached_prefix_pages`). For roles
with that policy the dispatcher asks a `KVRouter` for a `PrefixHint`:

1. **The prompt's page keys**, computed here without the model stack (the flow layer never
   imports the compute layer). A worker whose unit keeps a KV cache reports how it names
   pages in its registration, `meta["kv"]` = {`model_id`, `page_size`, ...} (see
   `engine.worker.kv`); with those, the keys are `engine.data.kv.keys.page_hashes` of the
   token ids, seeded by model id and the call's tenant (`NodeCall.tenant`): byte for byte what
   the engine computes, so two tenants' equal prompts have different keys and neither is routed
   toward (or counted as cached on) the other's pages. The token ids come from the node call's inputs:

   * `kv`, a `KVRef` carrying a hold (an `llm.prefill` handoff, i.e. an `llm.decode` node):
     its `page_hashes` as they are;
   * `tokens` (token ids): hashed as above;
   * `prompt` (text): only with a `PromptTokenizer`, a callable the composition root may
     pass in (e.g. `engine.compute.models.role_tokenizers.RoleTokenizers`, which loads just the role
     model's tokenizer); without one a text prompt has no keys.

   A node with a `session` param has no keys either (its prompt is the server-side history
   plus the new message; route sessions with `consistent_hash`), nor has a role whose
   workers run without a prefix cache. No keys: the policy decides on load alone.

2. **Who holds them**: `lookup(keys)` on the distributed KV index the workers publish to
   (`RedisKVIndex` under `kv_index_namespace(registry namespace)`; `KVRouter.for_registry`
   finds it from a `RedisRegistry`), off the event loop and within `timeout_s`. An index
   that fails or is slow costs the hint its counts (load alone decides), never the call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.data.kv.errors import KVIndexError
from engine.data.kv.index import RedisKVIndex
from engine.data.kv.keys import ExtraKeys, page_hashes
from engine.data.kv.ref import KVRef
from engine.flow.discovery import RedisRegistry, Registry, WorkerSnapshot
from engine.spec.calls import NodeCall
from engine.spec.graph import RoleSpec

log = logging.getLogger(__name__)

KV_META_KEY = "kv"
"""The key of a worker's registration `meta` under which a KV-caching unit describes its pages."""

PromptTokenizer = Callable[[RoleSpec, str], Sequence[int]]
"""`(role, text) -> token ids`, exactly as the role's model tokenizes a text prompt."""


def kv_index_namespace(registry_namespace: str) -> str:
    """The KV index namespace of the workers registered under `registry_namespace`."""
    return f"{registry_namespace}:kv"


class KVPrefixIndex(Protocol):
    """What the router needs of the KV index (`RedisKVIndex` provides it; blocking calls)."""

    def lookup(self, pages: Sequence[str]) -> Mapping[str, int]:
        """Per live worker id, how many leading `pages` it holds (workers holding none left out)."""
        ...


@dataclass(frozen=True, slots=True)
class PrefixHint:
    """A request's prompt page keys (`BalanceRequest.prefix_pages`) and, per worker id, how many
    leading ones it holds (`candidates_from(cached=...)`)."""

    pages: tuple[str, ...] = ()
    cached: Mapping[str, int] = field(default_factory=dict)


NO_HINT = PrefixHint()


def role_kv_meta(snapshots: Sequence[WorkerSnapshot]) -> Mapping[str, Any] | None:
    """How the role's workers name pages (every replica runs the same model and page size)."""
    for snapshot in snapshots:
        meta = snapshot.info.meta.get(KV_META_KEY)
        if isinstance(meta, Mapping) and isinstance(meta.get("page_size"), int) and meta.get("model_id"):
            return meta
    return None


def prompt_pages(
    role: RoleSpec,
    call: NodeCall,
    kv_meta: Mapping[str, Any] | None,
    tokenizer: PromptTokenizer | None = None,
    max_pages: int = 1024,
) -> tuple[str, ...]:
    """The page keys of `call`'s prompt that a worker could have cached (see the module docstring);
    empty when they cannot be known here. At most `max_pages`, and never the page holding the
    prompt's last token (the engine always computes that one)."""
    kv = call.inputs.get("kv")
    if isinstance(kv, KVRef) and kv.hold is not None:
        return tuple(kv.page_hashes[:max_pages])
    if kv_meta is None or call.params.get("session") is not None or kv_meta.get("prefix_cache") is False:
        return ()
    tokens = call.inputs.get("tokens")
    prompt = call.inputs.get("prompt")
    if isinstance(tokens, list | tuple) and tokens and all(isinstance(t, int) and t >= 0 for t in tokens):
        ids: Sequence[int] = tokens
    elif isinstance(prompt, str) and prompt and tokenizer is not None:
        ids = tokenizer(role, prompt)
    else:
        return ()
    page_size = int(kv_meta["page_size"])
    usable = min((len(ids) - 1) // page_size, max_pages) * page_size
    if usable <= 0:
        return ()
    extra = ExtraKeys(model_id=str(kv_meta["model_id"]), tenant_salt=call.tenant)
    return tuple(page_hashes(list(ids[:usable]), page_size, extra_keys=extra))


class KVRouter:
    """Builds `PrefixHint`s for the dispatcher. Without an index it still computes page keys
    (the policy then sees no cached pages anywhere)."""

    def __init__(
        self,
        index: KVPrefixIndex | None,
        *,
        tokenizer: PromptTokenizer | None = None,
        timeout_s: float = 0.5,
        max_pages: int = 1024,
    ) -> None:
        if timeout_s <= 0 or max_pages <= 0:
            raise ValueError("timeout_s and max_pages must be positive")
        self.index = index
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.max_pages = max_pages

    @classmethod
    def for_registry(cls, registry: Registry, **options: Any) -> KVRouter:
        """A router over the KV index of the workers in `registry` (a Redis registry has one; an
        in-process registry has none)."""
        index = None
        if isinstance(registry, RedisRegistry):
            index = RedisKVIndex.from_url(registry.url, namespace=kv_index_namespace(registry.namespace))
        return cls(index, **options)

    def _hint(self, role: RoleSpec, call: NodeCall, kv_meta: Mapping[str, Any] | None) -> PrefixHint:
        pages = prompt_pages(role, call, kv_meta, self.tokenizer, self.max_pages)
        if not pages or self.index is None:
            return PrefixHint(pages)
        try:
            cached = dict(self.index.lookup(pages))
        except KVIndexError as exc:
            log.warning("KV index lookup for role %r failed (%s); balancing on load alone", role.name, exc)
            cached = {}
        return PrefixHint(pages, cached)

    async def hint(self, role: RoleSpec, call: NodeCall, snapshots: Sequence[WorkerSnapshot]) -> PrefixHint:
        """The hint for dispatching `call` to one of `snapshots` (workers of `role`)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await asyncio.to_thread(self._hint, role, call, role_kv_meta(snapshots))
        except TimeoutError:
            log.warning("KV-aware hint for role %r took over %.2f s; balancing on load alone", role.name,
                        self.timeout_s)
            return NO_HINT

    def close(self) -> None:
        if isinstance(self.index, RedisKVIndex):
            self.index.client.close()
