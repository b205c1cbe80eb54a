"""Reaching a deployment's role workers through its registry namespace.

`NamespaceExecutors` keeps, per namespace, a registry and an `Executor` whose
`WorkerDispatcher` sends node calls to the workers listed there. With Redis any process
reaches any deployment this way (a Celery worker executing a run, a second web process);
the embedded service uses it for deployments it does not host itself.

Each namespace's executor has its own seat on the transfer plane (`Peer`), keyed with that
deployment's worker-plane keys (`RunTicket.plane_keys`): one deployment's keys never reach
another's workers. Use one instance from one event loop; `aclose()` closes every executor,
registry and seat.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.data.curve import PlaneKeys
from engine.data.peer import Peer, PeerConfig
from engine.data.wire import TensorRef
from engine.flow.discovery import Registry, RegistryError, WorkerSnapshot, make_registry
from engine.flow.executor import Executor
from engine.flow.kvroute import KVRouter, PromptTokenizer
from engine.flow.remote import WorkerDispatcher
from engine.spec.kinds import KindRegistry
from studio.workflows.runs.execution import DeploymentUnavailable
from studio.workflows.runs.store import RunTicket

log = logging.getLogger(__name__)

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
class _Reach:
    registry: Registry
    executor: Executor
    peer: Peer
    """This process's seat on the deployment's worker plane (its keys)."""


def dispatcher_for(registry: Registry, peer: Peer, prompt_tokenizer: PromptTokenizer | None) -> WorkerDispatcher:
    """The studio's dispatcher to the workers of `registry`: `kv_aware` roles route text prompts
    by their cached pages, tokenized with `prompt_tokenizer` (the llm roles' own tokenizers)."""
    return WorkerDispatcher(registry, peer, kv_router=KVRouter.for_registry(registry, tokenizer=prompt_tokenizer))


class NamespaceExecutors:
    """Executors over registry namespaces (Redis), at most `max_namespaces` kept open."""

    def __init__(self, kinds: KindRegistry, registry_url: str | None, *, max_namespaces: int = 64,
                 registry_ttl_s: float = 2.0, prompt_tokenizer: PromptTokenizer | None = None) -> None:
        self._kinds = kinds
        self._tokenizer = prompt_tokenizer
        self._url = registry_url
        self._max = max_namespaces
        self._ttl_s = registry_ttl_s
        self._reach: OrderedDict[str, _Reach] = OrderedDict()
        self._listings: OrderedDict[str, Registry] = OrderedDict()

    @property
    def available(self) -> bool:
        """Whether other processes' deployments are reachable (a shared registry is configured)."""
        return self._url is not None

    def _get(self, namespace: str, keys: PlaneKeys | None) -> _Reach:
        """The reach of `namespace`, made with `keys` (the deployment's plane keys) if it has
        none yet; None: only an existing reach (listing workers needs no keys)."""
        reach = self._reach.get(namespace)
        if reach is not None and (keys is None or reach.peer.keys == keys):
            self._reach.move_to_end(namespace)
            return reach
        if self._url is None:
            raise DeploymentUnavailable("no shared worker registry is configured (REDIS_URL)")
        if keys is None:
            raise DeploymentUnavailable(f"no worker-plane keys for namespace {namespace!r}: the deployment ended")
        if reach is not None:  # the deployment got new keys (started again): the old seat is of no use
            del self._reach[namespace]
            asyncio.get_running_loop().create_task(self._close(reach))
        registry = make_registry(self._url, namespace=namespace, ttl_s=self._ttl_s)
        peer = Peer.start(PeerConfig(keys=keys))
        executor = Executor(dispatcher_for(registry, peer, self._tokenizer), self._kinds)
        reach = self._reach[namespace] = _Reach(registry, executor, peer)
        while len(self._reach) > self._max:
            _, old = self._reach.popitem(last=False)
            asyncio.get_running_loop().create_task(self._close(old))
        return reach

    async def executor_for(self, ticket: RunTicket) -> Executor:
        if not ticket.namespace:
            raise DeploymentUnavailable(f"deployment {ticket.deployment_id} has no worker namespace")
        if ticket.plane_keys is None:
            raise DeploymentUnavailable(f"deployment {ticket.deployment_id} has ended (no worker-plane keys)")
        return self._get(ticket.namespace, ticket.plane_keys).executor

    async def materialize(self, ticket: RunTicket, outputs: dict[str, Any]) -> dict[str, Any]:
        if not ticket.namespace:
            raise DeploymentUnavailable(f"deployment {ticket.deployment_id} has no worker namespace")
        return await pull_outputs(self._get(ticket.namespace, ticket.plane_keys).peer, outputs)

    async def snapshots(self, namespace: str) -> list[WorkerSnapshot]:
        """The live workers of `namespace` ([] when the registry cannot be read)."""
        if self._url is None:
            return []
        reach = self._reach.get(namespace)
        registry = reach.registry if reach is not None else self._listing(namespace)
        try:
            return await registry.workers()
        except RegistryError as exc:
            log.warning("listing the workers of %s failed: %s", namespace, exc)
            return []

    async def forget(self, namespace: str) -> None:
        reach = self._reach.pop(namespace, None)
        if reach is not None:
            await self._close(reach)
        listing = self._listings.pop(namespace, None)
        if listing is not None:
            await listing.close()

    def _listing(self, namespace: str) -> Registry:
        """A registry of `namespace` kept for listing its workers (no executor, no keys)."""
        registry = self._listings.get(namespace)
        if registry is None:
            assert self._url is not None
            registry = self._listings[namespace] = make_registry(self._url, namespace=namespace, ttl_s=self._ttl_s)
            while len(self._listings) > self._max:
                _, old = self._listings.popitem(last=False)
                asyncio.get_running_loop().create_task(old.close())
        return registry

    @staticmethod
    async def _close(reach: _Reach) -> None:
        await reach.executor.aclose()
        await reach.registry.close()
        reach.peer.close()

    async def aclose(self) -> None:
        reaches, self._reach = list(self._reach.values()), OrderedDict()
        for reach in reaches:
            await self._close(reach)
        listings, self._listings = list(self._listings.values()), OrderedDict()
        for registry in listings:
            await registry.close()
