"""The studio's records: workflows and their immutable versions, deployments and their
workers, runs with per-node state and their event log, uploaded/produced files, and chat
sessions.

Ownership: every row a user reaches through the API hangs off `Workflow.owner` or
`Run.owner`; querysets are filtered by `visible_to(user)` (staff see everything).
"""

from __future__ import annotations

import uuid
from typing import Any

from django.conf import settings
from django.db import models, transaction
from django.db.models import Q, QuerySet
from django.db.models.signals import post_delete
from django.dispatch import receiver

from engine.client.keys import PlaneKeys


class OwnedQuerySet(QuerySet):
    owner_field = "owner"

    def visible_to(self, user: Any) -> QuerySet:
        if not user.is_authenticated:
            return self.none()
        if user.is_staff:
            return self.all()
        return self.filter(**{self.owner_field: user})


MAX_WORKFLOW_NAME = 100
"""The longest workflow name (its column's length)."""


class Workflow(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="workflows")
    name = models.CharField(max_length=MAX_WORKFLOW_NAME)
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = OwnedQuerySet.as_manager()

    class Meta:
        ordering = ["-updated_at"]
        constraints = [models.UniqueConstraint(fields=["owner", "name"], name="workflow_unique_name_per_owner")]

    def __str__(self) -> str:
        return self.name

    def latest_version(self) -> WorkflowVersion | None:
        return self.versions.order_by("-number").first()


class ImmutableError(RuntimeError):
    """A saved workflow version was modified; save a new version instead."""


class WorkflowVersion(models.Model):
    """One saved GraphSpec. Never changes once saved: editing saves a new version."""

    workflow = models.ForeignKey(Workflow, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    spec = models.JSONField(help_text="the GraphSpec document (canonical form)")
    spec_hash = models.CharField(max_length=64, help_text="SHA-256 of the canonical GraphSpec bytes")
    layout = models.JSONField(default=dict, blank=True, help_text="editor layout: node positions, viewport")
    message = models.TextField(blank=True)
    author = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                               related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    valid = models.BooleanField(help_text="whether the spec passed validation when saved")
    issues = models.JSONField(default=list, blank=True, help_text="validation issues (empty when valid)")

    class Meta:
        ordering = ["workflow", "-number"]
        constraints = [models.UniqueConstraint(fields=["workflow", "number"], name="version_unique_number")]
        indexes = [models.Index(fields=["workflow", "spec_hash"])]

    def __str__(self) -> str:
        return f"{self.workflow} v{self.number}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding:
            raise ImmutableError(f"{self} is immutable; save a new version instead")
        super().save(*args, **kwargs)


class DeploymentStatus(models.TextChoices):
    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


ACTIVE_DEPLOYMENT_STATUSES = frozenset({DeploymentStatus.PENDING, DeploymentStatus.STARTING,
                                        DeploymentStatus.RUNNING, DeploymentStatus.STOPPING})


class CacheScope(models.TextChoices):
    """Whose runs of a deployment share its caches (KV pages, prefix trees, sessions)."""

    USER = "user", "each user's runs their own"
    SHARED = "shared", "every user's runs of this deployment (staff only: e.g. a public system prompt)"


MAX_DEPLOYMENT_NAME = 100


class Deployment(models.Model):
    """A version deployed onto role workers: `replicas` per role (defaults from the spec).

    Its workers register in the worker registry under `namespace`, so two deployments of
    the same workflow never share workers, and a worker started by hand on another machine
    joins it with `omniflow worker --namespace <namespace> --registry <REDIS_URL> ...`.
    `placement` (distributed mode) says which node runs each replica (`{"slots": [{"role",
    "replica", "node"}], "moved": [...], "unplaced": [...]}`, read by
    `studio.workflows.deployments.placing.DeploymentPlacement`): each of those nodes' Celery
    worker (queue `node.<node>`) starts its share; `node` is the first of them, blank when the
    studio process itself hosts the workers (the embedded mode). `plane_public`/`plane_secret`:
    the CURVE keypair of its worker plane (`engine.data.curve`), made when it is deployed:
    every process that reaches the database (the node agent starting the workers, the web and
    Celery processes dispatching to them) reads it here, whatever host it runs on; the node
    agent hands it to the workers as files only their user reads. Cleared when it stops.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="deployments")
    version = models.ForeignKey(WorkflowVersion, on_delete=models.PROTECT, related_name="deployments")
    name = models.CharField(max_length=MAX_DEPLOYMENT_NAME, blank=True,
                            help_text="the OpenAI model id of a chat deployment; unique among the owner's live ones")
    status = models.CharField(max_length=16, choices=DeploymentStatus.choices, default=DeploymentStatus.PENDING)
    replicas = models.JSONField(default=dict, blank=True, help_text="role name -> replica count")
    node = models.CharField(max_length=63, blank=True,
                            help_text="node whose Celery worker starts the role workers; blank: the studio process")
    placement = models.JSONField(default=dict, blank=True,
                                 help_text="distributed mode: the node of each replica, the replicas that moved")
    namespace = models.CharField(max_length=100, blank=True, help_text="worker registry namespace")
    cache_scope = models.CharField(max_length=8, choices=CacheScope.choices, default=CacheScope.USER,
                                   help_text="user: a user's runs never meet another's in a cache; shared: set by staff")
    plane_public = models.CharField(max_length=40, blank=True,
                                    help_text="the CURVE public key of the deployment's worker plane")
    plane_secret = models.CharField(max_length=40, blank=True,
                                    help_text="its secret key: only the workers and the processes dispatching to"
                                              " them hold it; cleared when the deployment ends")
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = OwnedQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            # a name is how a user's clients reach a live deployment (`model="<name>"` on /v1)
            models.UniqueConstraint(fields=["owner", "name"], name="deployment_name_unique_live",
                                    condition=models.Q(status__in=sorted(ACTIVE_DEPLOYMENT_STATUSES))),
        ]

    def __str__(self) -> str:
        return self.name or f"deployment of {self.version}"

    @property
    def active(self) -> bool:
        """Whether it has (or is about to have) workers."""
        return self.status in ACTIVE_DEPLOYMENT_STATUSES

    def plane_keys(self) -> PlaneKeys | None:
        """The worker plane's keys, with the studio's bulk mode (`OMNIFLOW_PLANE_BULK`); None
        once it ended (they are cleared then)."""
        if not self.plane_secret:
            return None
        return PlaneKeys(self.plane_public, self.plane_secret, frozenset({self.plane_public}),
                         settings.OMNIFLOW.plane_bulk)



def deployment_namespace(prefix: str, deployment_id: uuid.UUID) -> str:
    """The registry namespace of a deployment's workers (no ':' allowed there)."""
    return f"{prefix}-d{deployment_id.hex}"


class NodeHeartbeat(models.Model):
    """A machine's (a node agent's node's) heartbeat, kept where a Redis flush cannot take it: the
    latest announcement of its agent that the node directory accepted, on the database's clock,
    and the record it announced (`studio.workflows.deployments.liveness`). One row per node name."""

    name = models.CharField(max_length=255, unique=True)
    seen_at = models.DateTimeField(help_text="when the node directory last accepted its announcement")
    lapses_at = models.DateTimeField(help_text="seen_at + ttl_s: when its lease ends unless it announces again")
    ttl_s = models.FloatField(help_text="the lease its agent announces with (OMNIFLOW_NODE_TTL_S)")
    record = models.JSONField(null=True, help_text="the NodeRecord it announced (null: kept before records were),"
                                                   " what /api/nodes/ shows while Redis has forgotten the node")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class WorkerStatus(models.TextChoices):
    STARTING = "starting"
    """Its process is spawned; it has not registered yet."""
    READY = "ready"
    BUSY = "busy"
    DRAINING = "draining"
    STOPPED = "stopped"
    LOST = "lost"
    """It ended unasked after it had come up."""
    FAILED = "failed"
    """It did not come up (`Worker.error` says why)."""


class Worker(models.Model):
    """A role worker process serving one role of a deployment (mirrors its registry record)."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="workers")
    role = models.CharField(max_length=64)
    worker_id = models.CharField(max_length=128, unique=True, help_text="id in the worker registry")
    host = models.CharField(max_length=255, blank=True)
    address = models.CharField(max_length=255, blank=True)
    device = models.CharField(max_length=64, blank=True)
    gpus = models.JSONField(default=list, blank=True,
                            help_text="the host's GPU indices this process holds (nvidia-smi's numbering); empty: none")
    pid = models.PositiveIntegerField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=WorkerStatus.choices, default=WorkerStatus.STARTING)
    error = models.TextField(blank=True, help_text="why it did not come up (status failed)")
    started_at = models.DateTimeField(auto_now_add=True)
    last_seen_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["deployment", "role", "worker_id"]

    def __str__(self) -> str:
        return f"{self.role}@{self.address or self.host or self.worker_id}"


class RunStatus(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_RUN_STATUSES = frozenset({RunStatus.DONE, RunStatus.FAILED, RunStatus.CANCELLED})


class Run(models.Model):
    """One execution of a workflow version (through a deployment, when given).

    `inputs` holds the values as submitted, an uploaded file as `{"$file": "<RunFile id>"}`;
    `outputs` the outputs' JSON values, a produced file as `{"$file": ...}` likewise.
    `last_seq` is the sequence number of the last event stored (-1 before the first).

    Lease: whoever executes the run holds it (`lease_owner`) until `lease_expires_at` and
    renews it while the run executes; `attempts` counts the executions begun. An expired
    lease means the executor stopped: the run is executed again or failed
    (`studio.workflows.runs.lease`). `cancel_requested` asks the holder to cancel it.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="runs")
    workflow = models.ForeignKey(Workflow, on_delete=models.CASCADE, related_name="runs")
    version = models.ForeignKey(WorkflowVersion, on_delete=models.CASCADE, related_name="runs")
    deployment = models.ForeignKey(Deployment, null=True, blank=True, on_delete=models.SET_NULL, related_name="runs")
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.PENDING, db_index=True)
    inputs = models.JSONField(default=dict, blank=True)
    outputs = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)
    failed_node = models.CharField(max_length=64, blank=True)
    timeout_s = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)
    last_seq = models.IntegerField(default=-1)
    node_params = models.JSONField(default=dict, blank=True,
                                   help_text="node id -> params laid over the spec's for this run (chat turns)")
    lease_owner = models.CharField(max_length=200, blank=True, help_text="the executor holding the run's lease")
    lease_expires_at = models.DateTimeField(null=True, blank=True, help_text="when the lease lapses unless renewed")
    attempts = models.PositiveIntegerField(default=0, help_text="executions begun (a stopped executor's run restarts)")
    cancel_requested = models.BooleanField(default=False, help_text="the lease holder is asked to cancel the run")
    executed_on = models.JSONField(default=list, blank=True,
                                   help_text="the nodes (OMNIFLOW_NODE) of the processes that claimed it")

    objects = OwnedQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["owner", "-created_at"]), models.Index(fields=["workflow", "-created_at"]),
                   models.Index(fields=["status", "lease_expires_at"], name="run_lease_expiry")]

    def __str__(self) -> str:
        return f"run {self.id} of {self.version} ({self.status})"

    @property
    def tenant(self) -> str:
        """Whose caches the run's nodes read and fill (`engine.spec.calls.NodeCall.tenant`): its
        owner's, or its deployment's when that deployment's cache scope is shared."""
        deployment = self.deployment
        if deployment is not None and deployment.cache_scope == CacheScope.SHARED:
            return f"deployment:{deployment.pk}"
        return f"user:{self.owner_id}"

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL_RUN_STATUSES


class NodeState(models.TextChoices):
    PENDING = "pending"
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"


class NodeRun(models.Model):
    """The state of one node in one run, kept current from the run's events."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="nodes")
    node = models.CharField(max_length=64)
    kind = models.CharField(max_length=64)
    state = models.CharField(max_length=16, choices=NodeState.choices, default=NodeState.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    iterations = models.PositiveIntegerField(default=0)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)
    error = models.TextField(blank=True)
    progress = models.FloatField(null=True, blank=True)
    message = models.CharField(max_length=500, blank=True)
    outputs = models.JSONField(default=dict, blank=True, help_text="port -> preview of the latest value")
    frames = models.PositiveIntegerField(default=0, help_text="stream frames emitted")

    class Meta:
        ordering = ["run", "id"]
        constraints = [models.UniqueConstraint(fields=["run", "node"], name="noderun_unique_node")]

    def __str__(self) -> str:
        return f"{self.node} ({self.state})"


class RunEvent(models.Model):
    """A run's events exactly as the executor emitted them, in order, no gaps."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events")
    seq = models.PositiveIntegerField()
    type = models.CharField(max_length=32)
    data = models.JSONField()

    class Meta:
        ordering = ["run", "seq"]
        constraints = [models.UniqueConstraint(fields=["run", "seq"], name="runevent_unique_seq")]

    def __str__(self) -> str:
        return f"{self.run_id}#{self.seq} {self.type}"


class FileRole(models.TextChoices):
    INPUT = "input"
    OUTPUT = "output"
    NODE = "node"
    """An image or audio clip a node produced (not a run output), kept for the run view's previews."""


def _run_file_path(instance: RunFile, filename: str) -> str:
    return f"runs/{instance.owner_id}/{instance.id.hex}"


class RunFile(models.Model):
    """A file uploaded as a run input or produced as an output; served to its owner only.

    Kept in Django's default storage (`MEDIA_ROOT`, `<OMNIFLOW_DATA_DIR>/files`) by the process that
    stores the run's events: in the distributed mode the Celery run workers write what the web server
    serves, so the two share that storage (one volume, or a shared `STORAGES` backend).
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="run_files")
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="files")
    role = models.CharField(max_length=8, choices=FileRole.choices)
    name = models.CharField(max_length=64, help_text="the input or output it belongs to")
    filename = models.CharField(max_length=255)
    content_type = models.CharField(max_length=100, default="application/octet-stream")
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)
    file = models.FileField(upload_to=_run_file_path, max_length=255)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = OwnedQuerySet.as_manager()

    class Meta:
        ordering = ["created_at"]

    def __str__(self) -> str:
        return f"{self.role} {self.name}: {self.filename}"


@receiver(post_delete, sender=RunFile)
def _delete_stored_file(sender: type[RunFile], instance: RunFile, **_: Any) -> None:
    """A file record takes its bytes with it, however it was deleted (with its run, its
    workflow, its owner, in the admin), once the deletion has committed."""
    name, storage = instance.file.name, instance.file.storage
    if name:
        transaction.on_commit(lambda: storage.delete(name))


class RunFolderRemoval(models.Model):
    """The output folders of a deleted run that a node still has to remove from its data dir
    (`studio.workflows.runs.folders`): written with the deletion, removed by the node once done."""

    node = models.CharField(max_length=63)
    run_id = models.UUIDField()
    owner_id = models.BigIntegerField(help_text="the run's owner: its folder is <users root>/<owner id>/")
    folders = models.JSONField(default=list, help_text="the run's output folder names, relative to the owner's folder")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at"]
        constraints = [models.UniqueConstraint(fields=["node", "run_id"], name="runfolderremoval_unique")]

    def __str__(self) -> str:
        return f"run {self.run_id}'s folders on {self.node}"


class Session(models.Model):
    """A chat session bound to a deployment; the history is kept server-side so a client
    sends only the new turn."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="chat_sessions")
    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="sessions")
    title = models.CharField(max_length=200, blank=True)
    messages = models.JSONField(default=list, blank=True, help_text="[{role, content, ...}] in order")
    turn = models.ForeignKey("Run", null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
                             help_text="the run of the turn in flight, if any")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    closed = models.BooleanField(default=False)

    objects = OwnedQuerySet.as_manager()

    class Meta:
        ordering = ["-updated_at"]

    def __str__(self) -> str:
        return self.title or f"session {self.id}"


def visible_versions(user: Any) -> QuerySet[WorkflowVersion]:
    qs = WorkflowVersion.objects.select_related("workflow")
    if not user.is_authenticated:
        return qs.none()
    return qs if user.is_staff else qs.filter(Q(workflow__owner=user))
