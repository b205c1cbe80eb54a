"""An `sglang_llm` role in the studio: its free-form `hicache` and `sglang` params cannot make a
GPU worker load code, reach a host or write outside the owner's folder; a role whose SGLang host
pool has no size (no `sglang.max_total_tokens`) and a role the studio cannot run (its runner
refuses tenant runs; every studio run has a tenant) are issues on the role at validation and
deployment, not a deployment whose every run fails or whose host memory no quota counts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.spec.ops import default_ops
from studio.workflows.apps import StudioEngine
from studio.workflows.paths import PathRefused, PathRoots, resolve_spec_paths
from tests.studio.factories import create_workflow
from tests.studio.limits import configured, llm_spec


@pytest.fixture
def checkpoints(tmp_path: Path) -> Iterator[StudioEngine]:
    """The studio with a model root holding the checkpoint `org/ckpt`."""
    root = tmp_path / "models"
    (root / "org" / "ckpt").mkdir(parents=True)
    (root / "org" / "ckpt" / "config.json").write_text("{}")
    with configured(model_dirs=(root,)) as studio:
        yield studio


MAX_TOTAL_TOKENS = 4096


def sglang_spec(**params: Any) -> dict[str, Any]:
    """An sglang_llm role with `params`, its device pool capped (`sglang.max_total_tokens`) unless
    `params` say otherwise."""
    params["sglang"] = {"max_total_tokens": MAX_TOTAL_TOKENS, **params.get("sglang", {})}
    return llm_spec(role={"kind": "sglang_llm", "model": "org/ckpt", "params": params})


def issues(api: Any, spec: dict[str, Any]) -> list[dict[str, Any]]:
    response = api.post("/api/validate/", {"spec": spec}, format="json")
    assert response.status_code == 400, response.content
    return response.json()["details"]


def attacks(found: list[dict[str, Any]]) -> list[tuple[str, str | None, str]]:
    """(code, role, message) of every issue but the tenant one each sglang role has here."""
    return [(i["code"], i.get("role"), i["message"]) for i in found if i["code"] != "tenant_unsupported"]


@pytest.mark.django_db
@pytest.mark.parametrize(("params", "named"), [
    ({"hicache": {"module_path": "os", "class_name": "system"}}, "module_path"),
    ({"hicache": {"interface_v1": 0}}, "interface_v1"),
    ({"sglang": {"trust_remote_code": True}}, "trust_remote_code"),
    ({"sglang": {"tokenizer_path": "/etc"}}, "tokenizer_path"),
    ({"sglang": {"crash_dump_folder": "/tmp/x"}}, "crash_dump_folder"),
    ({"sglang": {"host": "0.0.0.0"}}, "host"),
])
def test_code_paths_and_hosts_in_the_free_form_params_are_refused_on_the_role(api, checkpoints, params, named):
    [(code, role, message)] = attacks(issues(api, sglang_spec(**params)))
    assert (code, role) == ("bad_param", "lm") and repr(named) in message


@pytest.mark.django_db
def test_hicache_ratio_is_bounded_on_the_role(api, checkpoints):
    """SGLang's host pool is `hicache_ratio` times its device pool: at most 16 times, and at least
    once (SGLang refuses a smaller host pool)."""
    for ratio, bound in ((17, "maximum of 16"), (0.5, "minimum of 1")):
        [(code, role, message)] = attacks(issues(api, sglang_spec(hicache_ratio=ratio)))
        assert (code, role) == ("bad_param", "lm") and "params.hicache_ratio" in message and bound in message
    assert attacks(issues(api, sglang_spec(hicache_ratio=16))) == []


@pytest.mark.django_db
def test_the_kv_index_is_the_operators_and_the_disk_tier_is_under_the_users_folder(api, checkpoints):
    found = attacks(issues(api, sglang_spec(hicache={"redis_url": "redis://10.0.0.9:6379/0"})))
    assert [(code, role) for code, role, _ in found] == [("operator_param", "lm")]
    assert "params.hicache.redis_url" in found[0][2]
    for name in ("../x", "/etc/x"):
        [refused] = [i for i in issues(api, sglang_spec(hicache={"disk_path": name})) if i["code"] == "path_refused"]
        assert (refused["role"], refused["path"]) == ("lm", "params.hicache.disk_path")


@pytest.mark.django_db
def test_a_role_the_studio_cannot_run_is_an_issue_at_validation_and_deployment(api, checkpoints):
    spec = sglang_spec(page_size=32, hicache={"host_capacity_bytes": 1 << 30, "disk_path": "kv"},
                       sglang={"attention_backend": "triton"})
    [issue] = issues(api, spec)
    assert (issue["code"], issue["role"], issue["path"]) == ("tenant_unsupported", "lm", "kind")
    assert "without a tenant" in issue["message"] and "'llm'" in issue["message"]
    workflow = create_workflow(api, spec)
    deployment = api.post("/api/deployments/", {"workflow": workflow["id"]}, format="json")
    assert deployment.status_code == 422, deployment.content
    assert [d["code"] for d in deployment.json()["details"]] == ["tenant_unsupported"]


@pytest.mark.django_db
def test_a_role_without_a_cap_on_its_device_pool_is_an_issue_naming_the_field(api, checkpoints):
    """SGLang's host pool is `hicache_ratio` times its device pool, which SGLang sizes from its GPU
    unless `sglang.max_total_tokens` caps it: without the cap the pool has no size a quota can
    count, so the role is refused, before save and at deployment; with it, nothing is said."""
    for uncapped in (sglang_spec(sglang={"max_total_tokens": None}), sglang_spec(sglang={"attention_backend": "x"})):
        uncapped["roles"][0]["params"]["sglang"].pop("max_total_tokens")
        [issue] = [i for i in issues(api, uncapped) if i["code"] != "tenant_unsupported"]
        assert (issue["code"], issue["role"], issue["path"]) == ("size_unbounded", "lm",
                                                                 "params.sglang.max_total_tokens")
        assert "role 'lm': set params.sglang.max_total_tokens" in issue["message"]
        assert "HiCache quota" in issue["message"]
    no_engine_params = sglang_spec()
    del no_engine_params["roles"][0]["params"]["sglang"]
    assert "size_unbounded" in [i["code"] for i in issues(api, no_engine_params)]
    workflow = create_workflow(api, no_engine_params)
    deployment = api.post("/api/deployments/", {"workflow": workflow["id"]}, format="json")
    assert deployment.status_code == 422, deployment.content
    assert [(d["code"], d.get("path")) for d in deployment.json()["details"]] == [
        ("size_unbounded", "params.sglang.max_total_tokens"), ("tenant_unsupported", "kind")]
    assert attacks(issues(api, sglang_spec())) == []  # capped: counted, nothing to say

def test_the_hicache_disk_tier_resolves_under_the_owners_folder(tmp_path: Path):
    roots = PathRoots(users=tmp_path / "users", models=())
    spec = sglang_spec(hicache={"disk_path": "kv/sglang", "host_capacity_bytes": 1 << 20})
    spec["roles"][0]["model"] = "tiny-llama"  # built in: no model root needed here
    resolved = resolve_spec_paths(spec, 5, roots, default_ops())
    assert resolved["roles"][0]["params"]["hicache"] == {"disk_path": str(tmp_path / "users" / "5" / "kv" / "sglang"),
                                                         "host_capacity_bytes": 1 << 20}
    assert spec["roles"][0]["params"]["hicache"]["disk_path"] == "kv/sglang"  # the document is not modified
    (tmp_path / "users" / "5" / "out").symlink_to(tmp_path)
    spec["roles"][0]["params"]["hicache"]["disk_path"] = "out/kv"
    with pytest.raises(PathRefused) as refused:
        resolve_spec_paths(spec, 5, roots, default_ops())
    [issue] = refused.value.issues
    assert (issue.role, issue.path) == ("lm", "params.hicache.disk_path") and "symbolic link" in issue.message
