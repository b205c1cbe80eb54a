"""Reaching a deployment's role workers through its registry namespace.

`NamespaceExecutors` keeps, per namespace, a `WorkerPlane` (`engine.client.plane`): a registry
and an `Executor` whose dispatcher sends node calls to the workers listed there. With Redis any
process reaches any deployment this way (a Celery worker executing a run, a second web process);
the embedded service uses it for deployments it does not host itself.

Each namespace's plane has its own seat on the transfer plane, keyed with that deployment's
worker-plane keys (`RunTicket.plane_keys`): one deployment's keys never reach another's workers.
Use one instance from one event loop; `aclose()` closes every plane and registry.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

from engine.client.cluster import Registry, RegistryError, WorkerSnapshot, make_registry
from engine.client.keys import PlaneKeys
from engine.client.plane import PromptTokenizer, WorkerPlane
from engine.client.runs import Executor
from engine.spec.kinds import KindRegistry
from studio.workflows.runs.execution import DeploymentUnavailable
from studio.workflows.runs.store import RunTicket

log = logging.getLogger(__name__)


class NamespaceExecutors:
    """Executors over registry namespaces (Redis), at most `max_namespaces` kept open."""

    def __init__(self, kinds: KindRegistry, registry_url: str | None, *, max_namespaces: int = 64,
                 registry_ttl_s: float = 2.0, prompt_tokenizer: PromptTokenizer | None = None) -> None:
        self._kinds = kinds
        self._tokenizer = prompt_tokenizer
        self._url = registry_url
        self._max = max_namespaces
        self._ttl_s = registry_ttl_s
        self._reach: OrderedDict[str, WorkerPlane] = OrderedDict()
        self._listings: OrderedDict[str, Registry] = OrderedDict()

    @property
    def available(self) -> bool:
        """Whether other processes' deployments are reachable (a shared registry is configured)."""
        return self._url is not None

    def _get(self, namespace: str, keys: PlaneKeys | None) -> WorkerPlane:
        """The plane of `namespace`, made with `keys` (the deployment's plane keys) if it has
        none yet; None: only an existing plane (listing workers needs no keys)."""
        reach = self._reach.get(namespace)
        if reach is not None and (keys is None or reach.keys == keys):
            self._reach.move_to_end(namespace)
            return reach
        if self._url is None:
            raise DeploymentUnavailable("no shared worker registry is configured (REDIS_URL)")
        if keys is None:
            raise DeploymentUnavailable(f"no worker-plane keys for namespace {namespace!r}: the deployment ended")
        if reach is not None:  # the deployment got new keys (started again): the old seat is of no use
            del self._reach[namespace]
            asyncio.get_running_loop().create_task(reach.aclose())
        reach = self._reach[namespace] = WorkerPlane.connect(self._url, namespace, keys, self._kinds,
                                                             registry_ttl_s=self._ttl_s,
                                                             prompt_tokenizer=self._tokenizer)
        while len(self._reach) > self._max:
            _, old = self._reach.popitem(last=False)
            asyncio.get_running_loop().create_task(old.aclose())
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
        return await self._get(ticket.namespace, ticket.plane_keys).pull_outputs(outputs)

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
            await reach.aclose()
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

    async def aclose(self) -> None:
        reaches, self._reach = list(self._reach.values()), OrderedDict()
        for reach in reaches:
            await reach.aclose()
        listings, self._listings = list(self._listings.values()), OrderedDict()
        for registry in listings:
            await registry.close()
