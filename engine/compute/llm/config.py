"""Configuration of one LLM engine, built once by its owner and passed down."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.compute.llm.errors import LLMError
from engine.data.kv.policy import EvictionPolicy
from engine.data.kv.store import WritePolicy


class EngineConfigError(LLMError, ValueError):
    """An engine setting is out of range; the message names it."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How an engine batches, caches and keeps sessions.

    * `page_size`: tokens per KV page (the KV layout's page size).
    * `max_running`: sequences in the running batch at once (each holds one tail page).
    * `max_prefill_tokens`: prompt tokens computed per step, across sequences (chunked prefill).
    * `device_pages` / `host_pages` / `disk_path` + `disk_pages`: tier sizes of the engine's
      own KV store (ignored when the engine is given a store). `disk_path` is a directory: the
      engine takes its first free slot there (`slot-0`, `slot-1`, ...: a slot is free when no
      live process holds its file), so the replicas of a role on one host each get one, and a
      replica's replacement takes over the slot it left, with the pages in it.
    * `eviction` (`lru`, `lfu`): which page a full tier lets go first; `write_policy`
      (`write_back`: a page goes down a tier when it is evicted; `write_through`: to every
      lower tier as it is written).
    * `prefix_cache`: reuse cached prefixes; off, every request computes its whole prompt and
      its pages are freed when it ends.
    * `session_ttl_s`: an idle session's pages stay pinned this long.
    * `seed`: seeds the draws of requests that carry no seed of their own.
    * `packed_weights`: in bfloat16 on a CPU with native oneDNN bfloat16, keep the linear
      weights packed in oneDNN's layout too (`engine.compute.llm.products`): faster products,
      at the cost of a second copy of those weights in the process.
    * `packed_float32`: in float32, keep such a packed copy of each weight whose decode products
      were measured fastest over one (`engine.compute.llm.products.plan_products`; for
      SmolLM2-135M up to about 540 MB, its tied LM head included).
      Unset (None), each is on where the process's weights are its own, and off where they are
      one copy its host shares among processes (`host_shared`, see `for_weights`): packed
      copies cannot be shared, and two replicas of a model would hold about three copies.
    """

    page_size: int = 16
    max_running: int = 32
    max_prefill_tokens: int = 2048
    device_pages: int = 4096
    host_pages: int | None = None
    disk_path: str | None = None
    disk_pages: int = 0
    eviction: str = EvictionPolicy.LRU.value
    write_policy: str = WritePolicy.WRITE_BACK.value
    prefix_cache: bool = True
    session_ttl_s: float = 600.0
    seed: int | None = 0
    packed_weights: bool | None = None
    packed_float32: bool | None = None

    def __post_init__(self) -> None:
        for name in ("page_size", "max_running", "max_prefill_tokens", "device_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise EngineConfigError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.host_pages is not None and self.host_pages <= 0:
            raise EngineConfigError(f"EngineConfig.host_pages must be positive, got {self.host_pages!r}")
        if self.disk_path is not None and self.disk_pages <= 0:
            raise EngineConfigError("EngineConfig.disk_pages must be positive when disk_path is set")
        for name, allowed in (("eviction", EvictionPolicy), ("write_policy", WritePolicy)):
            if getattr(self, name) not in {a.value for a in allowed}:
                raise EngineConfigError(f"EngineConfig.{name} must be one of {sorted(a.value for a in allowed)},"
                                        f" got {getattr(self, name)!r}")
        if self.session_ttl_s <= 0:
            raise EngineConfigError(f"EngineConfig.session_ttl_s must be positive, got {self.session_ttl_s!r}")

    def for_weights(self, host_shared: bool) -> EngineConfig:
        """This config with `packed_weights`/`packed_float32` decided where unset: off for weights
        the host shares among processes (`WeightStore` origin "published" or "attached"), on
        otherwise."""
        return replace(self, packed_weights=not host_shared if self.packed_weights is None else self.packed_weights,
                       packed_float32=not host_shared if self.packed_float32 is None else self.packed_float32)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> EngineConfig:
        """From a role's params (unknown keys are the caller's business, not ours)."""
        names = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
        return cls(**{k: v for k, v in params.items() if k in names})
