"""Reaching a deployment's role workers: its registry namespace, this process's seat on its
worker plane (keyed with the deployment's `PlaneKeys`), and an `Executor` whose calls go to the
workers listed there.

* `WorkerPlane` -- those three, made together (`connect` to a namespace, or `over` a registry the
  caller owns, such as a `LocalCluster`'s) and closed together; it pulls a run's outputs;
* `PromptTokenizer` -- `(role, text) -> token ids`: with one, `kv_aware` roles route text
  prompts to the worker that holds most of their pages (`engine.client.models.RoleTokenizers`);
* `pull_outputs` -- a run's outputs with every tensor reference pulled from the worker holding it.

Loads torch (the dispatcher's transfer plane).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.data.curve import PlaneKeys
from engine.data.peer import Peer, PeerConfig
from engine.data.wire import TensorRef
from engine.flow.discovery import Registry, WorkerSnapshot, make_registry
from engine.flow.executor import Executor
from engine.flow.kvroute import KVRouter, PromptTokenizer
from engine.flow.remote import WorkerDispatcher
from engine.spec.kinds import KindRegistry

__all__ = ["PULL_TIMEOUT_S", "PromptTokenizer", "WorkerPlane", "pull_outputs"]

PULL_TIMEOUT_S = 30.0


async def pull_outputs(peer: Peer, outputs: dict[str, Any], timeout_s: float = PULL_TIMEOUT_S) -> dict[str, Any]:
    """Run outputs with every `TensorRef` pulled from the worker holding it: a byte blob
    (1-D uint8) as bytes, any other tensor as nested lists."""
    out: dict[str, Any] = {}
    for name, value in outputs.items():
        if isinstance(value, TensorRef):
            data = await peer.pull_async(value, timeout_s)
            array = data.numpy(copy=True)
            out[name] = array.tobytes() if array.dtype == np.uint8 and array.ndim == 1 else array.tolist()
        else:
            out[name] = value
    return out


@dataclass(slots=True)
class WorkerPlane:
    """One deployment's workers as this process reaches them. Use it from one event loop;
    `aclose()` closes the executor and the seat, and the registry when the plane opened it."""

    registry: Registry
    executor: Executor
    """Runs whose node calls go to the workers of `registry` (`kv_aware` roles routed by their
    cached pages)."""
    peer: Peer
    """This process's seat on the deployment's worker plane: tensors given as run inputs are
    served from it, outputs are pulled through it."""
    owns_registry: bool

    @classmethod
    def connect(cls, registry_url: str, namespace: str, keys: PlaneKeys, kinds: KindRegistry, *,
                registry_ttl_s: float = 2.0, prompt_tokenizer: PromptTokenizer | None = None) -> WorkerPlane:
        """A plane over the registry namespace `namespace` at `registry_url` (Redis), keyed with
        `keys` (the deployment's own: one deployment's keys never reach another's workers)."""
        registry = make_registry(registry_url, namespace=namespace, ttl_s=registry_ttl_s)
        return cls._over(registry, keys, kinds, prompt_tokenizer, owns_registry=True)

    @classmethod
    def over(cls, registry: Registry, keys: PlaneKeys, kinds: KindRegistry, *,
             prompt_tokenizer: PromptTokenizer | None = None) -> WorkerPlane:
        """A plane over `registry`, which the caller keeps and closes (a `LocalCluster`'s)."""
        return cls._over(registry, keys, kinds, prompt_tokenizer, owns_registry=False)

    @classmethod
    def _over(cls, registry: Registry, keys: PlaneKeys, kinds: KindRegistry,
              prompt_tokenizer: PromptTokenizer | None, *, owns_registry: bool) -> WorkerPlane:
        peer = Peer.start(PeerConfig(keys=keys))
        router = KVRouter.for_registry(registry, tokenizer=prompt_tokenizer)
        executor = Executor(WorkerDispatcher(registry, peer, kv_router=router), kinds)
        return cls(registry, executor, peer, owns_registry)

    @property
    def keys(self) -> PlaneKeys | None:
        """The keys the plane's seat was made with."""
        return self.peer.keys

    async def workers(self) -> list[WorkerSnapshot]:
        """The live workers (raises `RegistryError` when the registry cannot be read)."""
        return await self.registry.workers()

    async def pull_outputs(self, outputs: dict[str, Any], timeout_s: float = PULL_TIMEOUT_S) -> dict[str, Any]:
        """`pull_outputs` through this plane's seat."""
        return await pull_outputs(self.peer, outputs, timeout_s)

    async def aclose(self) -> None:
        await self.executor.aclose()
        if self.owns_registry:
            await self.registry.close()
        self.peer.close()
