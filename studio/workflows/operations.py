"""What the API and the management commands do to workflows and runs, in one place."""

from __future__ import annotations

import logging
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any

import kombu.exceptions
from asgiref.sync import async_to_sync
from django.core.files.uploadedfile import UploadedFile
from django.db import IntegrityError, transaction
from rest_framework.exceptions import NotFound

from engine.client.cluster import NodeDirectoryError
from engine.client.graphs import GraphValidationError, build_plan
from engine.client.runs import RunInputError, resolve_inputs
from engine.spec.graph import GraphSpec
from engine.spec.jsonpath import member
from studio.config import Dispatch
from studio.errors import BadRequest, Conflict, Unprocessable
from studio.jsonbody import JsonRefused, load_json
from studio.workflows import quotas
from studio.workflows.apps import engine
from studio.workflows.deployments import placing
from studio.workflows.deployments.node import node_queue
from studio.workflows.models import (
    ACTIVE_DEPLOYMENT_STATUSES,
    Deployment,
    DeploymentStatus,
    FileRole,
    NodeRun,
    Run,
    RunFile,
    RunStatus,
    Workflow,
    WorkflowVersion,
)
from studio.workflows.paths import (
    PathRefused,
    PathRoots,
    find_checkpoint,
    resolve_spec_paths,
    run_output_folders,
)
from studio.workflows.pictures import oversized
from studio.workflows.runs import folders
from studio.workflows.runs.recovery import request_cancel
from studio.workflows.runs.service import CANCEL_OUTCOMES, CancelOutcome
from studio.workflows.runs.store import file_ref, store_file, with_node_params
from studio.workflows.specs import CheckedSpec, check, kv_ref_paths, parse_document, spec_from_source

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.05
"""How often `cancel_run` reads whether a run another process was asked to cancel has ended."""

FILE_PORT_TYPES = frozenset({"image", "audio", "tensor", "any"})
"""Input port types that accept an uploaded file (its bytes become the input value)."""
MEDIA_TYPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*")
"""An uploaded file's content type: `type/subtype` in the characters RFC 6838 allows (its
parameters are cut off before it gets here)."""


def invalid_workflow(exc: GraphValidationError, status: type[BadRequest] | type[Unprocessable] = BadRequest):
    count = len(exc.issues)
    return status(f"invalid workflow: {count} problem{'s' if count != 1 else ''}", [i.to_dict() for i in exc.issues])


def parse_spec_input(*, spec: Any = None, source: str | None = None) -> GraphSpec:
    """A GraphSpec from a JSON document or DSL source; GraphValidationError lists every schema problem."""
    return spec_from_source(source, engine().ops.registry) if source is not None else parse_document(spec)


def read_spec(*, spec: Any = None, source: str | None = None) -> GraphSpec:
    """A GraphSpec from a JSON document or DSL source; BadRequest lists every schema problem."""
    try:
        return parse_spec_input(spec=spec, source=source)
    except GraphValidationError as exc:
        raise invalid_workflow(exc) from None


def check_spec_for_studio(spec: GraphSpec) -> CheckedSpec:
    """`check` with this studio's kinds, ops and model roots."""
    eng = engine()
    roots = tuple(eng.config.model_dirs)
    return check(spec, eng.kinds, eng.ops, lambda name: find_checkpoint(roots, name) is not None)


def check_paths(user: Any, document: dict[str, Any], message: str) -> None:
    """Unprocessable unless every path the spec names resolves under its root for `user` (the
    resolution itself happens again where the run or deployment starts)."""
    try:
        resolve_spec_paths(document, user.pk, PathRoots.of(engine().config), engine().ops.registry)
    except PathRefused as exc:
        raise Unprocessable(message, [i.to_dict() for i in exc.issues]) from None


@dataclass(frozen=True, slots=True)
class SavedVersion:
    version: WorkflowVersion
    created: bool
    """False when the latest version already had this spec and layout."""


def save_version(workflow: Workflow, checked: CheckedSpec, *, layout: dict[str, Any] | None = None,
                 message: str = "", author: Any = None, base: int | None = None) -> SavedVersion:
    """Save `checked` as the workflow's next version (valid or not: drafts are kept with
    their issues). `base`: the version the edit started from; Conflict if it is not the
    latest. Saving what the latest version already holds creates nothing."""
    layout = layout or {}
    with transaction.atomic():
        Workflow.objects.select_for_update().filter(pk=workflow.pk).first()
        latest = workflow.versions.order_by("-number").first()
        latest_number = latest.number if latest else 0
        if base is not None and base != latest_number:
            raise Conflict(f"version {base} is not the latest (version {latest_number} was saved since);"
                           " reload and merge", [{"latest": latest_number}])
        if latest is not None and latest.spec_hash == checked.spec_hash and latest.layout == layout:
            return SavedVersion(latest, created=False)
        quotas.version_check(workflow, workflow.versions.count(), engine().config.quotas).enforce()
        version = WorkflowVersion.objects.create(
            workflow=workflow,
            number=latest_number + 1,
            spec=checked.document,
            spec_hash=checked.spec_hash,
            layout=layout,
            message=message,
            author=author,
            valid=checked.valid,
            issues=checked.issue_dicts(),
        )
        workflow.save(update_fields=["updated_at"])
    return SavedVersion(version, created=True)


def create_workflow(owner: Any, *, name: str, description: str = "", checked: CheckedSpec | None = None,
                    layout: dict[str, Any] | None = None, message: str = "") -> Workflow:
    try:
        with transaction.atomic():
            quotas.lock_user(owner)
            quotas.workflow_check(owner, engine().config.quotas).enforce()
            workflow = Workflow.objects.create(owner=owner, name=name, description=description)
            if checked is not None:
                save_version(workflow, checked, layout=layout, message=message or "imported", author=owner)
    except IntegrityError:
        raise Conflict(f"you already have a workflow named {name!r}") from None
    return workflow


# ------------------------------------------------------------------------------- runs
def _file_inputs(spec: GraphSpec, files: dict[str, UploadedFile]) -> None:
    input_types = {n.id: n.outputs["value"].type for n in spec.nodes if n.kind == "input"}
    problems = []
    for name in files:
        if name not in input_types:
            problems.append({"field": name, "message": f"the workflow has no input {name!r}"
                             f" (inputs: {sorted(input_types) or 'none'})"})
        elif input_types[name] not in FILE_PORT_TYPES:
            problems.append({"field": name, "message": f"input {name!r} is of type {input_types[name]};"
                             f" files go to inputs of type {', '.join(sorted(FILE_PORT_TYPES))}"})
        elif problem := _content_type_problem(files[name].content_type or ""):
            problems.append({"field": name, "message": problem})
        elif input_types[name] == "image" and (too_large := _oversized_upload(files[name])):
            problems.append({"field": name, "message": too_large})
    if problems:
        raise BadRequest("invalid file upload", problems)


def _oversized_upload(upload: UploadedFile) -> str | None:
    """Why an upload to an image input is too large a picture (its header's size), or None."""
    upload.seek(0)
    head = upload.read()
    upload.seek(0)
    return oversized(head)


def _content_type_problem(content_type: str) -> str | None:
    """Why an upload's content type cannot be kept (None: it can; empty is kept as unknown)."""
    limit = RunFile._meta.get_field("content_type").max_length
    if not content_type or (len(content_type) <= limit and MEDIA_TYPE.fullmatch(content_type)):
        return None
    shown = content_type if len(content_type) <= 40 else f"{content_type[:40]}… ({len(content_type)} characters)"
    return f"the file's content type {shown!r} is not a media type (type/subtype) of at most {limit} characters"


def resolve_run_target(user: Any, *, workflow: Workflow | None, number: int | None,
                       deployment: Deployment | None) -> WorkflowVersion:
    if deployment is not None:
        if deployment.status != DeploymentStatus.RUNNING:
            raise Conflict(f"deployment {deployment.pk} is {deployment.status}, not running")
        return deployment.version
    assert workflow is not None
    versions = workflow.versions.all()
    version = versions.filter(number=number).first() if number is not None else versions.order_by("-number").first()
    if version is None:
        if number is None:
            raise Conflict(f"workflow {workflow.name!r} has no saved version to run")
        raise NotFound(f"workflow {workflow.name!r} has no version {number}")
    return version


def create_run(user: Any, version: WorkflowVersion, inputs: dict[str, Any], *,
               files: dict[str, UploadedFile] | None = None, deployment: Deployment | None = None,
               timeout_s: float | None = None, node_params: dict[str, dict[str, Any]] | None = None) -> Run:
    """Check a submission against the version's spec, store the run (pending) and hand it to
    execution once the transaction commits. Unprocessable when the version is invalid or
    the inputs do not fit its input nodes. `node_params` (node id -> params) are laid over
    the spec's for this run only (chat turns: sampling, session) and checked with it."""
    files = files or {}
    node_params = node_params or {}
    try:
        spec = read_spec(spec=with_node_params(version.spec, node_params))
        plan = build_plan(spec, engine().kinds)
    except (BadRequest, GraphValidationError) as exc:
        details = exc.details if isinstance(exc, BadRequest) else [i.to_dict() for i in exc.issues]
        raise Unprocessable(f"version {version.number} of {version.workflow.name!r} is not a valid workflow",
                            details) from None
    policy = check_spec_for_studio(spec)
    if not policy.valid:
        raise Unprocessable(f"version {version.number} of {version.workflow.name!r} cannot run here",
                            policy.issue_dicts())
    check_paths(user, policy.document, f"version {version.number} of {version.workflow.name!r} cannot run here")
    _file_inputs(spec, files)
    forged = [where for name, value in inputs.items() for where in kv_ref_paths(value, member("inputs", name))]
    if forged:
        raise Unprocessable("a run's inputs cannot carry a KV reference (it names the worker its pages are"
                            " pulled from); only an llm node of the same run makes one", forged)
    overlap = sorted(set(files) & set(inputs))
    if overlap:
        raise BadRequest("an input is given both as a value and as a file", overlap)
    try:
        resolve_inputs(plan, {**inputs, **dict.fromkeys(files)})
    except RunInputError as exc:
        raise Unprocessable("inputs do not match the workflow", [str(exc)]) from None
    config = engine().config
    upload_bytes = sum(upload.size or 0 for upload in files.values())
    quotas.run_check(user, spec, config.quotas, timeout_s=timeout_s, upload_bytes=upload_bytes,
                     model_dirs=config.model_dirs).enforce()
    with transaction.atomic():
        quotas.lock_user(user)
        quotas.admission_check(user, config.quotas).enforce()
        run = Run.objects.create(
            owner=user,
            workflow=version.workflow,
            version=version,
            deployment=deployment,
            inputs=inputs,
            timeout_s=quotas.run_timeout(user, timeout_s, config.run_timeout_s, config.quotas),
            node_params=node_params,
        )
        NodeRun.objects.bulk_create([NodeRun(run=run, node=n.id, kind=n.kind) for n in spec.nodes])
        if files:
            stored = {}
            for name, upload in files.items():
                data = upload.read()
                record = store_file(run, FileRole.INPUT, name, data, upload.name or name,
                                    upload.content_type or "application/octet-stream")
                stored[name] = file_ref(record)
            run.inputs = {**inputs, **stored}
            run.save(update_fields=["inputs"])
        transaction.on_commit(lambda: dispatch_run(str(run.pk)))
    return run


def dispatch_run(run_id: str) -> None:
    """Hand a committed pending run to whatever executes runs in this configuration."""
    eng = engine()
    if eng.config.dispatch is Dispatch.CELERY:
        from studio.workflows.tasks import execute_run

        execute_run.apply_async(args=[run_id], queue=eng.config.run_queue)
    else:
        eng.runs.submit(run_id)


def cancel_run(run_id: str, wait_s: float) -> CancelOutcome:
    """Cancel a run in any mode and state: one this process executes stops here; a pending
    one, or one whose executor is gone, ends now; one executing elsewhere is asked to stop,
    and this waits up to `wait_s` for it to end (REQUESTED if it has not by then)."""
    eng = engine()
    if eng.config.dispatch is Dispatch.LOCAL:
        outcome = eng.runs.cancel(run_id)
    else:  # nothing executes here: the Celery worker holding the lease cancels it
        result = request_cancel(run_id)
        if result.events:
            async_to_sync(eng.runs.bus.publish)(run_id, result.events)
        outcome = CANCEL_OUTCOMES[result.outcome]
    if outcome is not CancelOutcome.REQUESTED:
        return outcome
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        status = Run.objects.filter(pk=run_id).values_list("status", flat=True).first()
        if status != RunStatus.RUNNING:
            return CancelOutcome.CANCELLED if status == RunStatus.CANCELLED else CancelOutcome.FINISHED
        time.sleep(CANCEL_POLL_S)
    return CancelOutcome.REQUESTED


def parse_json_field(raw: Any, field: str) -> Any:
    """Multipart forms carry JSON values as strings."""
    if not isinstance(raw, str):
        return raw
    try:
        return load_json(raw, max_depth=engine().config.max_json_depth, what=f"field {field!r}")
    except JsonRefused as exc:
        raise BadRequest(exc.message) from None


def active_runs(workflow: Workflow) -> int:
    return workflow.runs.filter(status__in=[RunStatus.PENDING, RunStatus.RUNNING]).count()


def delete_workflow(workflow: Workflow) -> None:
    """Delete a workflow with its versions, runs (their files go with them, and what their ops wrote
    under the owner's output folders) and ended deployments; Conflict naming what still lives:
    deployments (stop them) or runs."""
    with transaction.atomic():
        Workflow.objects.select_for_update().filter(pk=workflow.pk).first()
        deployments = Deployment.objects.filter(version__workflow=workflow)
        live = list(deployments.filter(status__in=ACTIVE_DEPLOYMENT_STATUSES).order_by("created_at"))
        if live:
            raise Conflict(f"workflow {workflow.name!r} has {len(live)} live deployment{'s' if len(live) != 1 else ''};"
                           " stop them first",
                           [{"deployment": str(d.pk), "name": d.name, "status": d.status,
                             "message": f"deployment {d.name or d.pk} is {d.status}"} for d in live])
        if active_runs(workflow):
            raise Conflict(f"workflow {workflow.name!r} has runs in progress; cancel them first")
        _remove_output_folders_on_commit(list(workflow.runs.select_related("version")))
        deployments.delete()  # they protect their versions; their sessions and runs' links go with them
        workflow.delete()


def _remove_output_folders_on_commit(runs: list[Run]) -> None:
    """Once the deletion commits, remove the folders `runs`' ops wrote their files into on this host
    (`paths.run_output_folders`; their copies, the run files, go with the rows), and in the Celery
    mode have the nodes that ran them remove theirs (`runs.folders`). A folder that cannot be removed
    is logged with why, and the rest still go. Call it before the rows go."""
    _owe_node_removals(runs)
    roots, registry = PathRoots.of(engine().config), engine().ops.registry
    folders = [folder for run in runs
               for folder in run_output_folders(with_node_params(run.version.spec, run.node_params), str(run.pk),
                                                roots.users / str(run.owner_id), registry)]

    def remove() -> None:
        for folder in folders:
            try:
                shutil.rmtree(folder)
            except OSError as exc:
                log.warning("could not remove %s, the output folder of a deleted run: %s", folder, exc)

    if folders:
        transaction.on_commit(remove)


def _owe_node_removals(runs: list[Run]) -> None:
    """Record what the nodes that ran `runs` owe of their folders and, once the deletion commits,
    tell the live ones (`runs.folders`)."""
    eng = engine()
    if eng.config.dispatch is not Dispatch.CELERY or not runs:
        return
    notify = folders.owe(runs, eng.ops.registry, lambda: _node_states(eng.config))
    if notify:
        transaction.on_commit(lambda: _send_removals(notify))


def _node_states(config: Any) -> folders.NodeStates | None:
    try:
        known = placing.directory(config)
        try:
            return {state.record.name: state.live for state in known.known()}
        finally:
            known.close()
    except NodeDirectoryError as exc:
        log.warning("reading the node directory failed: %s", exc)
        return None


def _send_removals(notify: dict[str, list[str]]) -> None:
    from studio.workflows.tasks import remove_run_folders

    for node, run_ids in notify.items():
        try:
            remove_run_folders.apply_async(args=[node, run_ids], queue=node_queue(node))
        except (kombu.exceptions.OperationalError, OSError) as exc:  # the broker away: its next tick does it
            log.warning("telling node %s to remove the folders of deleted runs %s failed: %s", node, run_ids, exc)


def delete_run(run: Run) -> None:
    """Delete a finished run with its events, files and what its ops wrote under the owner's output
    folders; Conflict while it is in progress."""
    with transaction.atomic():
        locked = Run.objects.select_for_update().select_related("version").get(pk=run.pk)
        if not locked.finished:
            raise Conflict(f"run {run.pk} is {locked.status}; cancel it first")
        _remove_output_folders_on_commit([locked])
        locked.delete()

