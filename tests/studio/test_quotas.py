"""Per-user quotas, attacked where they bite: deploy and scale (worker processes from the stored
spec, whatever the body says; live deployments; KV pages; the HiCache bytes of sglang roles,
SGLang's host pool included, and a role whose host pool has no size refused), run submission over REST, `/v1` and
session turns (max_iterations, max_new_tokens, timeout, uploads, concurrent and queued runs),
and the staff exemption.

Most tests are not transactional: a deployment or run that passes is stored, and nothing starts
(the hand-off waits for a commit that never comes), so no worker is spawned."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from studio.workflows.models import (
    Deployment,
    DeploymentStatus,
    Run,
    RunStatus,
    WorkflowVersion,
    deployment_namespace,
)
from studio.workflows.quotas import (
    BreachKind,
    QuotaBusy,
    QuotaTooLarge,
    deployment_check,
    role_processes,
    run_check,
)
from studio.workflows.specs import parse_document
from tests.studio.conftest import client_for
from tests.studio.factories import create_workflow, example_spec
from tests.studio.limits import configured, llm_spec, python_spec, quota_details

pytestmark = pytest.mark.django_db


def deploy(api, spec: dict, name: str | None = None, **body):
    wf = create_workflow(api, spec, name=name)
    return api.post("/api/deployments/", {"workflow": wf["id"], **body}, format="json")


def submit(api, spec: dict, inputs: dict, name: str | None = None, **body):
    wf = create_workflow(api, spec, name=name)
    return api.post("/api/runs/", {"workflow": wf["id"], "inputs": inputs, **body}, format="json")


# --------------------------------------------------------------------------- deploy
def test_spec_replicas_over_the_cap_are_refused_even_when_the_body_asks_for_one(api) -> None:
    response = deploy(api, python_spec(replicas=20), replicas={"py": 1})
    assert response.status_code == 400, response.content
    [problem] = [d for d in response.json()["details"] if d.get("role") == "py"]
    assert "20 replicas" in problem["message"] and "OMNIFLOW_MAX_REPLICAS" in problem["message"]
    assert not Deployment.objects.exists()


def test_worker_processes_count_the_spec_replicas_times_tp_size(api) -> None:
    with configured(quotas={"worker_processes": 4}):
        spec_says_five = deploy(api, python_spec(replicas=5), replicas={"py": 1})
        assert spec_says_five.status_code == 403, spec_says_five.content
        [breach] = quota_details(spec_says_five)
        assert (breach["limit"], breach["value"], breach["asked"], breach["role"]) == ("worker_processes", 4, 5, "py")
        assert breach["setting"] == "OMNIFLOW_QUOTA_WORKER_PROCESSES"

        sharded = deploy(api, llm_spec(role={"replicas": 3, "tp_size": 2}), name="sharded", replicas={"lm": 1})
        assert sharded.status_code == 403, sharded.content
        [breach] = quota_details(sharded)
        assert (breach["limit"], breach["asked"], breach["role"]) == ("worker_processes", 6, "lm")
        assert "3 replicas x tp_size 2" in breach["message"]

        fits = deploy(api, llm_spec(name="fits", role={"replicas": 2, "tp_size": 2}), name="fits")
        assert fits.status_code == 201, fits.content
        one_more = deploy(api, python_spec(name="more"), name="more")
        assert one_more.status_code == 429, one_more.content  # busy: it fits once the first stops
        assert quota_details(one_more)[0]["asked"] == 5
    assert Deployment.objects.count() == 1


def test_live_deployments_quota(api) -> None:
    with configured(quotas={"deployments": 1}):
        assert deploy(api, python_spec()).status_code == 201
        second = deploy(api, python_spec(name="second"), name="second")
        assert second.status_code == 429
        [breach] = quota_details(second)
        assert (breach["limit"], breach["value"]) == ("deployments", 1)
        Deployment.objects.update(status=DeploymentStatus.STOPPED)  # a stopped one no longer counts
        assert api.post("/api/deployments/", {"workflow": Deployment.objects.get().version.workflow_id},
                        format="json").status_code == 201


@pytest.mark.parametrize("param", ["device_pages", "host_pages", "disk_pages"])
def test_kv_pages_over_quota_are_refused_on_the_role(api, param: str) -> None:
    params = {param: 1000, **({"disk_path": "kv"} if param == "disk_pages" else {})}
    with configured(quotas={param: 999}):
        response = deploy(api, llm_spec(role={"params": params}))
        assert response.status_code == 403, response.content
        [breach] = quota_details(response)
        assert (breach["limit"], breach["value"], breach["asked"], breach["role"]) == (param, 999, 1000, "lm")
        at_limit = deploy(api, llm_spec(name="ok", role={"params": {**params, param: 999}}), name="ok")
        assert at_limit.status_code == 201, at_limit.content


def test_scaling_past_the_quota_is_refused(api) -> None:
    with configured(quotas={"worker_processes": 2}):
        created = deploy(api, python_spec())
        assert created.status_code == 201
        Deployment.objects.update(status=DeploymentStatus.RUNNING)
        url = f"/api/deployments/{created.json()['id']}/scale/"
        assert api.post(url, {"role": "py", "replicas": 2}, format="json").status_code == 200
        over = api.post(url, {"role": "py", "replicas": 3}, format="json")
        assert over.status_code == 403 and quota_details(over)[0]["limit"] == "worker_processes"
    assert Deployment.objects.get().replicas == {"py": 2}


def test_role_processes_take_the_larger_count_times_tp_size() -> None:
    spec = parse_document(llm_spec(role={"replicas": 3, "tp_size": 2}))
    assert role_processes(spec, {}) == {"lm": 6}
    assert role_processes(spec, {"lm": 1}) == {"lm": 6}
    assert role_processes(spec, {"lm": 5}) == {"lm": 10}


def test_staff_are_exempt(staff) -> None:
    api = client_for(staff)
    with configured(quotas={"worker_processes": 1, "max_iterations": 2, "deployments": 0}):
        assert deploy(api, python_spec(replicas=3)).status_code == 201
        spec = parse_document(python_spec(replicas=3))
        assert deployment_check(staff, spec, {}, api_quotas(), model_dirs=()).ok
        assert submit(api, python_spec(name="loop", max_iterations=5), {"text": "x"}, name="loop").status_code == 201


def api_quotas():
    from studio.workflows.apps import engine

    return engine().config.quotas


# ------------------------------------------------------------------------------ runs
def test_run_sizes_over_quota(api) -> None:
    with configured(quotas={"max_iterations": 10, "run_timeout_s": 60.0, "max_new_tokens": 8}):
        loop = submit(api, python_spec(max_iterations=11), {"text": "x"})
        assert loop.status_code == 403, loop.content
        [breach] = quota_details(loop)
        assert (breach["limit"], breach["value"], breach["asked"], breach["node"]) == ("max_iterations", 10, 11, "step")

        slow = submit(api, python_spec(name="slow"), {"text": "x"}, name="slow", timeout_s=61)
        assert slow.status_code == 403 and quota_details(slow)[0]["limit"] == "run_timeout_s"

        default = submit(api, python_spec(name="plain"), {"text": "x"}, name="plain")
        assert default.status_code == 201 and Run.objects.get(pk=default.json()["id"]).timeout_s == 60.0

        tokens = submit(api, llm_spec(node_params={"max_new_tokens": 9}), {"prompt": "hi"})
        assert tokens.status_code == 403
        assert quota_details(tokens)[0]["limit"] == "max_new_tokens" and quota_details(tokens)[0]["node"] == "gen"
    assert Run.objects.count() == 1


def test_upload_bytes_over_quota(api) -> None:
    spec = python_spec()
    spec["nodes"][0]["outputs"]["value"]["type"] = "image"
    spec["nodes"][1]["op"] = "tests.studio.fns:digest"
    spec["nodes"][1]["inputs"] = {"image": {"type": "image"}}
    spec["edges"][0]["target_port"] = "image"
    wf = create_workflow(api, spec)
    with configured(quotas={"upload_bytes": 100}):
        big = api.post("/api/runs/", {"workflow": wf["id"], "inputs": "{}",
                                      "text": SimpleUploadedFile("a.png", b"\x89PNG" + b"x" * 100, "image/png")},
                       format="multipart")
        assert big.status_code == 403, big.content
        [breach] = quota_details(big)
        assert (breach["limit"], breach["value"], breach["asked"]) == ("upload_bytes", 100, 104)
        small = api.post("/api/runs/", {"workflow": wf["id"], "inputs": "{}",
                                        "text": SimpleUploadedFile("a.png", b"\x89PNG", "image/png")},
                         format="multipart")
        assert small.status_code == 201


def test_concurrent_and_queued_runs(api, user) -> None:
    wf = create_workflow(api, python_spec())
    version = WorkflowVersion.objects.get(workflow_id=wf["id"])
    with configured(quotas={"concurrent_runs": 2, "queued_runs": 1}):
        Run.objects.bulk_create([Run(owner=user, workflow=version.workflow, version=version, status=RunStatus.RUNNING)
                                 for _ in range(2)])
        busy = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "x"}}, format="json")
        assert busy.status_code == 429
        assert [b["limit"] for b in quota_details(busy)] == ["concurrent_runs"]
        Run.objects.filter(status=RunStatus.RUNNING).update(status=RunStatus.DONE)
        assert api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "x"}}, format="json").status_code == 201
        queued = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "x"}}, format="json")
        assert queued.status_code == 429 and quota_details(queued)[0]["limit"] == "queued_runs"


# ---------------------------------------------------------------------- chat surfaces
@pytest.mark.django_db(transaction=True)
def test_max_new_tokens_over_quota_on_v1_and_session_turns(api, user) -> None:
    wf = create_workflow(api, example_spec("chat", tiny=True))
    version = WorkflowVersion.objects.get(workflow_id=wf["id"])
    deployment = Deployment.objects.create(owner=user, version=version, name="chatty", status=DeploymentStatus.RUNNING,
                                           replicas={"llm": 1})
    with configured(quotas={"max_new_tokens": 8}):
        body = {"model": "chatty", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}
        response = api.post("/v1/chat/completions", json.dumps(body), content_type="application/json")
        assert response.status_code == 403, response.content
        assert "max_new_tokens (8)" in response.json()["error"]["message"]

        session = api.post("/api/sessions/", {"deployment": str(deployment.pk)}, format="json")
        assert session.status_code == 201, session.content
        turn = api.post(f"/api/sessions/{session.json()['id']}/turns/", json.dumps({"content": "hi", "max_tokens": 9}),
                        content_type="application/json")
        assert turn.status_code == 403, turn.content
        assert quota_details(turn)[0]["limit"] == "max_new_tokens"
    assert not Run.objects.exists()


# --------------------------------------------------------------------------- HiCache bytes
GIB = 1 << 30
CKPT_SHAPE = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256,
              "torch_dtype": "bfloat16"}
"""A checkpoint's KV shape: K and V of 2 heads of 256 / 8 = 32 dims, 4 layers, 2 bytes each."""
CKPT_KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 32 * 2
TOKENS = 1024
"""The device pool's cap of `sglang_spec` roles (`sglang.max_total_tokens`) unless they say otherwise."""
POOL = (2 * TOKENS + 16) * CKPT_KV_BYTES_PER_TOKEN
"""SGLang's host pool of such a role: twice its device pool (the default `hicache_ratio`) and a page."""


@pytest.fixture
def model_root(tmp_path: Path) -> Path:
    """A model root holding the checkpoint `org/ckpt` (its config only: nothing loads it here)."""
    (tmp_path / "models" / "org" / "ckpt").mkdir(parents=True)
    (tmp_path / "models" / "org" / "ckpt" / "config.json").write_text(json.dumps(CKPT_SHAPE))
    return tmp_path / "models"


def sglang_spec(replicas: int = 1, name: str = "lm", **params: Any) -> dict[str, Any]:
    params.setdefault("sglang", {"max_total_tokens": TOKENS})
    return llm_spec(name=name, role={"kind": "sglang_llm", "model": "org/ckpt", "replicas": replicas,
                                     "params": params})


def live_sglang(api, user, name: str, replicas: int = 1, **params: Any) -> Deployment:
    """A running deployment of an `sglang_llm` role, stored as such. The studio deploys no new
    one today (its runner serves no tenant: `tenant_unsupported`), so the deploy path is checked
    through `deployment_check` and the API through scaling a deployment that exists."""
    wf = create_workflow(api, sglang_spec(name=name, **params), name=name)
    version = WorkflowVersion.objects.get(workflow_id=wf["id"])
    deployment = Deployment.objects.create(owner=user, version=version, name=name, status=DeploymentStatus.RUNNING,
                                           replicas={"lm": replicas})
    deployment.namespace = deployment_namespace(redis_prefix(), deployment.pk)
    deployment.save(update_fields=["namespace"])
    return deployment


def redis_prefix() -> str:
    from studio.workflows.apps import engine

    return engine().config.redis_prefix


def test_scaling_an_sglang_role_past_the_hicache_host_quota_is_refused(api, user, model_root: Path) -> None:
    with configured(quotas={"hicache_host_bytes": 10 * GIB}, model_dirs=(model_root,)):
        deployment = live_sglang(api, user, "cached", hicache={"host_capacity_bytes": 4 * GIB})
        url = f"/api/deployments/{deployment.pk}/scale/"
        assert api.post(url, {"role": "lm", "replicas": 2}, format="json").status_code == 200  # 8 GiB + 2 pools
        over = api.post(url, {"role": "lm", "replicas": 3}, format="json")
        assert over.status_code == 403, over.content
        [breach] = quota_details(over)
        assert (breach["limit"], breach["value"], breach["asked"], breach["role"]) == (
            "hicache_host_bytes", 10 * GIB, 3 * (4 * GIB + POOL), "lm")
        assert breach["setting"] == "OMNIFLOW_QUOTA_HICACHE_HOST_BYTES"
        assert (f"3 replicas x tp_size 1 x {4 * GIB + POOL} bytes of HiCache host memory"
                f" (host tier {4 * GIB} + SGLang host pool {POOL})") in breach["message"]
        assert "hicache_host_bytes" in over.json()["error"]
    assert Deployment.objects.get().replicas == {"lm": 2}


def test_hicache_bytes_count_the_users_other_live_deployments(api, user, model_root: Path) -> None:
    with configured(quotas={"hicache_host_bytes": 12 * GIB}) as studio:
        quotas = studio.config.quotas
        live_sglang(api, user, "first", hicache={"host_capacity_bytes": 8 * GIB})
        spec = parse_document(sglang_spec(name="second", hicache={"host_capacity_bytes": 6 * GIB}))
        busy = deployment_check(user, spec, {}, quotas, model_dirs=(model_root,))
        [breach] = busy.breaches
        assert (breach.limit, breach.asked, breach.kind) == ("hicache_host_bytes", 14 * GIB + 2 * POOL,
                                                             BreachKind.BUSY)
        assert f"your other live deployments ({8 * GIB + POOL})" in breach.message
        with pytest.raises(QuotaBusy) as refused:
            busy.enforce()
        assert refused.value.status_code == 429 and refused.value.details == [breach.to_dict()]
        # One deployment alone over the quota can never fit: too large, whatever else runs.
        two = parse_document(sglang_spec(replicas=2, name="third", hicache={"host_capacity_bytes": 7 * GIB}))
        [breach] = deployment_check(user, two, {}, quotas, model_dirs=(model_root,)).breaches
        assert (breach.asked, breach.kind) == (22 * GIB + 3 * POOL, BreachKind.TOO_LARGE)
        Deployment.objects.update(status=DeploymentStatus.STOPPED)  # stopped: it no longer counts
        assert deployment_check(user, spec, {}, quotas, model_dirs=(model_root,)).ok


def test_the_sglang_host_pool_implied_by_hicache_ratio_counts(user, model_root: Path) -> None:
    quota = 4 * GIB
    with configured(quotas={"hicache_host_bytes": quota}) as studio:
        quotas = studio.config.quotas

        def check(ratio: float, **sglang: Any):
            spec = parse_document(sglang_spec(hicache_ratio=ratio, page_size=16, sglang=sglang))
            return deployment_check(user, spec, {}, quotas, model_dirs=(model_root,))

        # A device pool of at most 1M tokens: SGLang's host pool is 4M tokens (and a page), beside the 1 GiB tier.
        [breach] = check(4.0, max_total_tokens=1_000_000).breaches
        pool = (4_000_000 + 16) * CKPT_KV_BYTES_PER_TOKEN
        assert (breach.limit, breach.asked) == ("hicache_host_bytes", GIB + pool)
        assert f"host tier {GIB} + SGLang host pool {pool}" in breach.message
        assert check(2.0, max_total_tokens=1_000_000).ok  # 1 GiB + 2M tokens fit in 4 GiB
        # fp8 KV halves the pool: 4M tokens then fit too.
        assert check(4.0, max_total_tokens=1_000_000, kv_cache_dtype="fp8_e4m3").ok



def test_a_host_pool_without_a_size_is_refused_not_counted_by_its_tier(api, user, staff, model_root: Path) -> None:
    """Without `sglang.max_total_tokens` SGLang sizes its device pool, and so its host pool, from the
    GPU it gets; a checkpoint whose config does not say its KV shape gives no bytes per token. Either
    way the pool has no size here: the role is refused (too large, `asked` None, why in the message),
    however small its tier and however large the quota, over the API too (a deployment stored
    before validation asked for the cap, scaled); staff are exempt."""
    with configured(quotas={"hicache_host_bytes": 1 << 40}, model_dirs=(model_root,)) as studio:
        quotas = studio.config.quotas
        uncapped = parse_document(sglang_spec(hicache={"host_capacity_bytes": 1}, sglang={}))
        [breach] = deployment_check(user, uncapped, {}, quotas, model_dirs=(model_root,)).breaches
        assert (breach.limit, breach.value, breach.asked, breach.kind, breach.role) == (
            "hicache_host_bytes", 1 << 40, None, BreachKind.TOO_LARGE, "lm")
        assert breach.message.startswith("role 'lm': the host memory of SGLang's host pool cannot be counted")
        assert "params.sglang.max_total_tokens is not set" in breach.message
        [breach] = run_check(user, uncapped, quotas, timeout_s=None, upload_bytes=0, model_dirs=(model_root,)).breaches
        assert breach.asked is None and breach.to_dict()["asked"] is None
        capped_unknown_shape = parse_document(sglang_spec())
        [breach] = deployment_check(user, capped_unknown_shape, {}, quotas, model_dirs=()).breaches
        assert breach.asked is None and "does not give its KV shape" in breach.message
        assert deployment_check(user, parse_document(sglang_spec()), {}, quotas, model_dirs=(model_root,)).ok
        assert deployment_check(staff, uncapped, {}, quotas, model_dirs=()).ok

        stored = live_sglang(api, user, "old", hicache={"host_capacity_bytes": 1}, sglang={})
        over = api.post(f"/api/deployments/{stored.pk}/scale/", {"role": "lm", "replicas": 2}, format="json")
        assert over.status_code == 403, over.content
        [detail] = quota_details(over)
        assert (detail["limit"], detail["asked"], detail["role"]) == ("hicache_host_bytes", None, "lm")
        assert "params.sglang.max_total_tokens is not set" in detail["message"]
    assert Deployment.objects.get().replicas == {"lm": 1}


def test_hicache_disk_bytes_count_only_a_disk_tier(user, model_root: Path) -> None:
    with configured(quotas={"hicache_disk_bytes": 64 * GIB}) as studio:
        quotas = studio.config.quotas
        tiered = parse_document(sglang_spec(replicas=2, hicache={"disk_path": "kv", "disk_capacity_bytes": 40 * GIB}))
        [breach] = deployment_check(user, tiered, {}, quotas, model_dirs=(model_root,)).breaches
        assert (breach.limit, breach.value, breach.asked, breach.role) == ("hicache_disk_bytes", 64 * GIB, 80 * GIB, "lm")
        assert breach.setting == "OMNIFLOW_QUOTA_HICACHE_DISK_BYTES" and breach.kind is BreachKind.TOO_LARGE
        assert deployment_check(user, tiered, {"lm": 1}, quotas, model_dirs=(model_root,)).breaches  # the spec's 2
        default_size = parse_document(sglang_spec(replicas=8, hicache={"disk_path": "kv"}))  # 8 GiB each
        assert deployment_check(user, default_size, {}, quotas, model_dirs=(model_root,)).ok
        no_disk = parse_document(sglang_spec(replicas=2, hicache={"disk_capacity_bytes": 40 * GIB}))
        assert deployment_check(user, no_disk, {}, quotas, model_dirs=(model_root,)).ok


def test_a_runs_hicache_bytes_are_checked_and_staff_are_exempt(user, staff, model_root: Path) -> None:
    spec = parse_document(sglang_spec(replicas=3, hicache={"host_capacity_bytes": 4 * GIB}))
    with configured(quotas={"hicache_host_bytes": 10 * GIB}) as studio:
        quotas = studio.config.quotas
        check = run_check(user, spec, quotas, timeout_s=None, upload_bytes=0, model_dirs=(model_root,))
        [breach] = check.breaches
        assert (breach.limit, breach.asked, breach.kind) == ("hicache_host_bytes", 3 * (4 * GIB + POOL),
                                                             BreachKind.TOO_LARGE)
        assert "the workflow's other roles" in breach.message
        with pytest.raises(QuotaTooLarge) as refused:
            check.enforce()
        assert refused.value.status_code == 403
        assert run_check(staff, spec, quotas, timeout_s=None, upload_bytes=0, model_dirs=()).ok
        assert deployment_check(staff, spec, {}, quotas, model_dirs=()).ok
