"""Per-user quotas (`studio.config.Quotas`), checked where they bite: deploying and scaling
(`studio.workflows.deployments.service`), submitting a run (`studio.workflows.operations.create_run`,
which REST runs, `/v1/chat/completions` and session turns all go through) and uploading its files,
and keeping workflows and versions (`operations.create_workflow`, `operations.save_version`).

Every check returns a `QuotaCheck` (the breaches found, each naming the limit, its value, what
was asked and where: role or node); `QuotaCheck.enforce()` raises the API error. Two kinds of
refusal, always the same status for the same kind:

* **busy** (429 `QuotaBusy`): a count of things a user has live at once (concurrent and queued
  runs, live deployments, worker processes, workflows). It frees up when they end (or are
  deleted); retrying later may work;
* **too large** (403 `QuotaTooLarge`): one request asks for more than a user may ever have (KV
  pages, `max_iterations`, `max_new_tokens`, upload bytes, run timeout, a workflow's versions,
  which are never deleted one by one). Retrying will not help.

HiCache bytes (`hicache_host_bytes`, `hicache_disk_bytes`: the host memory and disk of the
hierarchical caches of `sglang_llm` roles, `engine.compute.sglang.sizes`) are counted as worker
processes are: per process, times `replicas x tp_size`, over the user's live deployments (busy
when only the others make it too much, too large when one deployment alone is). A role whose
SGLang host pool has no size known here (no `sglang.max_total_tokens`, which validation asks for
too, or a checkpoint whose config does not give its KV shape) is refused, too large, rather than
counted by its tier alone (its breach's `asked` is None). A live deployment stored before that
rule counts its tier only.

When both kinds are breached the answer is 403. Staff users are exempt from every quota (the
engine's hard ceilings in the kind catalogue still bind them). Sizes are read from the stored
spec, never from what the request body says about it: a deployment counts, per role, the larger
of the spec's `replicas` and the count asked for, times `tp_size`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from django.contrib.auth import get_user_model
from rest_framework import status

from engine.spec.graph import GraphSpec
from studio.config import Quotas
from studio.errors import ApiError, Forbidden
from studio.workflows.models import ACTIVE_DEPLOYMENT_STATUSES, Deployment, Run, RunStatus, Workflow
from studio.workflows.paths import find_checkpoint
from studio.workflows.specs import SGLANG_ROLE_KIND

if TYPE_CHECKING:
    from engine.client.models import HiCacheBytes

ROLE_PAGE_PARAMS = ("device_pages", "host_pages", "disk_pages")
"""Role params that size a KV tier (pages per replica), each with the quota of the same name."""


class BreachKind(enum.StrEnum):
    BUSY = "busy"
    """Too many things live at once: 429."""
    TOO_LARGE = "too_large"
    """One request asks for more than the user may have: 403."""


@dataclass(frozen=True, slots=True)
class QuotaBreach:
    """One limit a request passes."""

    limit: str
    """The quota's name (a field of `studio.config.Quotas`)."""
    value: int | float
    """The limit."""
    asked: int | float | None
    """What the request (with what the user already has) comes to; None where it cannot be counted."""
    kind: BreachKind
    message: str
    role: str | None = None
    node: str | None = None

    @property
    def setting(self) -> str:
        return f"OMNIFLOW_QUOTA_{self.limit.upper()}"

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": "quota", "limit": self.limit, "value": self.value, "asked": self.asked,
                                "setting": self.setting, "message": self.message}
        if self.role is not None:
            body["role"] = self.role
        if self.node is not None:
            body["node"] = self.node
        return body


class QuotaBusy(ApiError):
    status_code = status.HTTP_429_TOO_MANY_REQUESTS
    default_detail = "quota reached"


class QuotaTooLarge(Forbidden):
    """One request asks for more than its user may ever have."""

    default_detail = "over quota"


@dataclass(frozen=True, slots=True)
class QuotaCheck:
    breaches: tuple[QuotaBreach, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.breaches

    def __add__(self, other: QuotaCheck) -> QuotaCheck:
        return QuotaCheck((*self.breaches, *other.breaches))

    def enforce(self) -> None:
        """Raise QuotaTooLarge (403) or QuotaBusy (429) listing every breach; nothing when ok."""
        if self.ok:
            return
        too_large = any(b.kind is BreachKind.TOO_LARGE for b in self.breaches)
        names = ", ".join(dict.fromkeys(f"{b.limit} ({b.value})" for b in self.breaches))
        error = QuotaTooLarge if too_large else QuotaBusy
        raise error(f"over your quota: {names}", [b.to_dict() for b in self.breaches])


EXEMPT = QuotaCheck()


def exempt(user: Any) -> bool:
    """Staff users are exempt from quotas."""
    return bool(getattr(user, "is_staff", False))


# ------------------------------------------------------------------------------ sizes
def spec_check(spec: GraphSpec, quotas: Quotas) -> QuotaCheck:
    """What one spec asks for: KV pages per role, `max_iterations` and `max_new_tokens` per node."""
    breaches: list[QuotaBreach] = []
    for role in spec.roles:
        for name in ROLE_PAGE_PARAMS:
            asked = role.params.get(name)
            limit = getattr(quotas, name)
            if _number(asked) and asked > limit:
                breaches.append(QuotaBreach(name, limit, asked, BreachKind.TOO_LARGE,
                                            f"role {role.name!r}: {name} {asked} is over your quota of {limit}",
                                            role=role.name))
    for node in spec.nodes:
        if node.max_iterations is not None and node.max_iterations > quotas.max_iterations:
            breaches.append(QuotaBreach("max_iterations", quotas.max_iterations, node.max_iterations,
                                        BreachKind.TOO_LARGE, f"node {node.id!r}: max_iterations"
                                        f" {node.max_iterations} is over your quota of {quotas.max_iterations}",
                                        node=node.id))
        asked = node.params.get("max_new_tokens")
        if _number(asked) and asked > quotas.max_new_tokens:
            breaches.append(QuotaBreach("max_new_tokens", quotas.max_new_tokens, asked, BreachKind.TOO_LARGE,
                                        f"node {node.id!r}: max_new_tokens {asked} is over your quota of"
                                        f" {quotas.max_new_tokens}", node=node.id))
    return QuotaCheck(tuple(breaches))


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def run_timeout(user: Any, asked: float | None, default: float | None, quotas: Quotas) -> float | None:
    """The timeout a run gets: what it asks for, else the server's default; for a user who is
    not exempt, the quota's when neither is set or the default is longer (a longer one asked
    for is refused by `run_check`)."""
    timeout = asked if asked is not None else default
    if exempt(user) or asked is not None:
        return timeout
    return quotas.run_timeout_s if timeout is None else min(timeout, quotas.run_timeout_s)


def run_check(user: Any, spec: GraphSpec, quotas: Quotas, *, timeout_s: float | None,
              upload_bytes: int, model_dirs: tuple[Path, ...]) -> QuotaCheck:
    """The sizes of one run submission (`spec` with the run's node params laid over it; its
    checkpoints under `model_dirs`)."""
    if exempt(user):
        return EXEMPT
    check = spec_check(spec, quotas) + QuotaCheck(tuple(hicache_breaches(
        spec, role_processes(spec, {}), quotas, model_dirs, others=HiCacheTotals(), context="the workflow's")))
    extra: list[QuotaBreach] = []
    if timeout_s is not None and timeout_s > quotas.run_timeout_s:
        extra.append(QuotaBreach("run_timeout_s", quotas.run_timeout_s, timeout_s, BreachKind.TOO_LARGE,
                                 f"timeout_s {timeout_s} is over your quota of {quotas.run_timeout_s} s"))
    if upload_bytes > quotas.upload_bytes:
        extra.append(QuotaBreach("upload_bytes", quotas.upload_bytes, upload_bytes, BreachKind.TOO_LARGE,
                                 f"the run's files are {upload_bytes} bytes, over your quota of"
                                 f" {quotas.upload_bytes}"))
    return check + QuotaCheck(tuple(extra))


# ------------------------------------------------------------------------- what is live
def lock_user(user: Any) -> None:
    """Serialise one user's admissions (call inside the transaction that creates the run or
    deployment), so two requests at once cannot both pass the last free slot."""
    get_user_model().objects.select_for_update().filter(pk=user.pk).first()


def admission_check(user: Any, quotas: Quotas) -> QuotaCheck:
    """Whether one more run of `user` may be queued: its runs executing and waiting now. Call it
    inside the transaction that creates the run, after `lock_user`."""
    if exempt(user):
        return EXEMPT
    counts = {s: 0 for s in (RunStatus.PENDING, RunStatus.RUNNING)}
    for value in Run.objects.filter(owner=user, status__in=list(counts)).values_list("status", flat=True):
        counts[value] += 1
    breaches = []
    if counts[RunStatus.RUNNING] >= quotas.concurrent_runs:
        breaches.append(QuotaBreach("concurrent_runs", quotas.concurrent_runs, counts[RunStatus.RUNNING] + 1,
                                    BreachKind.BUSY, f"you have {counts[RunStatus.RUNNING]} runs executing; your"
                                    f" quota is {quotas.concurrent_runs} (wait for one to end)"))
    if counts[RunStatus.PENDING] >= quotas.queued_runs:
        breaches.append(QuotaBreach("queued_runs", quotas.queued_runs, counts[RunStatus.PENDING] + 1,
                                    BreachKind.BUSY, f"you have {counts[RunStatus.PENDING]} runs waiting; your"
                                    f" quota is {quotas.queued_runs}"))
    return QuotaCheck(tuple(breaches))


def workflow_check(user: Any, quotas: Quotas) -> QuotaCheck:
    """Whether `user` may keep one more workflow. Call it inside the transaction that creates it,
    after `lock_user`."""
    if exempt(user):
        return EXEMPT
    have = Workflow.objects.filter(owner=user).count()
    if have < quotas.workflows:
        return EXEMPT
    return QuotaCheck((QuotaBreach("workflows", quotas.workflows, have + 1, BreachKind.BUSY,
                                   f"you have {have} workflows; your quota is {quotas.workflows}"
                                   " (delete one you no longer need)"),))


def version_check(workflow: Workflow, have: int, quotas: Quotas) -> QuotaCheck:
    """Whether `workflow` (of `have` versions) may keep one more, by its owner's quota."""
    if exempt(workflow.owner) or have < quotas.versions:
        return EXEMPT
    return QuotaCheck((QuotaBreach("versions", quotas.versions, have + 1, BreachKind.TOO_LARGE,
                                   f"workflow {workflow.name!r} has {have} versions; the quota is {quotas.versions}"
                                   " a workflow (export it and import it as a new workflow)"),))


def role_processes(spec: GraphSpec, counts: dict[str, Any]) -> dict[str, int]:
    """Worker processes per role of a deployment of `spec` with replica `counts`: the larger
    of the spec's and the asked-for replicas, times `tp_size`."""
    out = {}
    for role in spec.roles:
        asked = counts.get(role.name, role.replicas)
        replicas = max(role.replicas, asked if isinstance(asked, int) and not isinstance(asked, bool) else 0)
        out[role.name] = replicas * role.tp_size
    return out


def _live_roles(user: Any, exclude: Any) -> Iterator[tuple[dict[str, Any], int]]:
    """Every role of the user's live deployments but `exclude` (their stored specs) and its
    worker processes: the larger of the spec's and the deployment's replicas, times `tp_size`."""
    live = (Deployment.objects.filter(owner=user, status__in=list(ACTIVE_DEPLOYMENT_STATUSES))
            .exclude(pk=exclude).select_related("version"))
    for deployment in live:
        for role in deployment.version.spec.get("roles", []):
            spec_replicas = int(role.get("replicas", 1))
            replicas = max(spec_replicas, int(deployment.replicas.get(role["name"], spec_replicas)))
            yield role, replicas * int(role.get("tp_size", 1))


def _live_processes(user: Any, exclude: Any) -> int:
    return sum(processes for _, processes in _live_roles(user, exclude))


# ------------------------------------------------------------------------ HiCache bytes
@dataclass(frozen=True, slots=True)
class HiCacheTotals:
    """Bytes of HiCache host memory and disk (of every process counted)."""

    host: int = 0
    disk: int = 0


HICACHE_LIMITS = (("hicache_host_bytes", "host", "host memory"), ("hicache_disk_bytes", "disk", "disk"))
"""Each HiCache quota: its `Quotas` field, the `HiCacheBytes` amount it counts, and its name for people."""


def role_hicache(kind: Any, model: Any, params: Any, model_dirs: tuple[Path, ...]) -> HiCacheBytes | None:
    """One process's HiCache bytes of a role (None: the kind has no HiCache); its SGLang host pool
    is known where the role caps its device pool and its checkpoint (under `model_dirs`) says
    its KV shape (else `why_unbounded` says why not)."""
    if kind != SGLANG_ROLE_KIND:
        return None
    from engine.client.models import checkpoint_config, hicache_bytes  # loads torch: only for these roles

    folder = find_checkpoint(model_dirs, model) if isinstance(model, str) else None
    return hicache_bytes(params if isinstance(params, dict) else {}, checkpoint_config(folder))


def _live_hicache(user: Any, exclude: Any, model_dirs: tuple[Path, ...]) -> HiCacheTotals:
    host = disk = 0
    for role, processes in _live_roles(user, exclude):
        per = role_hicache(role.get("kind"), role.get("model"), role.get("params"), model_dirs)
        if per is not None:
            host, disk = host + per.host * processes, disk + per.disk * processes
    return HiCacheTotals(host, disk)


def hicache_breaches(spec: GraphSpec, processes: dict[str, int], quotas: Quotas, model_dirs: tuple[Path, ...], *,
                     others: HiCacheTotals, context: str) -> list[QuotaBreach]:
    """The HiCache quotas `spec` breaches with `processes` per role on top of `others` (the user's
    other live deployments'), one breach per role that adds to a quota passed. `context` names
    whose other roles are counted with a role's ("the deployment's")."""
    sized = [(role, per) for role in spec.roles
             if (per := role_hicache(role.kind, role.model, role.params, model_dirs)) is not None]
    breaches = [QuotaBreach("hicache_host_bytes", quotas.hicache_host_bytes, None, BreachKind.TOO_LARGE,
                            f"role {role.name!r}: the host memory of SGLang's host pool cannot be counted against"
                            f" your quota of {quotas.hicache_host_bytes} bytes of HiCache host memory:"
                            f" {per.why_unbounded}", role=role.name)
                for role, per in sized if per.pool is None]
    for limit_name, amount, what in HICACHE_LIMITS:
        limit = getattr(quotas, limit_name)
        asked = {role.name: getattr(per, amount) * processes[role.name] for role, per in sized}
        mine = sum(asked.values())
        total = getattr(others, amount) + mine
        if not mine or total <= limit:
            continue
        kind = BreachKind.TOO_LARGE if mine > limit else BreachKind.BUSY
        elsewhere = f" and your other live deployments ({getattr(others, amount)})" if getattr(others, amount) else ""
        for role, per in sized:
            if not asked[role.name]:
                continue
            made_of = f" ({per.describe_host()})" if amount == "host" else ""
            breaches.append(QuotaBreach(
                limit_name, limit, total, kind,
                f"role {role.name!r}: {processes[role.name] // role.tp_size} replicas x tp_size {role.tp_size} x"
                f" {getattr(per, amount)} bytes of HiCache {what}{made_of} = {asked[role.name]}; with {context}"
                f" other roles{elsewhere} that is {total}, over your quota of {limit}", role=role.name))
    return breaches


def deployment_check(user: Any, spec: GraphSpec, counts: dict[str, Any], quotas: Quotas, *,
                     model_dirs: tuple[Path, ...], deployment: Any = None) -> QuotaCheck:
    """Deploying `spec` with replica `counts` (or, with `deployment`, scaling that live one to
    them): its sizes, the user's live deployments, and their worker processes and HiCache bytes
    with these (checkpoints under `model_dirs`). Call it inside the transaction that writes the
    deployment, after `lock_user`."""
    if exempt(user):
        return EXEMPT
    breaches = list(spec_check(spec, quotas).breaches)
    live = Deployment.objects.filter(owner=user, status__in=list(ACTIVE_DEPLOYMENT_STATUSES))
    if deployment is None:
        count = live.count()
        if count >= quotas.deployments:
            breaches.append(QuotaBreach("deployments", quotas.deployments, count + 1, BreachKind.BUSY,
                                        f"you have {count} live deployments; your quota is {quotas.deployments}"
                                        " (stop one first)"))
    processes = role_processes(spec, counts)
    others = _live_processes(user, None if deployment is None else deployment.pk)
    total = others + sum(processes.values())
    if total > quotas.worker_processes:
        kind = BreachKind.TOO_LARGE if sum(processes.values()) > quotas.worker_processes else BreachKind.BUSY
        for role in spec.roles:
            breaches.append(QuotaBreach(
                "worker_processes", quotas.worker_processes, total, kind,
                f"role {role.name!r}: {processes[role.name] // role.tp_size} replicas x tp_size {role.tp_size} ="
                f" {processes[role.name]} processes; with the deployment's other roles and your other live"
                f" deployments ({others}) that is {total}, over your quota of {quotas.worker_processes}",
                role=role.name))
    exclude = None if deployment is None else deployment.pk
    breaches += hicache_breaches(spec, processes, quotas, model_dirs,
                                 others=_live_hicache(user, exclude, model_dirs), context="the deployment's")
    return QuotaCheck(tuple(breaches))
