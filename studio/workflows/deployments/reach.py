"""Reaching a deployment's role workers through its registry namespace.

`NamespaceExecutors` keeps, per namespace, a registry and an `Executor` whose
`WorkerDispatcher` sends node calls to the workers listed there. With Redis any process
reaches any deployment this way (a Celery worker executing a run, a second web process);
the embedded service uses it for deployments it does not host itself.

Use one instance from one event loop; `aclose()` closes every executor, registry and
the transfer-plane seat (`Peer`) they share.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.data.peer import Peer
from engine.data.wire import TensorRef
from engine.flow.discovery import Registry, RegistryError, WorkerSnapshot, make_registry
from engine.flow.executor import Executor
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


class NamespaceExecutors:
    """Executors over registry namespaces (Redis), at most `max_namespaces` kept open."""

    def __init__(self, kinds: KindRegistry, registry_url: str | None, *, max_namespaces: int = 64,
                 registry_ttl_s: float = 2.0) -> None:
        self._kinds = kinds
        self._url = registry_url
        self._max = max_namespaces
        self._ttl_s = registry_ttl_s
        self._reach: OrderedDict[str, _Reach] = OrderedDict()
        self._peer: Peer | None = None

    @property
    def available(self) -> bool:
        """Whether other processes' deployments are reachable (a shared registry is configured)."""
        return self._url is not None

    def peer(self) -> Peer:
        """This process's seat on the transfer plane (started on first use)."""
        if self._peer is None:
            self._peer = Peer.start()
        return self._peer

    def registry(self, namespace: str) -> Registry:
        return self._get(namespace).registry

    def _get(self, namespace: str) -> _Reach:
        reach = self._reach.get(namespace)
        if reach is not None:
            self._reach.move_to_end(namespace)
            return reach
        if self._url is None:
            raise DeploymentUnavailable("no shared worker registry is configured (REDIS_URL)")
        registry = make_registry(self._url, namespace=namespace, ttl_s=self._ttl_s)
        executor = Executor(WorkerDispatcher(registry, self.peer()), self._kinds)
        reach = self._reach[namespace] = _Reach(registry, executor)
        while len(self._reach) > self._max:
            _, old = self._reach.popitem(last=False)
            asyncio.get_running_loop().create_task(self._close(old))
        return reach

    async def executor_for(self, ticket: RunTicket) -> Executor:
        if not ticket.namespace:
            raise DeploymentUnavailable(f"deployment {ticket.deployment_id} has no worker namespace")
        return self._get(ticket.namespace).executor

    async def materialize(self, ticket: RunTicket, outputs: dict[str, Any]) -> dict[str, Any]:
        return await pull_outputs(self.peer(), outputs)

    async def snapshots(self, namespace: str) -> list[WorkerSnapshot]:
        """The live workers of `namespace` ([] when the registry cannot be read)."""
        if self._url is None:
            return []
        try:
            return await self._get(namespace).registry.workers()
        except RegistryError as exc:
            log.warning("listing the workers of %s failed: %s", namespace, exc)
            return []

    async def forget(self, namespace: str) -> None:
        reach = self._reach.pop(namespace, None)
        if reach is not None:
            await self._close(reach)

    @staticmethod
    async def _close(reach: _Reach) -> None:
        await reach.executor.aclose()
        await reach.registry.close()

    async def aclose(self) -> None:
        reaches, self._reach = list(self._reach.values()), OrderedDict()
        for reach in reaches:
            await self._close(reach)
        if self._peer is not None:
            self._peer.close()
            self._peer = None
