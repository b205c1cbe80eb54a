"""The `omniflow` command line, called in-process through `engine.cli.main`, plus one
run of the installed entry point in a subprocess."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import _show_progress, main
from engine.flow.dsl import Workflow
from engine.flow.events import NodeProgressEvent
from engine.flow.loader import load_workflow
from engine.spec.graph import encode_spec

ROOT = Path(__file__).resolve().parents[3]
WORKFLOWS = sorted(p for p in (ROOT / "workflows").glob("*.py") if p.name != "__init__.py")


def workflow(name: str) -> str:
    return str(ROOT / "workflows" / f"{name}.py")


def run_json(capsys, *argv: str) -> dict:
    """`omniflow run ... --json -q`: exactly one JSON object on standard output."""
    assert main(["run", *argv, "--json", "-q"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 1, out
    assert err == ""
    return json.loads(lines[0])


EXPORTED_PREFIX = "omniflow_exported_"


@pytest.fixture
def isolated_imports(monkeypatch):
    """Undo what loading an exported module from tmp_path does to sys.path and sys.modules."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name in [m for m in sys.modules if m.startswith(EXPORTED_PREFIX)]:
        del sys.modules[name]


# ------------------------------------------------------------------ validate
def test_examples_exist():
    assert {p.stem for p in WORKFLOWS} >= {"diamond", "loop", "router", "stream"}


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_validate_every_example(capsys, path):
    assert main(["validate", str(path)]) == 0
    spec = load_workflow(path)
    out, err = capsys.readouterr()
    assert out == (f"{path}: workflow {spec.name!r} is valid ({len(spec.nodes)} nodes, {len(spec.edges)}"
                   " edges)\n")
    assert err == ""


INVALID_DOC = {
    "version": 1,
    "name": "broken",
    "roles": [{"name": "py", "kind": "python", "balance": "fastest"}],
    "nodes": [
        {"id": "n", "kind": "input", "outputs": {"value": {"type": "text"}}},
        {"id": "f", "kind": "python", "role": "py", "inputs": {"x": {"type": "image"}, "y": {"type": "json"}},
         "outputs": {"out": {"type": "json"}}},
        {"id": "g", "kind": "teleport"},
    ],
    "edges": [{"source": "n", "source_port": "value", "target": "f", "target_port": "x"}],
}


def test_validate_invalid_json_graphspec_prints_every_error(capsys, tmp_path):
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(INVALID_DOC))
    assert main(["validate", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "invalid workflow: 5 problems",
        "  [unknown_policy] role 'py' names unknown load-balancing policy 'fastest' (known: round_robin, random,"
        " least_outstanding, power_of_two, consistent_hash, kv_aware)  (role=py)",
        "  [missing_op] node 'f' of kind 'python' needs an op  (node=f)",
        "  [unknown_kind] node 'g' has unknown kind 'teleport'  (node=g)",
        "  [type_mismatch] edge n.value->f.x: output n.value is text but input f.x expects image"
        "  (node=f, edge=n.value->f.x, port=x)",
        "  [dangling_port] input port f.y is not connected (connect it or mark it optional)  (node=f, port=y)",
    ]


def test_validate_names_unknown_ops_and_allows_module_ops(capsys, tmp_path):
    doc = json.loads(encode_spec(load_workflow(ROOT / "workflows" / "diamond.py")))
    square = next(n for n in doc["nodes"] if n["id"] == "square")
    square["op"] = "diamond.sqare"
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(doc))
    assert main(["validate", str(path)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "invalid workflow: 1 problem",
        "  [op_unknown] node 'square': op 'diamond.sqare' is not a registered op; did you mean 'diamond.square'?"
        "  (node=square)",
    ]
    square["op"] = "tests.unit.flow.fns:inc"  # the command line runs a person's own code
    path.write_text(json.dumps(doc))
    assert main(["validate", str(path)]) == 0


def test_validate_schema_errors_are_all_printed(capsys, tmp_path):
    doc = json.loads(json.dumps(INVALID_DOC))
    doc["version"] = 7
    doc["nodes"][1]["retries"] = "twice"
    doc["edges"][0]["colour"] = "red"
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(doc))
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "invalid workflow: 3 problems",
        "  [schema] $.edges[0]: Additional properties are not allowed ('colour' was unexpected)",
        "  [schema] node 'f': $.nodes[1].retries: 'twice' is not of type 'integer'  (node=f)",
        "  [schema] $.version: 7 is not one of [1]",
    ]


def test_validate_malformed_json_file(capsys, tmp_path):
    path = tmp_path / "truncated.json"
    path.write_text('{"version": 1, "name": ')
    assert main(["validate", str(path)]) == 1
    assert capsys.readouterr().err == (
        "invalid workflow: 1 problem\n  [malformed_json] not valid JSON: Expecting value at line 1 column 24\n"
    )


@pytest.mark.parametrize(("name", "message"), [
    ("missing.py", "no such file"),
    ("notes.txt", "expected a .py DSL module or a .json GraphSpec"),
])
def test_validate_unloadable_paths(capsys, tmp_path, name, message):
    path = tmp_path / name
    if name.endswith(".txt"):
        path.write_text("hello")
    assert main(["validate", str(path)]) == 1
    assert capsys.readouterr().err == f"error: {path}: {message}\n"


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["validate"])
    assert caught.value.code == 2
    with pytest.raises(SystemExit) as caught:
        main(["run", workflow("diamond"), "--bogus"])
    assert caught.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


# ------------------------------------------------------------------ export
@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_export_json_then_validate(capsys, tmp_path, path):
    assert main(["export", str(path), "--format", "json"]) == 0
    text = capsys.readouterr().out
    exported = tmp_path / f"{path.stem}.json"
    exported.write_text(text)
    assert json.loads(text) == json.loads(encode_spec(load_workflow(path)))
    assert main(["validate", str(exported)]) == 0
    assert capsys.readouterr().out.startswith(f"{exported}: workflow {path.stem!r} is valid")
    # -o writes the same text to a file.
    again = tmp_path / "again.json"
    assert main(["export", str(path), "-o", str(again)]) == 0
    assert again.read_text() == text


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_export_python_loads_back_to_the_identical_spec(capsys, tmp_path, isolated_imports, path):
    assert main(["export", str(path), "--format", "python"]) == 0
    source = capsys.readouterr().out
    package = tmp_path / f"{EXPORTED_PREFIX}{path.stem}"
    package.mkdir()
    (package / "__init__.py").write_text("")
    module = package / "generated.py"
    module.write_text(source)
    reloaded = load_workflow(module)
    assert reloaded == load_workflow(path)
    assert encode_spec(reloaded) == encode_spec(load_workflow(path))
    assert sys.modules[f"{EXPORTED_PREFIX}{path.stem}.generated"].__file__ == str(module)


# ------------------------------------------------------------------ run
def test_run_diamond_json(capsys):
    doc = run_json(capsys, workflow("diamond"))
    assert doc["outputs"] == {"sum": 252}  # 6**2 + 6**3
    assert (doc["workflow"], doc["status"], doc["error"], doc["failed_node"]) == ("diamond", "done", None, None)
    assert {nid: (n["state"], n["attempts"], n["iterations"]) for nid, n in doc["nodes"].items()} == {
        "n": ("done", 0, 1), "square": ("done", 1, 1), "cube": ("done", 1, 1), "memo": ("done", 1, 1),
        "total": ("done", 1, 1), "sum": ("done", 0, 1),
    }


def test_run_diamond_with_remembered_input(capsys):
    assert run_json(capsys, workflow("diamond"), "--input", "n=3")["outputs"] == {"sum": 36}
    assert main(["run", workflow("diamond"), "--input", "n=3", "-q"]) == 0
    assert capsys.readouterr().out == "sum: 36\n"


def test_run_prints_progress_on_stderr(capsys):
    assert main(["run", workflow("diamond")]) == 0
    out, err = capsys.readouterr()
    assert out == "sum: 252\n"
    lines = err.splitlines()
    assert any(line.startswith("  total: running on diamond-py-") for line in lines), lines  # its worker
    assert lines[-1].startswith("run ") and " done in " in lines[-1]


def llm_workflow(path: Path, max_new_tokens: int) -> str:
    """A GraphSpec file: text -> an llm node on the random-weight `tiny-llama` -> text."""
    wf = Workflow("tokens")
    llm = wf.role("llm", kind="llm", model="tiny-llama", params={"page_size": 4})
    prompt = wf.input("prompt", "text", default="count the tokens")
    gen = wf.node("gen", "llm", role=llm, params={"max_new_tokens": max_new_tokens, "ignore_eos": True})
    wf.edge(prompt, gen.inp("prompt"))
    wf.output("reply", gen.out("text"), "text")
    path.write_bytes(encode_spec(wf.to_spec()))
    return str(path)


@pytest.mark.parametrize("workers", ["local", "inproc"])
def test_run_of_an_llm_workflow_prints_its_tokens_of_max_new_tokens_on_stderr(capsys, tmp_path, workers):
    assert main(["run", llm_workflow(tmp_path / "tokens.json", 12), "--workers", workers]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("reply: ")
    bars = [line for line in err.splitlines() if line.startswith("  gen: [")]
    # From nothing to all of max_new_tokens, never backwards, each bar matching its count.
    assert bars[0] == "  gen: [--------------------] 0% 0/12 tokens", err
    assert bars[-1] == "  gen: [####################] 100% 12/12 tokens", err
    counts = [int(line.rsplit(" ", 2)[1].split("/")[0]) for line in bars]
    assert counts == sorted(counts) and all(line.endswith(f"{n}/12 tokens") for line, n in zip(bars, counts, strict=True))
    assert all(line.split("] ")[1].startswith(f"{n * 100 / 12:.0f}%") for line, n in zip(bars, counts, strict=True))
    lines = err.splitlines()
    assert lines.index(bars[0]) > next(i for i, line in enumerate(lines) if line.startswith("  gen: running"))
    assert lines[-1].startswith("run ") and " done in " in lines[-1]


def test_progress_reads_as_a_bar_with_its_count():
    out = io.StringIO()
    _show_progress(NodeProgressEvent(seq=3, run_id="r", time=1.0, node="reply", progress=0.25,
                                     message="30/120 tokens"), out)
    _show_progress(NodeProgressEvent(seq=4, run_id="r", time=1.0, node="op", message="warming up"), out)
    assert out.getvalue() == "  reply: [#####---------------] 25% 30/120 tokens\n  op: warming up\n"


def test_run_loop(capsys):
    doc = run_json(capsys, workflow("loop"))
    assert doc["outputs"] == {"result": {"value": 192, "steps": 6}}
    assert (doc["nodes"]["grow"]["iterations"], doc["nodes"]["check"]["iterations"]) == (6, 6)
    assert main(["run", workflow("loop"), "--input", "value=5", "--input", "target=20", "-q"]) == 0
    assert capsys.readouterr().out == 'result: {"value": 20, "steps": 2}\n'


def test_run_loop_past_its_bound_exits_1(capsys):
    assert main(["run", workflow("loop"), "--input", "target=1e12", "-q"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "error: node 'grow' failed: reached max_iterations=32 without leaving its loop\n"


@pytest.mark.parametrize(("argv", "reply", "skipped"), [
    (["--input", "message=hello"], "HELLO", "answer"),
    ([], "You asked: 'What is the meaning of life?'. The answer is 42.", "echo"),
])
def test_run_router(capsys, argv, reply, skipped):
    doc = run_json(capsys, workflow("router"), *argv)
    assert doc["outputs"] == {"reply": reply}
    assert doc["nodes"][skipped]["state"] == "skipped"
    assert main(["run", workflow("router"), *argv, "-q"]) == 0
    assert capsys.readouterr().out == f"reply: {reply}\n"


def test_run_stream(capsys):
    doc = run_json(capsys, workflow("stream"))
    assert doc["outputs"] == {"result": "FRAMES FLOW THROUGH THE GRAPH ONE AT A TIME"}
    assert main(["run", workflow("stream"), "--input", "text=one two", "-q"]) == 0
    assert capsys.readouterr().out == "result: ONE TWO\n"


@pytest.mark.parametrize(("pair", "message"), [
    ("size=3", "error: --input size: the workflow has no input 'size' (inputs: ['n'])"),
    ("n=three", "error: --input n: 'three' is not JSON (input 'n' is of type json; quote strings, e.g."
                " '\"text\"')"),
    ("n3", "error: --input 'n3': expected NAME=VALUE"),
])
def test_run_input_errors(capsys, pair, message):
    assert main(["run", workflow("diamond"), "--input", pair]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == message + "\n"


def test_run_input_errors_are_all_reported(capsys):
    assert main(["run", workflow("diamond"), "--input", "size=3", "--input", "n=three", "--input", "n3"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: --input size: the workflow has no input 'size' (inputs: ['n'])",
        "--input n: 'three' is not JSON (input 'n' is of type json; quote strings, e.g. '\"text\"')",
        "--input 'n3': expected NAME=VALUE",
    ]


def test_installed_entry_point_runs_the_diamond():
    exe = Path(sys.executable).with_name("omniflow")
    assert exe.exists(), f"{exe}: the package is not installed in this environment"
    proc = subprocess.run([str(exe), "run", "workflows/diamond.py", "--json", "-q"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["status"], doc["outputs"]) == ("done", {"sum": 252})
