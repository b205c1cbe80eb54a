"""DSL -> GraphSpec JSON -> Python DSL source -> GraphSpec JSON is the identity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.flow.loader import load_source, load_workflow
from engine.flow.pysrc import to_python
from engine.flow.validate import check_spec, parse_spec
from engine.spec.graph import encode_spec
from engine.spec.kinds import default_kinds

WORKFLOWS = sorted(p for p in (Path(__file__).parents[3] / "workflows").glob("*.py") if p.name != "__init__.py")


def test_every_example_is_listed():
    assert {p.stem for p in WORKFLOWS} >= {"diamond", "router", "loop", "stream"}


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_dsl_json_python_json_is_identity(path: Path):
    spec = load_workflow(path)
    assert check_spec(spec, default_kinds()) == []
    as_json = encode_spec(spec)
    from_json = parse_spec(as_json)
    assert encode_spec(from_json) == as_json
    source = to_python(from_json)
    again = load_source(source, f"<{path.stem} as python>")
    assert encode_spec(again) == as_json
    # And the generated source is itself stable.
    assert to_python(again) == source


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_json_document_has_the_contract_keys(path: Path):
    doc = json.loads(encode_spec(load_workflow(path)))
    assert {"version", "name", "roles", "nodes", "edges"} <= set(doc)
    assert doc["version"] == 1
    assert all("id" in node for node in doc["nodes"])


def test_tp_size_survives_dsl_json_python_json():
    from engine.flow.dsl import Workflow

    wf = Workflow("tp_chat")
    lm = wf.role("lm", kind="llm", model="tiny-llama", tp_size=2, replicas=2)
    prompt = wf.input("prompt", "text")
    gen = wf.node("gen", "llm", role=lm, params={"max_new_tokens": 4})
    wf.edge(prompt, gen.inp("prompt"))
    wf.output("text", gen.out("text"))
    spec = wf.to_spec()
    assert check_spec(spec, default_kinds()) == []
    as_json = encode_spec(spec)
    assert json.loads(as_json)["roles"][0]["tp_size"] == 2
    source = to_python(parse_spec(as_json))
    assert "tp_size=2" in source
    assert encode_spec(load_source(source, "<tp_chat as python>")) == as_json


def test_registered_and_module_ops_both_survive_dsl_json_python_json():
    from engine.flow.dsl import Workflow
    from tests.unit.flow import fns
    from workflows.ops.chat import join_text
    from workflows.ops.diamond import square

    wf = Workflow("mixed")
    py = wf.role("py", kind="python")
    x = wf.input("x", default=2)
    sq = wf.python(square, role=py)  # registered: its name, and the op's ports
    inc = wf.python(fns.inc, role=py, outputs={"out": "text"})  # undecorated: module:qualname (trusted runs only)
    join = wf.python(join_text, role=py, id="join")
    wf.edge(x, sq)
    wf.edge(sq, inc)
    wf.edge(inc, join.inp("parts"))
    wf.output("y", join.out("text"))
    spec = wf.to_spec()
    ops = {n.id: n.op for n in spec.nodes if n.kind == "python"}
    assert ops == {"square": "diamond.square", "inc": "tests.unit.flow.fns:inc", "join": "chat.join_text"}
    join_node = next(n for n in spec.nodes if n.id == "join")
    assert (join_node.inputs["parts"].join, list(join_node.outputs)) == ("ordered", ["text"])
    assert check_spec(spec, default_kinds()) == []
    as_json = encode_spec(spec)
    source = to_python(parse_spec(as_json))
    assert "op='diamond.square'" in source and "op='tests.unit.flow.fns:inc'" in source
    assert encode_spec(load_source(source, "<mixed as python>")) == as_json
