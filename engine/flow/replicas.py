"""Which replica of a role takes a node call.

The workers of a role come from the registry, read at most every `registry_refresh_s`; it is a
directory, not the source of truth on liveness: while it is unreachable the last list read
stands in for it, and when it lists no worker at all for a role (a restarted Redis before the
workers' next heartbeats re-register them, or workers still starting) a call looks again for
up to `no_worker_wait_s`. Among them the role's load-balancing policy chooses
(`engine.flow.balance`), with each worker's calls in flight from this dispatcher
(`outstanding`); calls with a `session` param go to the replica their session hashes to, and
`kv_aware` roles get the prompt's cached pages per worker from the `KVRouter`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from engine.flow.balance import BalanceRequest, ConsistentHash, KVAware, Policy, candidates_from, make_policy
from engine.flow.connections import WorkerLost
from engine.flow.discovery import Registry, RegistryError, WorkerSnapshot
from engine.flow.kvroute import NO_HINT, KVRouter
from engine.spec.calls import NodeCall
from engine.spec.graph import RoleSpec

log = logging.getLogger(__name__)

_NO_WORKER_POLL_S = 0.05
"""How often a call that found no worker of its role reads the registry again."""


class ReplicaChooser:
    def __init__(self, registry: Registry, kv_router: KVRouter, *, registry_refresh_s: float,
                 no_worker_wait_s: float) -> None:
        self._registry = registry
        self._kv_router = kv_router
        self._refresh_s = registry_refresh_s
        self._no_worker_wait_s = no_worker_wait_s
        self._policies: dict[str, Policy] = {}
        self._sessions: dict[str, Policy] = {}
        self._workers: dict[str, tuple[float, list[WorkerSnapshot]]] = {}
        self.outstanding: dict[str, int] = {}
        """Calls in flight per worker id, from this dispatcher."""

    async def snapshots(self, role: str, *, fresh: bool = False) -> list[WorkerSnapshot]:
        """The workers the registry lists for `role`, read at most every `registry_refresh_s`
        (or now, with `fresh`). While the registry fails, the last list read stands in for it."""
        cached = self._workers.get(role)
        now = time.monotonic()
        if cached is not None and not fresh and now - cached[0] <= self._refresh_s:
            return cached[1]
        try:
            listed = await self._registry.workers(role)
        except RegistryError as exc:
            if cached is None:
                raise
            log.warning("registry unavailable (%s); dispatching role %r to the %d worker(s) it last listed",
                        exc, role, len(cached[1]))
            self._workers[role] = (now, cached[1])
            return cached[1]
        self._workers[role] = (now, listed)
        return listed

    def _recent(self, role: str) -> list[WorkerSnapshot] | None:
        """What `listed(role)` returns at once, without reading the registry: a list read within
        `registry_refresh_s` that names a worker; else None."""
        cached = self._workers.get(role)
        if cached is not None and cached[1] and time.monotonic() - cached[0] <= self._refresh_s:
            return cached[1]
        return None

    def policy(self, role: RoleSpec) -> Policy:
        policy = self._policies.get(role.name)
        if policy is None:
            policy = self._policies[role.name] = make_policy(role.balance, role=role.name, **role.balance_params)
        return policy

    def session_policy(self, role: RoleSpec) -> Policy:
        """For the calls with a `session` param (a string), whatever the role's policy: a
        session's history lives on one worker, so they go to one replica, the one the session
        (its key within the call's tenant, `NodeCall.session_key`) hashes to among the live ones."""
        if role.balance == ConsistentHash.name:
            return self.policy(role)
        policy = self._sessions.get(role.name)
        if policy is None:
            policy = self._sessions[role.name] = ConsistentHash(role=role.name)
        return policy

    async def listed(self, role: str) -> list[WorkerSnapshot]:
        """`_snapshots(role)`, looking again for up to `no_worker_wait_s` while it lists nobody.
        Raises WorkerLost when the registry cannot be read and nothing was read before."""
        deadline = time.monotonic() + self._no_worker_wait_s
        fresh = False
        while True:
            try:
                listed = await self.snapshots(role, fresh=fresh)
            except RegistryError as exc:
                if time.monotonic() >= deadline:
                    raise WorkerLost(f"cannot find workers of role {role!r}: {exc}") from exc
                listed = []
            if listed or time.monotonic() >= deadline:
                return listed
            await asyncio.sleep(_NO_WORKER_POLL_S)
            fresh = True

    async def choose(self, role: RoleSpec, call: NodeCall, excluded: set[str],
                     usable: Callable[[str], bool]) -> WorkerSnapshot:
        """The worker of `role` that takes `call`, among those listed, not `excluded` and `usable`
        (not lost); NoWorkerError when none is."""
        listed = self._recent(role.name)
        if listed is None:
            listed = await self.listed(role.name)
        snapshots = [s for s in listed if s.info.worker_id not in excluded and usable(s.info.worker_id)]
        by_id = {s.info.worker_id: s for s in snapshots}
        session = call.session_key()
        hint = (await self._kv_router.hint(role, call, snapshots)
                if role.balance == KVAware.name and session is None else NO_HINT)
        candidates = candidates_from(snapshots, outstanding=self.outstanding, cached=hint.cached)
        request = BalanceRequest(request_id=call.call_id,
                                 session_key=session, prefix_pages=hint.pages)
        policy = self.policy(role) if session is None else self.session_policy(role)
        return by_id[policy.choose(request, candidates)]

    def forget(self, role: str) -> None:
        """A worker of `role` was lost: read the registry again on the next call, but keep the list
        as a fallback."""
        cached = self._workers.get(role)
        if cached is not None:
            self._workers[role] = (float("-inf"), cached[1])

    def sent(self, worker_id: str) -> None:
        self.outstanding[worker_id] = self.outstanding.get(worker_id, 0) + 1

    def ended(self, worker_id: str) -> None:
        self.outstanding[worker_id] = max(0, self.outstanding.get(worker_id, 1) - 1)

    def close(self) -> None:
        self._kv_router.close()
