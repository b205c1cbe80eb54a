"""Helpers of the quota, path and limit tests: the studio's engine with changed settings."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from django.apps import apps

from studio.workflows.apps import StudioEngine, build_engine


@contextlib.contextmanager
def configured(*, quotas: dict[str, Any] | None = None, **changes: Any) -> Iterator[StudioEngine]:
    """Run the block with this process's engine built from its config with `changes` (and the
    quota fields in `quotas` changed); the previous engine is put back afterwards."""
    app = apps.get_app_config("workflows")
    config = app.engine.config
    if quotas:
        changes["quotas"] = dataclasses.replace(config.quotas, **quotas)
    studio = build_engine(dataclasses.replace(config, **changes))
    previous = app.install(studio)
    try:
        yield studio
    finally:
        studio.runs.stop()
        app.install(previous)


def python_spec(*, replicas: int = 1, name: str = "work", **node: Any) -> dict[str, Any]:
    """input `text` -> python node `step` (echo) -> output `result`, on role `py`."""
    return {
        "version": 1,
        "name": name,
        "roles": [{"name": "py", "kind": "python", **({"replicas": replicas} if replicas != 1 else {})}],
        "nodes": [
            {"id": "text", "kind": "input", "outputs": {"value": {"type": "text"}}},
            {"id": "step", "kind": "python", "role": "py", "op": "tests.studio.fns:echo",
             "inputs": {"text": {"type": "text"}}, "outputs": {"out": {"type": "text"}}, **node},
            {"id": "result", "kind": "output", "inputs": {"value": {"type": "text"}}},
        ],
        "edges": [
            {"source": "text", "source_port": "value", "target": "step", "target_port": "text"},
            {"source": "step", "source_port": "out", "target": "result", "target_port": "value"},
        ],
    }


def llm_spec(*, name: str = "lm", role: dict[str, Any] | None = None,
             node_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """input `prompt` -> llm node `gen` on role `lm` (tiny-llama) -> output `text`."""
    return {
        "version": 1,
        "name": name,
        "roles": [{"name": "lm", "kind": "llm", "model": "tiny-llama", **(role or {})}],
        "nodes": [
            {"id": "prompt", "kind": "input", "outputs": {"value": {"type": "text"}}},
            {"id": "gen", "kind": "llm", "role": "lm", "params": node_params or {},
             "inputs": {"prompt": {"type": "text"}},
             "outputs": {"text": {"type": "text"}, "tokens": {"type": "tokens"}, "kv": {"type": "kv"}}},
            {"id": "text", "kind": "output", "inputs": {"value": {"type": "text"}}},
        ],
        "edges": [
            {"source": "prompt", "source_port": "value", "target": "gen", "target_port": "prompt"},
            {"source": "gen", "source_port": "text", "target": "text", "target_port": "value"},
        ],
    }


def quota_details(response: Any) -> list[dict[str, Any]]:
    body = response.json()
    assert set(body) == {"error", "details"}, body
    return [d for d in body["details"] if isinstance(d, dict) and d.get("code") == "quota"]
