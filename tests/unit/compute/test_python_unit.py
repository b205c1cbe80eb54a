"""The `python` unit: registered ops looked up, module ops only where allowed, and plain
functions off the event loop that the runs share."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from engine.compute.python import OperationError, resolve_function
from engine.flow.dispatch import InProcessDispatcher
from engine.flow.dsl import Workflow
from engine.flow.events import NodeOutputEvent, NodeProgressEvent
from engine.flow.executor import Executor, RunResult
from engine.spec.calls import NodeCall, NodeContext
from engine.spec.graph import GraphSpec, RoleSpec
from engine.spec.kinds import KindRegistry, default_kinds
from engine.spec.ops import OpConfig, OpNotAllowedError, OpRegistry, op
from engine.spec.userfiles import UsersRoot
from engine.worker.units import SharedUnits

DEADLINE_S = 20.0
"""Every wait's bound: far above what any of them needs (a broken unit fails instead of hanging)."""


@pytest.fixture
def kinds() -> KindRegistry:
    return default_kinds(load_entry_points=False)


def one_node(fn: Callable[..., Any] | str, name: str = "t") -> GraphSpec:
    """x -> node `f` (calling `fn`, or naming the op `fn`) -> y."""
    wf = Workflow(name)
    py = wf.role("py", kind="python")
    x = wf.input("x", default=1)
    if isinstance(fn, str):
        node = wf.node("f", "python", role=py, op=fn, inputs={"x": "json"}, outputs={"out": "json"})
    else:
        node = wf.python(fn, role=py, id="f")
    wf.edge(x, node)
    wf.output("y", node)
    return wf.to_spec()


async def run_once(ops: OpConfig, kinds: KindRegistry, spec: GraphSpec, x: Any = 1) -> RunResult:
    executor = Executor(InProcessDispatcher(kinds, build=SharedUnits(kinds, ops=ops)), kinds)
    try:
        run = await executor.submit(spec, {"x": x}, timeout_s=DEADLINE_S)
        return await run.wait()
    finally:
        await executor.aclose()


@op("test.twice")
def twice(x: int) -> int:
    return 2 * x


async def test_a_registered_op_runs_by_name_without_module_ops(kinds) -> None:
    strict = OpConfig(OpRegistry([twice]), allow_module_ops=False)
    spec = one_node(twice)
    assert spec.nodes[1].op == "test.twice"
    result = await run_once(strict, kinds, spec, 21)
    assert result.outputs == {"y": 42}, result.error


@pytest.mark.parametrize("op_name", ["os:system", "tests.unit.compute.test_python_unit:twice",
                                     "workflows.ops.common:Path.write_text", "omniflow_absent_pkg:run"])
async def test_module_ops_are_refused_unless_allowed(kinds, op_name: str) -> None:
    before = set(sys.modules)
    result = await run_once(OpConfig(OpRegistry([twice]), allow_module_ops=False), kinds, one_node(op_name), "id")
    assert result.error == (f"node 'f' failed: OpNotAllowedError: node 'f': op {op_name!r} names code by its module"
                            " path, which this process does not run (module ops are off: name a registered op"
                            " instead)")
    assert "omniflow_absent_pkg" not in set(sys.modules) - before


@pytest.mark.parametrize("op_name", ["workflows.ops.common:Path.write_text", "os:path.join",
                                     "omniflow_absent_pkg:a.b.c"])
async def test_module_ops_never_walk_attribute_paths_even_where_trusted(kinds, op_name: str, tmp_path) -> None:
    """The command line runs any `module:function`, but only a function of that module: not an
    attribute path through what the module imported (the issue's two-run escape)."""
    before = set(sys.modules)
    trusted = OpConfig(OpRegistry([twice]), allow_module_ops=True)
    result = await run_once(trusted, kinds, one_node(op_name), str(tmp_path / "pwned"))
    module, _, path = op_name.partition(":")
    assert result.error == (f"node 'f' failed: OpNotAllowedError: node 'f': op {op_name!r} walks the attribute"
                            f" path {path!r} through module {module!r}: a module op names one function defined"
                            f" in its module ('{module}:{path.split('.')[-1]}' if it is defined there)")
    assert not (tmp_path / "pwned").exists()
    assert "omniflow_absent_pkg" not in set(sys.modules) - before
    with pytest.raises(OpNotAllowedError, match="walks the attribute path"):
        resolve_function(op_name)  # the unit's own resolver refuses too, before importing anything
    assert "omniflow_absent_pkg" not in set(sys.modules) - before


async def test_a_trusted_module_op_names_one_function_of_its_module(kinds) -> None:
    trusted = OpConfig(OpRegistry(), allow_module_ops=True)
    result = await run_once(trusted, kinds, one_node(f"{__name__}:twice"), 4)
    assert result.outputs == {"y": 8}, result.error
    assert resolve_function("os.path:basename")("a/b") == "b"
    with pytest.raises(OperationError, match="has no 'nothing'"):
        resolve_function("os.path:nothing")


async def test_unknown_ops_name_close_ones_and_import_nothing(kinds) -> None:
    before = set(sys.modules)
    ops = OpConfig(OpRegistry([twice]), allow_module_ops=True)
    result = await run_once(ops, kinds, one_node("test.twise"))
    assert result.error == ("node 'f' failed: UnknownOpError: node 'f': op 'test.twise' is not a registered op;"
                            " did you mean 'test.twice'?")
    result = await run_once(ops, kinds, one_node("omniflow_absent_pkg.thing"))
    assert result.error is not None and "UnknownOpError" in result.error
    assert not {m for m in set(sys.modules) - before if m.startswith("omniflow_absent_pkg")}


async def test_module_ops_run_where_allowed(kinds) -> None:
    trusted = OpConfig(OpRegistry(), allow_module_ops=True)
    result = await run_once(trusted, kinds, one_node(f"{__name__}:twice"), 4)
    assert result.outputs == {"y": 8}, result.error


async def test_an_unknown_op_is_not_retried(kinds) -> None:
    spec = one_node("test.nothing")
    nodes = [msgspec.structs.replace(n, retries=3) if n.id == "f" else n for n in spec.nodes]
    executor = Executor(InProcessDispatcher(kinds, build=SharedUnits(kinds, ops=OpConfig(OpRegistry(), allow_module_ops=False))), kinds)
    try:
        run = await executor.submit(msgspec.structs.replace(spec, nodes=nodes), {"x": 1}, timeout_s=DEADLINE_S)
        result = await run.wait()
        attempts = {e.attempt for e in run.log.snapshot() if getattr(e, "node", None) == "f"}
    finally:
        await executor.aclose()
    assert result.error is not None and "UnknownOpError" in result.error
    assert attempts == {1}


async def test_a_blocking_op_does_not_stall_other_runs(kinds) -> None:
    """Run A's op blocks until run B's op opens the gate: both finish only if B runs while A blocks
    (a plain function run on the shared loop would hold it until A's wait gave up)."""
    gate, entered = threading.Event(), threading.Event()

    @op("test.wait_gate")
    def wait_gate(x: int) -> bool:
        entered.set()
        return gate.wait(DEADLINE_S)

    @op("test.open_gate")
    def open_gate(x: int) -> int:
        gate.set()
        return x

    ops = OpConfig(OpRegistry([wait_gate, open_gate]), allow_module_ops=False)
    executor = Executor(InProcessDispatcher(kinds, build=SharedUnits(kinds, ops=ops)), kinds)
    try:
        a = await executor.submit(one_node(wait_gate, "a"), {"x": 1}, timeout_s=3 * DEADLINE_S)
        assert await asyncio.to_thread(entered.wait, DEADLINE_S), "run A's op never started"
        b = await executor.submit(one_node(open_gate, "b"), {"x": 2}, timeout_s=3 * DEADLINE_S)
        result_b, result_a = await b.wait(), await a.wait()
    finally:
        await executor.aclose()
    assert result_b.outputs == {"y": 2}, result_b.error
    assert result_a.outputs == {"y": True}, result_a.error


async def test_progress_from_a_plain_op_reaches_the_run_in_order(kinds) -> None:
    @op("test.steps")
    def steps(x: int, ctx: NodeContext) -> int:
        assert threading.current_thread() is not threading.main_thread()
        for i in range(3):
            ctx.progress(i / 3, f"step {i}")
        return x

    executor = Executor(InProcessDispatcher(kinds, build=SharedUnits(kinds, ops=OpConfig(OpRegistry([steps]), allow_module_ops=False))),
                        kinds)
    try:
        run = await executor.submit(one_node(steps), {"x": 5}, timeout_s=DEADLINE_S)
        result = await run.wait()
        events = [e for e in run.log.snapshot() if isinstance(e, NodeProgressEvent | NodeOutputEvent)
                  and e.node == "f"]
    finally:
        await executor.aclose()
    assert result.outputs == {"y": 5}, result.error
    assert [e.message if isinstance(e, NodeProgressEvent) else "out" for e in events] == [
        "step 0", "step 1", "step 2", "out"]


@op("test.raise_stop")
def raise_stop(x: int) -> int:
    raise StopIteration(x)


@op("test.raise_value")
def raise_value(x: int) -> int:
    raise ValueError(f"bad {x}")


@pytest.mark.parametrize(("fn", "error"), [
    (raise_value, "ValueError: bad 1"),
    # A future cannot hold a StopIteration: handed on as it was, it left the node waiting forever.
    (raise_stop, "RuntimeError: the function raised StopIteration: 1"),
])
async def test_a_plain_op_that_raises_fails_its_node_with_the_error(kinds, fn, error: str) -> None:
    result = await run_once(OpConfig(OpRegistry([fn]), allow_module_ops=False), kinds, one_node(fn))
    assert result.status == "failed"
    assert result.nodes["f"].error == error


async def test_a_plain_call_given_up_before_a_thread_took_it_never_runs(kinds) -> None:
    """One thread (capacity 1): the second call waits for it; its task cancelled meanwhile, the call
    is dropped from the pool's queue, as `run_in_executor` drops it."""
    entered, release = threading.Event(), threading.Event()
    ran: list[int] = []

    @op("test.hold")
    def hold(x: int) -> int:
        ran.append(x)
        entered.set()
        release.wait(DEADLINE_S)
        return x

    units = SharedUnits(kinds, ops=OpConfig(OpRegistry([hold]), allow_module_ops=False))
    unit = units(RoleSpec(name="py", kind="python", params={"capacity": 1}))
    try:
        calls = [NodeCall("r", f"n{i}", "test.hold", {}, {"x": i}, ("out",), False, False, 1, 1) for i in (1, 2)]
        first = asyncio.create_task(unit.execute(calls[0], NodeContext("r", "n1", 1, 1, lambda f, m: None)))
        assert await asyncio.to_thread(entered.wait, DEADLINE_S), "the first call never started"
        second = asyncio.create_task(unit.execute(calls[1], NodeContext("r", "n2", 1, 1, lambda f, m: None)))
        await asyncio.sleep(0)  # one turn of the loop, not a wait: its first step queues the call
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        release.set()
        assert (await first).outputs == {"out": 1}
        # The pool is first in, first out: had the second call stayed queued, it would run before this one.
        third = NodeCall("r", "n3", "test.hold", {}, {"x": 3}, ("out",), False, False, 1, 1)
        assert (await unit.execute(third, NodeContext("r", "n3", 1, 1, lambda f, m: None))).outputs == {"out": 3}
    finally:
        release.set()
        await unit.close()
    assert ran == [1, 3]


@op("test.export", output_dirs=("folder",))
def export(ctx: NodeContext, x: Any, folder: str = "cwd-out") -> str:
    target = Path(folder) / ctx.run_id
    target.mkdir(parents=True)
    (target / "x.json").write_text(json.dumps(x))
    return str(target)


async def run_owned(kinds: KindRegistry, spec: GraphSpec, users: UsersRoot | None, owner: str | None) -> RunResult:
    ops = OpConfig(OpRegistry([export]), allow_module_ops=True)
    executor = Executor(InProcessDispatcher(kinds, build=SharedUnits(kinds, ops=ops, users=users)), kinds)
    try:
        run = await executor.submit(spec, {"x": [1, 2]}, run_id="r1", timeout_s=DEADLINE_S, owner=owner)
        return await run.wait()
    finally:
        await executor.aclose()


async def test_a_runs_output_folders_resolve_under_the_units_users_root_for_its_owner(kinds, tmp_path) -> None:
    users = UsersRoot(tmp_path / "users")
    by_name = one_node("test.export")
    result = await run_owned(kinds, by_name, users, "7")
    written = tmp_path / "users" / "7" / "outputs" / "r1"  # a declared folder left out: `outputs`
    assert result.outputs == {"y": str(written)}, result.error
    assert json.loads((written / "x.json").read_text()) == [1, 2]

    by_name.nodes[1].params["folder"] = "mine/here"
    result = await run_owned(kinds, by_name, users, "8")
    assert result.outputs == {"y": str(tmp_path / "users" / "8" / "mine" / "here" / "r1")}, result.error

    module_op = one_node("tests.unit.compute.test_python_unit:export")  # the registered op's function
    result = await run_owned(kinds, module_op, UsersRoot(tmp_path / "other"), "7")
    assert result.outputs == {"y": str(tmp_path / "other" / "7" / "outputs" / "r1")}, result.error


@pytest.mark.parametrize(("folder", "why"), [("../8", "climbs out"), ("/tmp", "absolute"),
                                             ("link/x", "'link' is a symbolic link")])
async def test_an_owned_run_cannot_write_outside_its_owners_folder(kinds, tmp_path, folder: str, why: str) -> None:
    (tmp_path / "users" / "7").mkdir(parents=True)
    (tmp_path / "users" / "7" / "link").symlink_to(tmp_path)
    spec = one_node("test.export")
    spec.nodes[1].params["folder"] = folder
    result = await run_owned(kinds, spec, UsersRoot(tmp_path / "users"), "7")
    assert result.status == "failed" and why in (result.error or ""), result.error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["users"]
    assert sorted(p.name for p in (tmp_path / "users").iterdir()) == ["7"]


async def test_owned_runs_need_a_users_root_and_unowned_ones_keep_their_names(kinds, tmp_path, monkeypatch) -> None:
    result = await run_owned(kinds, one_node("test.export"), None, "7")
    assert result.status == "failed" and "this worker has no users root" in (result.error or ""), result.error
    monkeypatch.chdir(tmp_path)  # the command line: names relative to the working directory
    result = await run_owned(kinds, one_node("test.export"), UsersRoot(tmp_path / "users"), None)
    assert result.outputs == {"y": "cwd-out/r1"}, result.error
    assert (tmp_path / "cwd-out" / "r1" / "x.json").is_file() and not (tmp_path / "users").exists()
