"""The engine's hard ceilings on values that size memory or processes: validation reports a
value past them on the role or node it belongs to (whoever submits the spec)."""

from __future__ import annotations

from typing import Any

import pytest

from engine.compute import kinds as compute_kinds
from engine.flow.validate import GraphValidationError, check_spec, parse_spec
from engine.spec.graph import MAX_ITERATIONS
from engine.spec.kinds import MAX_CAPACITY, KindRegistry, default_kinds


@pytest.fixture
def kinds() -> KindRegistry:
    registry = default_kinds(load_entry_points=False)
    compute_kinds.register(registry)
    return registry


def spec(role: dict[str, Any] | None = None, node: dict[str, Any] | None = None) -> dict[str, Any]:
    """prompt -> llm node `gen` on role `lm` -> text."""
    return {
        "version": 1,
        "name": "maxima",
        "roles": [{"name": "lm", "kind": "llm", "model": "tiny-llama", **(role or {})}],
        "nodes": [
            {"id": "prompt", "kind": "input", "outputs": {"value": {"type": "text"}}},
            {"id": "gen", "kind": "llm", "role": "lm", "inputs": {"prompt": {"type": "text"}},
             "outputs": {"text": {"type": "text"}, "tokens": {"type": "tokens"}, "kv": {"type": "kv"}}, **(node or {})},
            {"id": "text", "kind": "output", "inputs": {"value": {"type": "text"}}},
        ],
        "edges": [
            {"source": "prompt", "source_port": "value", "target": "gen", "target_port": "prompt"},
            {"source": "gen", "source_port": "text", "target": "text", "target_port": "value"},
        ],
    }


def test_the_base_spec_is_valid(kinds: KindRegistry) -> None:
    assert check_spec(parse_spec(spec()), kinds) == []


@pytest.mark.parametrize("param,value", [
    ("capacity", MAX_CAPACITY + 1),
    ("max_running", compute_kinds.MAX_RUNNING + 1),
    ("max_prefill_tokens", compute_kinds.MAX_PREFILL_TOKENS + 1),
    ("device_pages", compute_kinds.MAX_DEVICE_PAGES + 1),
    ("host_pages", compute_kinds.MAX_HOST_PAGES + 1),
    ("page_size", compute_kinds.MAX_PAGE_SIZE + 1),
])
def test_role_params_past_their_maximum_are_issues_on_the_role(kinds: KindRegistry, param: str, value: int) -> None:
    issues = check_spec(parse_spec(spec(role={"params": {param: value}})), kinds)
    assert [(i.code, i.role) for i in issues] == [("bad_param", "lm")]
    assert f"params.{param}" in issues[0].message and "maximum" in issues[0].message


def test_disk_pages_past_the_maximum(kinds: KindRegistry) -> None:
    params = {"disk_path": "kv", "disk_pages": compute_kinds.MAX_DISK_PAGES + 1}
    issues = check_spec(parse_spec(spec(role={"params": params})), kinds)
    assert [(i.code, i.role) for i in issues] == [("bad_param", "lm")]


def test_max_new_tokens_past_the_maximum_is_an_issue_on_the_node(kinds: KindRegistry) -> None:
    issues = check_spec(parse_spec(spec(node={"params": {"max_new_tokens": compute_kinds.MAX_NEW_TOKENS + 1}})), kinds)
    assert [(i.code, i.node) for i in issues] == [("bad_param", "gen")]


@pytest.mark.parametrize("field,value", [("replicas", 1025), ("tp_size", 65)])
def test_replicas_and_tp_size_past_the_maximum_name_the_role(field: str, value: int) -> None:
    with pytest.raises(GraphValidationError) as refused:
        parse_spec(spec(role={field: value}))
    [issue] = refused.value.issues
    assert (issue.code, issue.role, issue.path) == ("schema", "lm", f"$.roles[0].{field}")
    assert issue.message.startswith("role 'lm': ")


def test_max_iterations_past_the_maximum_names_the_node() -> None:
    with pytest.raises(GraphValidationError) as refused:
        parse_spec(spec(node={"max_iterations": MAX_ITERATIONS + 1}))
    [issue] = refused.value.issues
    assert (issue.code, issue.node, issue.path) == ("schema", "gen", "$.nodes[1].max_iterations")
