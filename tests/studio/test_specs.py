"""The safe DSL source reader, the op policy and the version diff."""

from __future__ import annotations

import pytest

from engine.flow.pysrc import to_python
from engine.flow.validate import GraphValidationError, parse_spec
from engine.spec.kinds import default_kinds
from engine.spec.ops import OpConfig, default_ops
from studio.workflows.specs import check, diff_documents, spec_from_source
from tests.studio.factories import ROOT, example_spec, spec_doc

EXAMPLES = ["diamond", "loop", "router", "stream"]


def studio_ops(*, allow_module_ops: bool = False) -> OpConfig:
    return OpConfig(default_ops(), allow_module_ops=allow_module_ops)


@pytest.mark.parametrize("name", EXAMPLES)
def test_source_reader_round_trips_examples(name: str) -> None:
    spec = parse_spec(example_spec(name))
    assert spec_from_source(to_python(spec)) == spec


def test_hand_written_source_with_names_and_refs() -> None:
    source = '''
from engine.flow.dsl import Workflow
wf = Workflow("hand", description="by hand")
py = wf.role("py", kind="python")
x = wf.input("x", "json", default=2)
node = wf.node("double", "python", role=py, op="diamond.square", inputs={"x": "json"},
               outputs={"out": "json"})
wf.edge(x, node.inp("x"))
wf.output("y", node)
workflow = wf
'''
    spec = spec_from_source(source)
    assert [n.id for n in spec.nodes] == ["x", "double", "y"]
    assert check(spec, default_kinds(), studio_ops()).valid


@pytest.mark.parametrize(("source", "needle"), [
    ("import os\nwf = Workflow('x')", "line 1: statement 'import os' is not allowed"),
    ("from engine.flow.dsl import Workflow\n__import__('os').system('true')", "line 2: call"),
    ("from engine.flow.dsl import Workflow\nwf = Workflow('x')\nwf.python(print, role='py')", "line 3: unknown name 'print'"),
    ("from engine.flow.dsl import Workflow\nwf = Workflow('x')\nwf.name = 'y'", "line 3: statement"),
    ("from engine.flow.dsl import Workflow\nwf = Workflow('x')\nwf.role(open('/etc/passwd'), kind='py')",
     "line 3: call 'open'"),
    ("from engine.flow.dsl import Workflow\nwf = Workflow('x')\nclass A: pass", "line 3: statement"),
    ("wf = (", "syntax error"),
    ("x = 1", "only DSL objects"),
    ('"""doc only"""', "builds no Workflow"),
    # what load_json refuses in a JSON spec is refused in source too (not a DB 500, not saved as null)
    ("from engine.flow.dsl import Workflow\nwf = Workflow('x', description='a\\x00b')", "line 2: the literal holds"
     " what the studio does not take: $: the text holds a NUL"),
    ("from engine.flow.dsl import Workflow\nwf = Workflow('x')\nwf.role('py', kind='python', params={'w': (1, 1e400)})",
     "line 3: the literal holds what the studio does not take: $.w[1]: the number is not finite"),
    ("from engine.flow.dsl import Workflow\nwf = Workflow('x')\nwf.role('py', kind='python', params={'n': 10000000000000000000000})",
     "line 3: the literal holds what the studio does not take: $.n"),
])
def test_source_reader_refuses_anything_else(source: str, needle: str) -> None:
    with pytest.raises(GraphValidationError) as info:
        spec_from_source(source)
    assert [i.code for i in info.value.issues] == ["python_source"]
    assert needle in info.value.issues[0].message


def test_the_quick_start_reads_with_its_registered_op() -> None:
    source = (ROOT / "workflows" / "hello.py").read_text()
    ops = default_ops()
    spec = spec_from_source(source, ops)
    assert spec == parse_spec(example_spec("hello"))  # what the command line builds by running it
    assert spec.node("greet").op == "hello.greet"
    assert check(spec, default_kinds(), studio_ops()).valid
    with pytest.raises(GraphValidationError, match="only the DSL and registered ops"):
        spec_from_source(source)  # without the registry, an import is just an import


@pytest.mark.parametrize(("line", "needle"), [
    ("from workflows.ops.common import Path", "only the DSL and registered ops"),  # imported there, not an op
    ("from os import system", "only the DSL and registered ops"),
    ("from .hello import greet", "only the DSL and registered ops"),
    ("from workflows.ops.hello import greet\ngreet('x')", "call 'greet' is not allowed"),
    ("from workflows.ops.hello import greet\nwf = Workflow('x')\nwf.python(len, role='py')", "unknown name 'len'"),
])
def test_only_registered_op_functions_import_and_none_is_called(line: str, needle: str) -> None:
    source = f"from engine.flow.dsl import Workflow\n{line}\n"
    with pytest.raises(GraphValidationError) as info:
        spec_from_source(source, default_ops())
    assert needle in info.value.issues[0].message


def test_source_is_schema_checked() -> None:
    with pytest.raises(GraphValidationError) as info:
        spec_from_source("from engine.flow.dsl import Workflow\nwf = Workflow('bad name!')")
    assert info.value.issues[0].code == "schema"


def test_op_policy() -> None:
    spec = parse_spec(spec_doc(op="os:system"))
    issues = check(spec, default_kinds(), studio_ops()).issues
    assert [(i.code, i.node) for i in issues] == [("op_not_allowed", "step")]
    assert check(spec, default_kinds(), studio_ops(allow_module_ops=True)).valid
    assert check(parse_spec(spec_doc(op="router.echo")), default_kinds(), studio_ops()).valid
    unknown = check(parse_spec(spec_doc(op="router.ecko")), default_kinds(), studio_ops(allow_module_ops=True))
    assert [(i.code, i.node) for i in unknown.issues] == [("op_unknown", "step")]
    assert "did you mean 'router.echo'" in unknown.issues[0].message


def test_diff_names_what_changed() -> None:
    old = spec_doc()
    new = spec_doc(op="tests.studio.fns:fail")
    new["description"] = "changed"
    new["roles"][0]["replicas"] = 3
    new["nodes"].append({"id": "extra", "kind": "output", "inputs": {"value": {"type": "text"}}})
    new["edges"].append({"source": "step", "source_port": "out", "target": "extra", "target_port": "value"})
    del new["edges"][1]
    diff = diff_documents(old, new)
    assert diff["fields"] == {"description": {"from": None, "to": "changed", "change": "added"}}
    assert diff["roles"]["changed"] == [{"id": "py", "fields": {"replicas": {"from": None, "to": 3, "change": "added"}}}]
    assert diff["nodes"]["added"] == ["extra"]
    assert diff["nodes"]["changed"][0]["id"] == "step"
    assert diff["edges"] == {"added": ["step.out->extra.value"], "removed": ["step.out->result.value"],
                             "changed": []}
    assert '+  "description": "changed"' in diff["unified"]
