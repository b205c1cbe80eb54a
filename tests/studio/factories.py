"""Small builders of GraphSpecs and workflows for the studio tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.examples import example_doc

ROOT = Path(__file__).resolve().parents[2]


def example_spec(name: str, *, tiny: bool = False) -> dict[str, Any]:
    """The GraphSpec document of workflows/NAME.py (`tiny`: on the tiny seeded LLM instead of the
    real one, see `tests.examples`)."""
    return example_doc(name, tiny=tiny)


def spec_doc(*, name: str = "echo", op: str = "tests.studio.fns:echo", node_kind: str = "python",
             extra_nodes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """input `text` -> python node `step` -> output `result`."""
    return {
        "version": 1,
        "name": name,
        "roles": [{"name": "py", "kind": "python"}],
        "nodes": [
            {"id": "text", "kind": "input", "outputs": {"value": {"type": "text"}}},
            {"id": "step", "kind": node_kind, "role": "py", "op": op, "inputs": {"text": {"type": "text"}},
             "outputs": {"out": {"type": "text"}}},
            {"id": "result", "kind": "output", "inputs": {"value": {"type": "text"}}},
            *(extra_nodes or []),
        ],
        "edges": [
            {"source": "text", "source_port": "value", "target": "step", "target_port": "text"},
            {"source": "step", "source_port": "out", "target": "result", "target_port": "value"},
        ],
    }


def create_workflow(api: Any, spec: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"spec": spec}
    if name:
        body["name"] = name
    response = api.post("/api/workflows/", body, format="json")
    assert response.status_code == 201, response.content
    return response.json()
