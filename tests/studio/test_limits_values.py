"""Values a run's nodes make that JSON cannot print: an integer of more digits than Python
converts (4300) is previewed by its size, `{"int": {"bits": n}}`, in the node's outputs, the
run's outputs and the stored events; the run ends as it would with any other value."""

from __future__ import annotations

from typing import Any

import pytest

from engine.client.runs import preview
from studio.workflows.apps import engine
from studio.workflows.models import RunEvent
from tests.studio.factories import create_workflow
from tests.studio.limits import python_spec

BITS = 20_001
"""The bit length of 2**20000, what `tests.studio.fns.huge` returns."""


def test_preview_shows_an_integer_by_its_size_past_the_limit() -> None:
    assert preview(10**1999) == 10**1999  # 2000 digits: the limit itself
    assert preview(-(10**1998)) == -(10**1998)
    assert preview(10**2000) == {"int": {"bits": (10**2000).bit_length()}}
    assert preview(-(10**1999)) == {"int": {"bits": (10**1999).bit_length()}}  # 2001 characters with its sign
    assert preview(1 << 20_000) == {"int": {"bits": BITS}}
    assert preview({"n": 1 << 20_000, "small": [1, 2]}) == {"n": {"int": {"bits": BITS}}, "small": [1, 2]}
    assert preview([1 << 20_000] * 3, limit=100) == [{"int": {"bits": BITS}}] * 3


def json_spec(op: str) -> dict[str, Any]:
    spec = python_spec(op=op)
    spec["nodes"][1]["outputs"]["out"]["type"] = "json"
    spec["nodes"][2]["inputs"]["value"]["type"] = "json"
    return spec


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("op,shown", [
    ("tests.studio.fns:huge", {"int": {"bits": BITS}}),
    ("tests.studio.fns:holds_huge", {"n": {"int": {"bits": BITS}}, "small": [1, 2]}),
])
def test_a_node_output_too_long_to_print_is_previewed_by_its_size(api, op: str, shown: Any) -> None:
    wf = create_workflow(api, json_spec(op))
    run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "x"}}, format="json").json()
    engine().runs.wait(run["id"])
    done = api.get(f"/api/runs/{run['id']}/").json()
    assert done["status"] == "done", done["error"]
    assert done["outputs"] == {"result": shown}
    assert next(n for n in done["nodes"] if n["node"] == "step")["outputs"] == {"out": shown}
    outputs = [e.data["value"] for e in RunEvent.objects.filter(run_id=run["id"], type="node_output")
               if e.data["node"] == "step"]
    assert outputs == [shown]
