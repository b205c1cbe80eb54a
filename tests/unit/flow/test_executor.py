"""The executor: firing, joins, routing, triggers, loops, streams, failures and events.

Graphs are built with the DSL from the functions in `fns`. Where the order of node
completions matters, the functions wait on named gates (`fns.GATES`) that the test
opens after it has seen, in the run's own event stream, the state it needs: no test
depends on timing. Every run has a `timeout_s`, so a broken executor fails a test
instead of hanging it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest

from engine.flow.dispatch import InProcessDispatcher
from engine.flow.dsl import RoleRef, Workflow
from engine.flow.events import (
    HeldBlob,
    NodeOutputEvent,
    NodeProgressEvent,
    NodeState,
    NodeStateEvent,
    RunEvent,
    RunFinished,
    RunStarted,
    RunStatus,
)
from engine.flow.executor import Executor, Run, RunInputError, RunResult
from engine.spec.kinds import KindRegistry, default_kinds
from tests.unit.flow import fns

DEADLINE_S = 10.0
"""Run timeout for every test run: far above what any of them needs."""


@pytest.fixture
def kinds() -> KindRegistry:
    return default_kinds(load_entry_points=False)


@pytest.fixture
async def executor(kinds: KindRegistry):
    ex = Executor(InProcessDispatcher(kinds), kinds)
    yield ex
    await ex.aclose()


@pytest.fixture(autouse=True)
def gates():
    fns.GATES.clear()
    fns.LOG.clear()
    yield fns.GATES
    fns.GATES.clear()
    fns.LOG.clear()


# ------------------------------------------------------------------ helpers
def new_workflow(name: str = "t", **role_options: Any) -> tuple[Workflow, RoleRef]:
    wf = Workflow(name)
    return wf, wf.role("py", **role_options)


async def submit(executor: Executor, wf: Workflow, inputs: dict[str, Any] | None = None, **options: Any) -> Run:
    options.setdefault("timeout_s", DEADLINE_S)
    return await executor.submit(wf.to_spec(), inputs, **options)


async def finish(executor: Executor, wf: Workflow, inputs: dict[str, Any] | None = None,
                 **options: Any) -> tuple[RunResult, list[RunEvent]]:
    run = await submit(executor, wf, inputs, **options)
    result = await run.wait()
    events = run.log.snapshot()
    assert_well_formed(events, run.id)
    return result, events


def assert_well_formed(events: list[RunEvent], run_id: str) -> None:
    """Contiguous seqs from 0, one run_started first, one run_finished last, one run id."""
    assert [e.seq for e in events] == list(range(len(events)))
    assert isinstance(events[0], RunStarted)
    assert isinstance(events[-1], RunFinished)
    assert not any(isinstance(e, RunStarted | RunFinished) for e in events[1:-1])
    assert {e.run_id for e in events} == {run_id}


def trace(events: list[RunEvent]) -> list[tuple[Any, ...]]:
    """Events as comparable tuples, without times and durations."""
    out: list[tuple[Any, ...]] = []
    for e in events:
        if isinstance(e, RunStarted):
            out.append(("run_started", tuple(e.nodes)))
        elif isinstance(e, NodeStateEvent):
            out.append((e.node, str(e.state)))
        elif isinstance(e, NodeOutputEvent):
            out.append((e.node, "output", e.port, e.value) + (() if e.frame is None else (e.frame,)))
        elif isinstance(e, NodeProgressEvent):
            out.append((e.node, "progress", e.progress, e.message))
        else:
            out.append(("run_finished", str(e.status)))
    return out


def node_states(events: list[RunEvent], node: str) -> list[tuple[str, int, int]]:
    """(state, attempt, iteration) of every state event of `node`."""
    return [(str(e.state), e.attempt, e.iteration) for e in events if isinstance(e, NodeStateEvent)
            and e.node == node]


def final_states(result: RunResult) -> dict[str, str]:
    return {nid: str(summary.state) for nid, summary in result.nodes.items()}


async def until(run: Run, match: Callable[[RunEvent], bool]) -> RunEvent:
    """Follow the run's events until one matches (readiness, not sleeping)."""
    async with contextlib.aclosing(run.events()) as events:
        async for event in events:
            if match(event):
                return event
    raise AssertionError("the run finished before the awaited event")


async def opened(gate: str) -> None:
    """Wait for a gate a node function opens (bounded, so a stuck run fails the test)."""
    async with asyncio.timeout(DEADLINE_S):
        await fns.GATES[gate].wait()


def state_is(node: str, state: NodeState) -> Callable[[RunEvent], bool]:
    return lambda e: isinstance(e, NodeStateEvent) and e.node == node and e.state == state


def leftover_tasks() -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


def diamond(gated: bool = False) -> Workflow:
    """n -> square, n -> cube; both -> total.values (join all, square's edge first) -> sum.

    The role has 2 x 64 slots, shared by every run of the spec on one dispatcher."""
    wf, py = new_workflow("diamond", replicas=2)
    n = wf.input("n", default=2)
    if gated:
        sq = wf.python(fns.gated_square, role=py, id="square", params={"gate": "square"})
        cu = wf.python(fns.gated_cube, role=py, id="cube", params={"gate": "cube"})
    else:
        sq = wf.python(fns.square, role=py)
        cu = wf.python(fns.cube, role=py)
    tot = wf.python(fns.collect, role=py, id="total", inputs={"values": {"type": "json", "join": "all"}})
    for branch in (sq, cu):
        wf.edge(n, branch)
        wf.edge(branch, tot)
    wf.output("sum", tot)
    return wf


# ------------------------------------------------------------------ chain
async def test_chain_exact_event_sequence(executor):
    wf, py = new_workflow("chain")
    n = wf.input("n", default=1)
    a = wf.python(fns.inc, role=py)
    b = wf.python(fns.double, role=py)
    wf.edge(n, a)
    wf.edge(a, b)
    wf.output("out", b)

    result, events = await finish(executor, wf, {"n": 4})

    assert result.status == RunStatus.DONE
    assert result.outputs == {"out": 10}
    assert (result.error, result.failed_node) == (None, None)
    assert trace(events) == [
        ("run_started", ("n", "inc", "double", "out")),
        ("n", "done"), ("n", "output", "value", 4),
        ("inc", "queued"), ("inc", "running"), ("inc", "done"), ("inc", "output", "out", 5),
        ("double", "queued"), ("double", "running"), ("double", "done"), ("double", "output", "out", 10),
        ("out", "done"), ("out", "output", "value", 10),
        ("run_finished", "done"),
    ]
    assert node_states(events, "inc") == [("queued", 1, 1), ("running", 1, 1), ("done", 1, 1)]
    assert events[-1].outputs == {"out": 10}
    assert {nid: (str(s.state), s.attempts, s.iterations) for nid, s in result.nodes.items()} == {
        "n": ("done", 0, 1), "inc": ("done", 1, 1), "double": ("done", 1, 1), "out": ("done", 0, 1),
    }


async def test_a_node_launched_by_a_completion_runs_next_in_that_nodes_task(executor):
    """A chain's dispatched nodes that wait (as a remote call or a plain function does) go on in the
    task of the first (no task and no turn of the loop per node); of a fan-out's targets, the first
    does, the others in tasks of their own."""
    wf, py = new_workflow()
    prev = wf.input("n", default=1)
    for name in ("a", "b", "c"):
        node = wf.python(fns.waiting_task_of, role=py, id=name, params={"name": name})
        wf.edge(prev, node)
        prev = node
    fanned = [wf.python(fns.waiting_task_of, role=py, id=name, params={"name": name}) for name in ("d", "e")]
    for node in fanned:
        wf.edge(prev, node)
        wf.output(f"out_{node.id}", node)
    result, events = await finish(executor, wf)
    assert result.status == RunStatus.DONE
    assert result.outputs == {"out_d": 1, "out_e": 1}
    tasks = dict(entry.split(":") for entry in fns.LOG)
    assert list(tasks) == ["a", "b", "c", "d", "e"]
    assert tasks["a"] == tasks["b"] == tasks["c"] == tasks["d"] != tasks["e"]
    assert trace(events)[3:17] == [
        ("a", "queued"), ("a", "running"), ("a", "done"), ("a", "output", "out", 1),
        ("b", "queued"), ("b", "running"), ("b", "done"), ("b", "output", "out", 1),
        ("c", "queued"), ("c", "running"), ("c", "done"), ("c", "output", "out", 1),
        ("d", "queued"), ("e", "queued"),
    ]
    assert leftover_tasks() == set()


async def test_chains_of_nodes_that_never_wait_take_turns_node_by_node(executor):
    """A node that never lets the loop turn does not hand on: the next starts in a task of its own,
    so two runs of such chains interleave node by node, and neither holds the loop for its chain."""
    def chain(run: str) -> Workflow:
        wf, py = new_workflow(run)
        prev = wf.input("n", default=1)
        for i in (1, 2, 3):
            node = wf.python(fns.task_of, role=py, id=f"{run}{i}", params={"name": f"{run}{i}"})
            wf.edge(prev, node)
            prev = node
        wf.output("out", prev)
        return wf

    # A first run builds the role's unit (off the loop: its first node waits for it) for the two after it.
    assert (await (await submit(executor, chain("w"))).wait()).status == RunStatus.DONE
    fns.LOG.clear()
    runs = [await submit(executor, chain(name)) for name in ("a", "b")]
    for run in runs:
        assert (await run.wait()).status == RunStatus.DONE
    assert [entry.split(":")[0] for entry in fns.LOG] == ["a1", "b1", "a2", "b2", "a3", "b3"]


async def test_default_input_is_used(executor):
    wf, py = new_workflow()
    wf.output("out", wf.input("n", default={"k": [1, 2]}))
    result, _ = await finish(executor, wf)
    assert result.outputs == {"out": {"k": [1, 2]}}


async def test_multi_port_outputs_feed_different_targets(executor):
    wf, py = new_workflow()
    n = wf.input("n", default=10)
    sp = wf.python(fns.split, role=py, outputs={"lo": "json", "hi": "json"})
    add = wf.python(fns.add, role=py)
    wf.edge(n, sp)
    wf.edge(sp.out("lo"), add.inp("a"))
    wf.edge(sp.out("hi"), add.inp("b"))
    wf.output("lo", sp.out("lo"))
    wf.output("sum", add)
    result, events = await finish(executor, wf)
    assert result.outputs == {"lo": 9, "sum": 20}
    assert [t for t in trace(events) if t[0] == "split" and t[1] == "output"] == [
        ("split", "output", "lo", 9), ("split", "output", "hi", 11),
    ]


# ------------------------------------------------------------------ diamond / join all
async def test_diamond_joins_all_in_edge_order(executor, gates):
    run = await submit(executor, diamond(gated=True), {"n": 3})
    # Let cube finish first: the join still lists square's value first (edge order).
    await until(run, state_is("square", NodeState.RUNNING))
    gates["cube"].set()
    await until(run, state_is("cube", NodeState.DONE))
    assert run.node_state("square") == NodeState.RUNNING
    assert run.node_state("total") == NodeState.PENDING
    gates["square"].set()
    result = await run.wait()
    assert result.outputs == {"sum": [9, 27]}
    done_order = [e.node for e in run.log.snapshot() if isinstance(e, NodeStateEvent) and e.state == "done"]
    assert done_order == ["n", "cube", "square", "total", "sum"]


async def test_diamond_plain(executor):
    result, events = await finish(executor, diamond(), {"n": 5})
    assert result.outputs == {"sum": [25, 125]}
    assert final_states(result) == dict.fromkeys(("n", "square", "cube", "total", "sum"), "done")
    # total fires once, after both branches.
    assert node_states(events, "total") == [("queued", 1, 1), ("running", 1, 1), ("done", 1, 1)]


async def test_join_all_drops_a_skipped_branch(executor):
    wf, py = new_workflow()
    n = wf.input("n", default=4)
    r = wf.python(fns.route_to, role=py, id="r", params={"to": ["a"]}, routes=["a", "b"])
    a = wf.python(fns.inc, role=py, id="a")
    b = wf.python(fns.double, role=py, id="b")
    t = wf.python(fns.collect, role=py, id="t", inputs={"values": {"type": "json", "join": "all"}})
    wf.edge(n, r)
    for branch in (a, b):
        wf.edge(r, branch)
        wf.edge(branch, t)
    wf.output("out", t)
    result, _ = await finish(executor, wf)
    assert result.outputs == {"out": [5]}
    assert final_states(result)["b"] == "skipped"


# ------------------------------------------------------------------ routers
def routed_chain(to: list[str]) -> Workflow:
    """r routes to `to` among [a, b]; a -> out_a; b -> c -> d -> out_d; `opt` takes a
    required port from a and an optional one from b."""
    wf, py = new_workflow("routed")
    n = wf.input("n", default=1)
    r = wf.python(fns.route_to, role=py, id="r", params={"to": to}, routes=["a", "b"])
    a = wf.python(fns.inc, role=py, id="a")
    b = wf.python(fns.inc, role=py, id="b")
    c = wf.python(fns.inc, role=py, id="c")
    d = wf.python(fns.inc, role=py, id="d")
    opt = wf.python(fns.maybe, role=py, id="opt")
    wf.edge(n, r)
    wf.edge(r, a)
    wf.edge(r, b)
    wf.edge(b, c)
    wf.edge(c, d)
    wf.edge(a, opt.inp("x"))
    wf.edge(b, opt.inp("y"))
    wf.output("out_a", a)
    wf.output("out_d", d)
    wf.output("out_opt", opt)
    return wf


async def test_router_skips_unrouted_successors_down_the_chain(executor):
    result, events = await finish(executor, routed_chain(["a"]), {"n": 1})
    assert result.status == RunStatus.DONE
    # opt ran with its optional port's default (b was skipped).
    assert result.outputs == {"out_a": 2, "out_opt": 102}
    assert final_states(result) == {
        "n": "done", "r": "done", "a": "done", "b": "skipped", "c": "skipped", "d": "skipped",
        "opt": "done", "out_a": "done", "out_d": "skipped", "out_opt": "done",
    }
    # The skip travels down the chain in order; the reason is in the node's summary.
    skipped = [e.node for e in events if isinstance(e, NodeStateEvent) and e.state == "skipped"]
    assert skipped == ["b", "c", "d", "out_d"]
    assert {nid: result.nodes[nid].error for nid in skipped} == dict.fromkeys(
        skipped, "no trigger group can be satisfied")
    assert result.nodes["b"].attempts == 0 and result.nodes["b"].iterations == 0


async def test_router_to_both_and_to_none(executor):
    both, _ = await finish(executor, routed_chain(["a", "b"]), {"n": 1})
    assert both.outputs == {"out_a": 2, "out_d": 4, "out_opt": 4}
    none, _ = await finish(executor, routed_chain([]), {"n": 1})
    assert none.status == RunStatus.DONE
    assert none.outputs == {}
    assert {nid for nid, s in final_states(none).items() if s == "skipped"} == {
        "a", "b", "c", "d", "opt", "out_a", "out_d", "out_opt",
    }


async def test_required_port_from_skipped_node_skips_even_when_trigger_fires(executor):
    wf = routed_chain(["a"])
    wf.python(fns.add, role="py", id="both")
    wf.edge("a", "both.a")
    wf.edge("b", "both.b")
    wf.output("out_both", "both")
    result, _ = await finish(executor, wf)
    assert final_states(result)["both"] == "skipped"
    assert result.nodes["both"].error == "input port 'b' received nothing"
    assert "out_both" not in result.outputs


@pytest.mark.parametrize(("n", "branch", "reply"), [(5, "pos", 6), (-5, "neg", -10)])
async def test_merge_port_gets_whichever_branch_was_routed(executor, n, branch, reply):
    wf, py = new_workflow()
    x = wf.input("x", default=0)
    r = wf.python(fns.route_by_sign, role=py, id="r", routes=["pos", "neg"])
    pos = wf.python(fns.inc, role=py, id="pos")
    neg = wf.python(fns.double, role=py, id="neg")
    merge = wf.python(fns.identity, role=py, id="merge")
    wf.edge(x, r)
    for b in (pos, neg):
        wf.edge(r, b)
        wf.edge(b, merge)  # two edges, one plain port: only the routed branch delivers
    wf.output("reply", merge)
    result, _ = await finish(executor, wf, {"x": n})
    assert result.outputs == {"reply": reply}
    other = "neg" if branch == "pos" else "pos"
    assert (final_states(result)[branch], final_states(result)[other]) == ("done", "skipped")


async def test_router_value_reaches_unroutable_successors(executor):
    wf, py = new_workflow()
    n = wf.input("n", default=7)
    r = wf.python(fns.route_to, role=py, id="r", params={"to": []}, routes=["a"])
    wf.python(fns.inc, role=py, id="a")
    wf.edge(n, r)
    wf.edge(r, "a")
    wf.output("seen", r)  # not among its routes: always delivered
    result, _ = await finish(executor, wf)
    assert result.outputs == {"seen": 7}
    assert final_states(result)["a"] == "skipped"


# ------------------------------------------------------------------ OR-AND triggers
def raced(to_memo: bool = True) -> Workflow:
    """square and cube (gated) OR memo (gated) feed total: trigger [[square, cube], [memo]]."""
    wf, py = new_workflow("raced")
    n = wf.input("n", default=3)
    sq = wf.python(fns.gated_square, role=py, id="square", params={"gate": "square"})
    cu = wf.python(fns.gated_cube, role=py, id="cube", params={"gate": "cube"})
    me = wf.python(fns.gated, role=py, id="memo", params={"gate": "memo"})
    tot = wf.python(fns.collect, role=py, id="total", inputs={"values": {"type": "json", "join": "all"}},
                    trigger=[["square", "cube"], ["memo"]])
    for branch in (sq, cu, me):
        wf.edge(n, branch)
        wf.edge(branch, tot)
    wf.output("out", tot)
    return wf


async def test_or_trigger_fires_on_the_single_member_group(executor, gates):
    run = await submit(executor, raced(), {"n": 3})
    await until(run, state_is("cube", NodeState.RUNNING))
    gates["memo"].set()
    await until(run, state_is("total", NodeState.DONE))
    # square and cube are still running: total did not wait for them.
    assert (run.node_state("square"), run.node_state("cube")) == (NodeState.RUNNING, NodeState.RUNNING)
    gates["square"].set()
    gates["cube"].set()
    result = await run.wait()
    assert result.outputs == {"out": [3]}
    assert result.nodes["total"].iterations == 1
    assert node_states(run.log.snapshot(), "total") == [("queued", 1, 1), ("running", 1, 1), ("done", 1, 1)]
    assert final_states(result) == dict.fromkeys(("n", "square", "cube", "memo", "total", "out"), "done")


async def test_and_group_fires_when_all_members_delivered(executor, gates):
    run = await submit(executor, raced(), {"n": 3})
    await until(run, state_is("memo", NodeState.RUNNING))
    gates["square"].set()
    await until(run, state_is("square", NodeState.DONE))
    assert run.node_state("total") == NodeState.PENDING  # half a group is not enough
    gates["cube"].set()
    await until(run, state_is("total", NodeState.DONE))
    assert run.node_state("memo") == NodeState.RUNNING
    gates["memo"].set()
    result = await run.wait()
    assert result.outputs == {"out": [9, 27]}
    assert result.nodes["total"].iterations == 1


async def test_or_trigger_passes_only_the_firing_groups_values(executor, gates):
    # workflows/diamond.py with n=3: if square finishes, then the memo, then cube, total
    # sums [9, 36] = 45 instead of the memo's 36.
    run = await submit(executor, raced(), {"n": 3})
    await until(run, state_is("memo", NodeState.RUNNING))
    gates["square"].set()
    await until(run, state_is("square", NodeState.DONE))
    gates["memo"].set()
    await until(run, state_is("total", NodeState.DONE))
    gates["cube"].set()
    result = await run.wait()
    assert result.outputs == {"out": [3]}


async def test_group_with_a_skipped_member_fires_with_the_delivered_one(executor):
    wf, py = new_workflow()
    n = wf.input("n", default=1)
    r = wf.python(fns.route_to, role=py, id="r", params={"to": ["a"]}, routes=["a", "b"])
    a = wf.python(fns.inc, role=py, id="a")
    b = wf.python(fns.double, role=py, id="b")
    t = wf.python(fns.collect, role=py, id="t", inputs={"values": {"type": "json", "join": "all"}},
                  trigger=[["a", "b"]])
    wf.edge(n, r)
    for branch in (a, b):
        wf.edge(r, branch)
        wf.edge(branch, t)
    wf.output("out", t)
    result, _ = await finish(executor, wf)
    assert result.outputs == {"out": [2]}
    assert (final_states(result)["b"], final_states(result)["t"]) == ("skipped", "done")


async def test_node_whose_groups_all_die_is_skipped(executor):
    wf = routed_chain([])
    wf.python(fns.collect, role="py", id="t", inputs={"values": {"type": "json", "join": "all"}},
              trigger=[["a"], ["b"]])
    wf.edge("a", "t")
    wf.edge("b", "t")
    result, _ = await finish(executor, wf)
    assert final_states(result)["t"] == "skipped"
    assert result.nodes["t"].error == "no trigger group can be satisfied"


# ------------------------------------------------------------------ bounded loops
def doubling_loop(max_iterations: int = 32, *, bypass: bool = False) -> Workflow:
    """start -> grow <-> check -> finish: double `value` until it reaches `target`.

    With `bypass`, start -> gate, a router that sends the state around the loop
    (gate -> bypass -> bypassed) instead of into it (gate -> grow)."""
    wf, py = new_workflow("loop")
    value = wf.input("value", default=3)
    target = wf.input("target", default=100)
    st = wf.python(fns.loop_start, role=py, id="start")
    gr = wf.python(fns.loop_grow, role=py, id="grow", max_iterations=max_iterations)
    ck = wf.python(fns.loop_check, role=py, id="check", routes=["grow", "finish"])
    fi = wf.python(fns.loop_finish, role=py, id="finish")
    wf.edge(value, st.inp("value"))
    wf.edge(target, st.inp("target"))
    if bypass:
        gate = wf.python(fns.route_to, role=py, id="gate", params={"to": ["bypass"]}, routes=["grow", "bypass"])
        by = wf.python(fns.identity, role=py, id="bypass")
        wf.edge(st, gate)
        wf.edge(gate, gr)
        wf.edge(gate, by)
        wf.output("bypassed", by)
    else:
        wf.edge(st, gr)
    wf.edge(gr, ck)
    wf.edge(ck, gr)
    wf.edge(ck, fi)
    wf.output("result", fi)
    return wf


async def test_bounded_loop_counts_iterations(executor):
    result, events = await finish(executor, doubling_loop())
    assert result.status == RunStatus.DONE
    assert result.outputs == {"result": {"value": 192, "steps": 6}}  # 3 * 2**6 = 192 >= 100
    assert (result.nodes["grow"].iterations, result.nodes["check"].iterations) == (6, 6)
    assert result.nodes["finish"].iterations == 1
    grow_check = [(e.node, e.iteration) for e in events if isinstance(e, NodeStateEvent)
                  and e.state == "done" and e.node in ("grow", "check")]
    assert grow_check == [(nid, i) for i in range(1, 7) for nid in ("grow", "check")]
    assert node_states(events, "grow")[:4] == [("queued", 1, 1), ("running", 1, 1), ("done", 1, 1),
                                               ("queued", 1, 2)]
    grow_values = [(e.iteration, e.value["value"]) for e in events if isinstance(e, NodeOutputEvent)
                   and e.node == "grow"]
    assert grow_values == [(i, 3 * 2**i) for i in range(1, 7)]


def live_and_final_times(events: list[RunEvent], node: str) -> list[tuple[float, float]]:
    """Per attempt of `node`: (its time as a watcher reads it when the attempt ends, `busy_ms` of
    its `running` event plus the time since that event; the `duration_ms` its end reports)."""
    pairs: list[tuple[float, float]] = []
    running: NodeStateEvent | None = None
    for e in events:
        if not isinstance(e, NodeStateEvent) or e.node != node:
            continue
        if e.state == NodeState.RUNNING:
            running = e
        elif e.state.terminal and running is not None:
            assert running.busy_ms is not None and e.duration_ms is not None
            pairs.append((running.busy_ms + (e.time - running.time) * 1e3, e.duration_ms))
            running = None
    return pairs


# Between the executor's clock reading (`perf_counter`) and the event's stamp (`time.time`) it runs
# without awaiting, so live and final times differ by microseconds; 50 ms leaves room for a pause of
# the interpreter (a GC pass on a loaded machine) without hiding an iteration left out (the whole time
# of an earlier iteration, which is what counting from the last `running` event alone lost).
TIME_TOLERANCE_MS = 50.0


@pytest.mark.parametrize("node", ["grow", "flaky"])
async def test_live_times_go_on_from_earlier_iterations_and_attempts_and_end_at_the_final_one(executor, node):
    if node == "grow":
        wf = doubling_loop()
    else:
        wf, py = new_workflow()
        f = wf.python(fns.flaky, role=py, id="flaky", params={"fail_times": 2}, retries=2)
        wf.edge(wf.input("n", default=4), f)
        wf.output("out", f)
    result, events = await finish(executor, wf)
    assert result.status == RunStatus.DONE
    states = [e for e in events if isinstance(e, NodeStateEvent) and e.node == node]
    running = [e.busy_ms for e in states if e.state == NodeState.RUNNING]
    ended = [e.duration_ms for e in states if e.state.terminal]
    assert len(running) == len(ended) == (6 if node == "grow" else 3)
    # Each attempt counts on from where the one before ended, exactly (both read `busy_s`).
    assert running == [0.0, *ended[:-1]]
    assert all(e.busy_ms is None for e in states if e.state != NodeState.RUNNING)
    assert all(e.duration_ms is None for e in states if not e.state.terminal)
    for live, final in live_and_final_times(events, node):
        assert abs(live - final) <= TIME_TOLERANCE_MS, (live, final)
    assert ended[-1] == result.nodes[node].duration_ms


async def test_loop_leaving_on_first_pass(executor):
    result, _ = await finish(executor, doubling_loop(), {"value": 60})
    assert result.outputs == {"result": {"value": 120, "steps": 1}}
    assert (result.nodes["grow"].iterations, result.nodes["check"].iterations) == (1, 1)


async def test_exceeding_max_iterations_fails_the_run(executor):
    result, events = await finish(executor, doubling_loop(max_iterations=3))
    assert result.status == RunStatus.FAILED
    assert result.failed_node == "grow"
    assert result.error == "node 'grow' failed: reached max_iterations=3 without leaving its loop"
    assert result.nodes["grow"].iterations == 3
    assert final_states(result) == {
        "target": "done", "value": "done", "start": "done", "grow": "failed", "check": "done",
        "finish": "cancelled", "result": "cancelled",
    }
    assert events[-1].status == RunStatus.FAILED
    assert events[-1].failed_node == "grow"


async def test_loop_member_never_reached_is_skipped(executor):
    """a -> r -> b -> a, with r routing out of the loop on the first pass: b never runs."""
    wf, py = new_workflow()
    n = wf.input("n", default=1)
    a = wf.python(fns.inc, role=py, id="a", max_iterations=5)
    r = wf.python(fns.route_to, role=py, id="r", params={"to": ["exit"]}, routes=["b", "exit"])
    b = wf.python(fns.inc, role=py, id="b")
    ex = wf.python(fns.identity, role=py, id="exit")
    wf.edge(n, a)
    wf.edge(a, r)
    wf.edge(r, b)
    wf.edge(b, a)
    wf.edge(r, ex)
    wf.output("out", ex)
    result, _ = await finish(executor, wf)
    assert result.outputs == {"out": 2}
    assert final_states(result)["b"] == "skipped"
    assert result.nodes["b"].error == "its loop ended before it was reached"


async def test_loop_never_entered_is_skipped_whole(executor):
    """The router sends the run around the loop: its members end skipped, not stuck."""
    wf = doubling_loop(bypass=True)
    result, _ = await finish(executor, wf)
    assert result.status == RunStatus.DONE
    assert result.outputs == {"bypassed": {"value": 3, "target": 100, "steps": 0}}
    states = final_states(result)
    assert (states["grow"], states["check"], states["finish"], states["result"]) == ("skipped",) * 4
    assert result.nodes["grow"].error == result.nodes["check"].error == "its loop ended before it was reached"
    assert result.nodes["finish"].error == "no trigger group can be satisfied"


async def test_node_outside_a_loop_fires_on_the_first_delivery_from_it(executor):
    """Documented firing rule: a delivery completes a group at once, so an output fed
    from inside a loop takes the first iteration's value (later ones find it done)."""
    wf = doubling_loop()
    wf.output("first_grow", "grow")
    result, _ = await finish(executor, wf)
    assert result.outputs == {"first_grow": {"value": 6, "target": 100, "steps": 1},
                              "result": {"value": 192, "steps": 6}}
    assert result.nodes["first_grow"].iterations == 1


# ------------------------------------------------------------------ streams
async def test_stream_consumer_starts_on_the_first_frame(executor):
    """The producer yields its second frame only after the consumer has started: a
    consumer that waited for the whole stream would deadlock (and the run time out)."""
    wf, py = new_workflow()
    prod = wf.python(fns.handshake_frames, role=py, id="producer", stream=True,
                     params={"first": "a", "second": "b", "gate": "consumer"})
    cons = wf.python(fns.consume_and_open, role=py, id="consumer", params={"gate": "consumer"})
    wf.edge(prod, cons, stream=True)
    wf.output("out", cons)
    result, events = await finish(executor, wf, timeout_s=5)
    assert result.status == RunStatus.DONE, result.error
    assert result.outputs == {"out": ["a", "b"]}
    assert fns.LOG == ["consumer:started", "producer:second"]
    assert [t for t in trace(events) if t[0] in ("producer", "consumer")] == [
        ("producer", "queued"), ("producer", "running"),
        ("producer", "output", "out", "a", 0),
        ("consumer", "queued"), ("consumer", "running"),
        ("producer", "output", "out", "b", 1),
        ("producer", "done"),
        ("consumer", "done"), ("consumer", "output", "out", ["a", "b"]),
    ]


async def test_stream_chain_with_ordered_join(executor):
    wf, py = new_workflow()
    text = wf.input("items", default=["frames", "flow", "on"])
    src = wf.python(fns.frames, role=py, id="src", stream=True)
    up = wf.python(fns.stream_upper, role=py, id="up", inputs={"words": "json"}, stream=True)
    out = wf.python(fns.collect, role=py, id="gather", inputs={"values": {"type": "json", "join": "ordered"}})
    wf.edge(text, src)
    wf.edge(src, up, stream=True)
    wf.edge(up, out)
    wf.output("out", out)
    result, events = await finish(executor, wf)
    assert result.outputs == {"out": ["FRAMES", "FLOW", "ON"]}
    frames = [(e.node, e.frame, e.value) for e in events if isinstance(e, NodeOutputEvent) and e.frame is not None]
    assert [f for f in frames if f[0] == "up"] == [("up", 0, "FRAMES"), ("up", 1, "FLOW"), ("up", 2, "ON")]
    assert [f for f in frames if f[0] == "src"] == [("src", 0, "frames"), ("src", 1, "flow"), ("src", 2, "on")]


async def test_sync_generator_into_blocking_consumer(executor):
    wf, py = new_workflow()
    text = wf.input("items", default=[1, 2, 3])
    src = wf.python(fns.sync_frames, role=py, id="src", stream=True)
    cons = wf.python(fns.consume_blocking, role=py, id="cons")
    wf.edge(text, src)
    wf.edge(src, cons, stream=True)
    wf.output("out", cons)
    result, _ = await finish(executor, wf)
    assert result.outputs == {"out": [1, 2, 3]}


@pytest.mark.parametrize(("join", "expected"), [("ordered", [1, 2, 3, 4]), ("dynamic", [3, 4, 1, 2])])
async def test_ordered_and_dynamic_joins(executor, gates, join, expected):
    """Streams A ([1, 2], first edge) and B ([3, 4]) into one port; B ends first."""
    wf, py = new_workflow()
    a = wf.node("A", "python", role=py, op="tests.unit.flow.fns:gated_frames", stream=True,
                params={"items": [1, 2], "gate": "A"}, outputs={"out": "json"})
    b = wf.node("B", "python", role=py, op="tests.unit.flow.fns:gated_frames", stream=True,
                params={"items": [3, 4], "gate": "B"}, outputs={"out": "json"})
    sink = wf.python(fns.collect, role=py, id="sink", inputs={"values": {"type": "json", "join": join}})
    wf.edge(a, sink)
    wf.edge(b, sink)
    wf.output("out", sink)
    run = await submit(executor, wf)
    await until(run, state_is("A", NodeState.RUNNING))
    gates["B"].set()
    await until(run, state_is("B", NodeState.DONE))
    assert run.node_state("sink") == NodeState.PENDING
    gates["A"].set()
    result = await run.wait()
    assert result.outputs == {"out": expected}


async def test_zero_frame_stream(executor):
    wf, py = new_workflow()
    n = wf.input("n", default=1)
    src = wf.python(fns.no_frames, role=py, id="src", stream=True)
    live = wf.python(fns.consume_all, role=py, id="live")
    gathered = wf.python(fns.collect, role=py, id="gathered", inputs={"values": {"type": "json", "join": "ordered"}})
    wf.edge(n, src)
    wf.edge(src, live, stream=True)
    wf.edge(src, gathered)
    wf.output("live_out", live)
    wf.output("gathered_out", gathered)
    result, events = await finish(executor, wf)
    assert result.status == RunStatus.DONE
    assert result.outputs == {"live_out": [], "gathered_out": []}
    assert not [e for e in events if isinstance(e, NodeOutputEvent) and e.node == "src"]


async def test_stream_frames_over_several_ports(executor):
    wf, py = new_workflow()
    n = wf.input("n", default=1)
    src = wf.python(fns.port_frames, role=py, id="src", stream=True, outputs={"a": "json", "b": "json"})
    on_a = wf.python(fns.collect, role=py, id="on_a", inputs={"values": {"type": "json", "join": "ordered"}})
    on_b = wf.python(fns.consume_all, role=py, id="on_b")
    wf.edge(n, src)
    wf.edge(src.out("a"), on_a)
    wf.edge(src.out("b"), on_b, stream=True)
    wf.output("a", on_a)
    wf.output("b", on_b)
    result, events = await finish(executor, wf)
    assert result.outputs == {"a": [1, 3], "b": [2]}
    assert [(e.port, e.frame, e.value) for e in events if isinstance(e, NodeOutputEvent) and e.node == "src"] == [
        ("a", 0, 1), ("b", 1, 2), ("a", 2, 3),
    ]


# ------------------------------------------------------------------ many runs
async def test_fifty_concurrent_runs_are_correct_and_independent(executor, gates):
    spec = diamond(gated=True).to_spec()
    plan = executor.plan(spec)
    runs = [await executor.submit(plan, {"n": n}, run_id=f"run-{n}", timeout_s=DEADLINE_S) for n in range(50)]
    # Every run has square running at once before any of them may finish.
    for run in runs:
        await until(run, state_is("square", NodeState.RUNNING))
    assert all(not run.done for run in runs)
    gates["cube"].set()
    gates["square"].set()
    results = await asyncio.gather(*(run.wait() for run in runs))
    for n, (run, result) in enumerate(zip(runs, results, strict=True)):
        assert result.run_id == run.id == f"run-{n}"
        assert result.status == RunStatus.DONE
        assert result.outputs == {"sum": [n * n, n * n * n]}
        assert_well_formed(run.log.snapshot(), run.id)
        assert len(run.log) == len(runs[0].log)
    assert executor.get("run-7") is runs[7]


async def test_run_ids_are_unique_and_finished_runs_can_be_forgotten(executor):
    wf = diamond()
    run = await submit(executor, wf, run_id="once")
    with pytest.raises(ValueError, match="'once' is already in use"):
        await submit(executor, wf, run_id="once")
    await run.wait()
    executor.forget("once")
    with pytest.raises(KeyError):
        executor.get("once")


async def test_forgetting_an_unfinished_run_keeps_it(executor, gates):
    run = await submit(executor, diamond(gated=True), run_id="busy")
    executor.forget("busy")
    assert executor.get("busy") is run
    gates["square"].set()
    gates["cube"].set()
    await run.wait()
    executor.forget("busy")
    with pytest.raises(KeyError):
        executor.get("once")


# ------------------------------------------------------------------ events
@pytest.mark.parametrize("fn", [fns.inc, fns.boom, fns.hang])
async def test_a_forgotten_run_is_freed_at_once_not_by_the_cycle_collector(executor, gates, fn):
    """A finished run holds no reference cycle (its nodes, events and tasks with it): dropped, it is
    freed then, not left for the collector, whose passes would grow with the runs it finds."""
    wf, py = new_workflow()
    first = wf.python(fns.inc, role=py, id="first")
    last = wf.python(fn, role=py, id="last", params={"name": "last"} if fn is fns.hang else {})
    wf.edge(wf.input("n", default=1), first)
    wf.edge(first, last)
    wf.output("out", last)
    gc.collect()
    gc.disable()
    try:
        run = await submit(executor, wf)
        if fn is fns.hang:
            await opened("started:last")
            await run.cancel()
        result = await run.wait()
        assert result.status == {fns.inc: "done", fns.boom: "failed", fns.hang: "cancelled"}[fn]
        # Freed when its last reference goes: here, or in the pool thread that ran `boom`, which lets
        # go of the failure a moment after the run has it.
        freed = asyncio.Event()
        weakref.finalize(run, asyncio.get_running_loop().call_soon_threadsafe, freed.set)
        executor.forget(run.id)
        del run
        async with asyncio.timeout(DEADLINE_S):
            await freed.wait()
    finally:
        gc.enable()


async def test_events_since_replays_exactly_from_any_seq(executor):
    run = await submit(executor, diamond(), {"n": 2})
    await run.wait()
    log = run.log.snapshot()
    for k in range(len(log) + 1):
        replay = [e async for e in run.events(since=k)]
        assert replay == log[k:]


async def test_resume_while_running_loses_and_repeats_nothing(executor, gates):
    run = await submit(executor, diamond(gated=True), {"n": 2})
    seen: list[RunEvent] = []
    async with contextlib.aclosing(run.events()) as stream:
        async for event in stream:
            seen.append(event)
            if isinstance(event, NodeStateEvent) and event.node == "cube" and event.state == "running":
                break
    assert not run.done
    async with contextlib.aclosing(run.events(since=seen[-1].seq + 1)) as rest:
        gates["square"].set()
        gates["cube"].set()
        tail = [e async for e in rest]
    everything = seen + tail
    assert everything == run.log.snapshot()
    assert [e.seq for e in everything] == list(range(len(everything)))
    assert isinstance(tail[-1], RunFinished)


async def test_two_readers_see_the_same_events(executor, gates):
    run = await submit(executor, diamond(gated=True))

    async def read() -> list[RunEvent]:
        return [e async for e in run.events()]

    readers = asyncio.gather(read(), read())
    await until(run, state_is("cube", NodeState.RUNNING))
    gates["square"].set()
    gates["cube"].set()
    first, second = await readers
    assert first == second == run.log.snapshot()


async def test_progress_event(executor):
    wf, py = new_workflow()
    n = wf.input("n", default=1)
    p = wf.python(fns.with_progress, role=py, id="p")
    wf.edge(n, p)
    wf.output("out", p)
    result, events = await finish(executor, wf)
    assert result.outputs == {"out": 1}
    assert [t for t in trace(events) if t[0] == "p"] == [
        ("p", "queued"), ("p", "running"), ("p", "progress", 0.5, "half"), ("p", "done"), ("p", "output", "out", 1),
    ]


# ------------------------------------------------------------------ failures
async def test_failing_node_fails_the_run_and_cancels_the_others(executor, gates):
    wf, py = new_workflow()
    n = wf.input("n", default=3)
    bad = wf.python(fns.gated_boom, role=py, id="bad", params={"gate": "boom"})
    slow = wf.python(fns.hang, role=py, id="slow", params={"name": "slow"})
    t = wf.python(fns.add, role=py, id="t")
    wf.edge(n, bad)
    wf.edge(n, slow)
    wf.edge(bad, t.inp("a"))
    wf.edge(slow, t.inp("b"))
    wf.output("out", t)
    run = await submit(executor, wf)
    await opened("started:slow")
    gates["boom"].set()
    result = await run.wait()
    assert leftover_tasks() == set()
    assert result.status == RunStatus.FAILED
    assert result.failed_node == "bad"
    assert result.error == "node 'bad' failed: ValueError: boom on 3"
    assert result.nodes["bad"].error == "ValueError: boom on 3"
    assert final_states(result) == {"n": "done", "bad": "failed", "slow": "cancelled", "t": "cancelled",
                                    "out": "cancelled"}
    assert fns.LOG == ["slow:started", "slow:cancelled"]
    finished = run.log.snapshot()[-1]
    assert (finished.status, finished.error, finished.failed_node) == (RunStatus.FAILED, result.error, "bad")
    failed = [e for e in run.log.snapshot() if isinstance(e, NodeStateEvent) and e.state == "failed"]
    assert [(e.node, e.error) for e in failed] == [("bad", "ValueError: boom on 3")]


@pytest.mark.parametrize(("retries", "status", "attempts"), [(2, RunStatus.DONE, 3), (1, RunStatus.FAILED, 2)])
async def test_retries(executor, retries, status, attempts):
    wf, py = new_workflow()
    n = wf.input("n", default=4)
    f = wf.python(fns.flaky, role=py, id="flaky", params={"fail_times": 2}, retries=retries)
    wf.edge(n, f)
    wf.output("out", f)
    result, events = await finish(executor, wf)
    assert result.status == status
    assert result.nodes["flaky"].attempts == attempts
    assert fns.LOG == [f"flaky:attempt{i}" for i in range(1, attempts + 1)]
    expected = []
    for attempt in range(1, attempts + 1):
        expected += [("queued", attempt, 1), ("running", attempt, 1)]
        expected.append(("done" if attempt == 3 else "failed", attempt, 1))
    assert node_states(events, "flaky") == expected
    errors = [e.error for e in events if isinstance(e, NodeStateEvent) and e.node == "flaky" and e.state == "failed"]
    assert errors == [f"RuntimeError: attempt {i} failed" for i in range(1, min(attempts, 2) + 1)]
    if status == RunStatus.DONE:
        assert result.outputs == {"out": 43}
        assert result.nodes["flaky"].error is None
    else:
        assert result.error == "node 'flaky' failed: RuntimeError: attempt 2 failed"
        assert result.failed_node == "flaky"


async def test_run_timeout(executor, gates):
    wf, py = new_workflow()
    n = wf.input("n", default=1)
    slow = wf.python(fns.hang, role=py, id="slow", params={"name": "slow"})
    wf.edge(n, slow)
    wf.output("out", slow)
    result, events = await finish(executor, wf, timeout_s=0.05)
    assert result.status == RunStatus.FAILED
    assert result.error == "run timed out after 0.05 s"
    assert result.failed_node is None
    assert final_states(result) == {"n": "done", "slow": "cancelled", "out": "cancelled"}
    assert fns.LOG == ["slow:started", "slow:cancelled"]
    assert leftover_tasks() == set()


async def test_node_timeout(executor):
    wf, py = new_workflow()
    n = wf.input("n", default=1)
    slow = wf.python(fns.hang, role=py, id="slow", params={"name": "slow"}, timeout_s=0.05, retries=1)
    wf.edge(n, slow)
    wf.output("out", slow)
    result, events = await finish(executor, wf)
    assert result.status == RunStatus.FAILED
    assert result.failed_node == "slow"
    assert result.error == "node 'slow' failed: timed out after 0.05 s"
    assert result.nodes["slow"].attempts == 2
    assert fns.LOG == ["slow:started", "slow:cancelled"] * 2
    assert node_states(events, "slow") == [("queued", 1, 1), ("running", 1, 1), ("failed", 1, 1),
                                           ("queued", 2, 1), ("running", 2, 1), ("failed", 2, 1)]


async def test_cancel_a_running_run(executor, gates):
    wf, py = new_workflow()
    n = wf.input("n", default=1)
    slow = wf.python(fns.hang, role=py, id="slow", params={"name": "slow"})
    after = wf.python(fns.inc, role=py, id="after")
    wf.edge(n, slow)
    wf.edge(slow, after)
    wf.output("out", after)
    run = await submit(executor, wf)
    await opened("started:slow")
    await run.cancel()
    result = await run.wait()
    assert result.status == RunStatus.CANCELLED
    assert result.error == "cancelled by request"
    assert final_states(result) == {"n": "done", "slow": "cancelled", "after": "cancelled", "out": "cancelled"}
    assert fns.LOG == ["slow:started", "slow:cancelled"]
    assert leftover_tasks() == set()
    assert trace(run.log.snapshot())[-4:] == [
        ("slow", "cancelled"), ("after", "cancelled"), ("out", "cancelled"), ("run_finished", "cancelled"),
    ]
    # Cancelling again, or through the executor, changes nothing.
    await executor.cancel(run.id)
    assert (await run.wait()).status == RunStatus.CANCELLED


async def test_cancel_a_run_whose_running_node_was_handed_on_by_a_completion(executor, gates):
    """`slow` runs in the task of `first`, which launched it: cancelling the run cancels it there."""
    wf, py = new_workflow()
    first = wf.python(fns.inc, role=py, id="first")
    slow = wf.python(fns.hang, role=py, id="slow", params={"name": "slow"})
    wf.edge(wf.input("n", default=1), first)
    wf.edge(first, slow)
    wf.output("out", slow)
    run = await submit(executor, wf)
    await opened("started:slow")
    await run.cancel()
    result = await run.wait()
    assert result.status == RunStatus.CANCELLED
    assert final_states(result) == {"n": "done", "first": "done", "slow": "cancelled", "out": "cancelled"}
    assert fns.LOG == ["slow:started", "slow:cancelled"]
    assert leftover_tasks() == set()


async def test_cancel_before_anything_ran(executor):
    run = await submit(executor, diamond())
    await run.cancel()
    result = await run.wait()
    assert result.status == RunStatus.CANCELLED
    assert set(final_states(result).values()) == {"cancelled"}
    assert trace(run.log.snapshot()) == [("run_started", ("n", "cube", "square", "total", "sum"))] + [
        (nid, "cancelled") for nid in ("n", "cube", "square", "total", "sum")
    ] + [("run_finished", "cancelled")]


async def test_cancel_after_done_is_a_no_op(executor):
    run = await submit(executor, diamond())
    before = await run.wait()
    await run.cancel()
    assert (await run.wait()) is before
    assert before.status == RunStatus.DONE


async def test_aclose_cancels_unfinished_runs(kinds, gates):
    ex = Executor(InProcessDispatcher(kinds), kinds)
    wf, py = new_workflow()
    wf.edge(wf.input("n", default=1), wf.python(fns.hang, role=py, id="slow", params={"name": "slow"}))
    run = await ex.submit(wf.to_spec(), timeout_s=DEADLINE_S)
    await opened("started:slow")
    await ex.aclose()
    assert run.done
    assert (await run.wait()).status == RunStatus.CANCELLED
    assert fns.LOG == ["slow:started", "slow:cancelled"]
    assert leftover_tasks() == set()


async def test_input_errors_name_every_problem(executor):
    wf, py = new_workflow()
    a = wf.input("a")
    b = wf.input("b", default=2)
    wf.edge(a, wf.python(fns.inc, role=py, id="ia"))
    wf.edge(b, wf.python(fns.inc, role=py, id="ib"))
    spec = wf.to_spec()
    takes = list(executor.plan(spec).input_nodes)
    assert sorted(takes) == ["a", "b"]
    with pytest.raises(RunInputError) as caught:
        await executor.submit(spec, {"bogus": 1, "other": 2})
    assert str(caught.value) == (f"unknown inputs ['bogus', 'other'] (the workflow takes {takes});"
                                 " input 'a' has no value and no default")
    with pytest.raises(RunInputError, match=r"^input 'a' has no value and no default$"):
        await executor.submit(spec, {"b": 5})
    with pytest.raises(RunInputError) as caught:
        await executor.submit(spec, {"a": 1, "c": 3})
    assert str(caught.value) == f"unknown input ['c'] (the workflow takes {takes})"


async def test_text_and_token_inputs_take_only_their_kind_naming_the_input(executor):
    wf, _ = new_workflow()
    text = wf.input("text", type="text")
    ids = wf.input("ids", type="tokens", default=[1, 2])
    wf.output("said", text)
    wf.output("ids_out", ids)
    spec = wf.to_spec()
    for given, problem in (({"text": 42}, "input 'text' is text: give it a string, not a number"),
                           ({"text": ["a"]}, "input 'text' is text: give it a string, not a list"),
                           ({"text": "ok", "ids": "1 2"}, "input 'ids' takes tokens: give it a list of token ids"
                            " (whole numbers), not a string"),
                           ({"text": "ok", "ids": [1, 2.5]}, "not a list holding other things than whole numbers"),
                           ({"text": "ok", "ids": [True]}, "not a list holding other things")):
        with pytest.raises(RunInputError) as caught:
            await executor.submit(spec, given)
        assert problem in str(caught.value), (given, str(caught.value))


async def one_node_failure(executor: Executor, fn: Callable[..., Any], **options: Any) -> RunResult:
    wf, py = new_workflow()
    n = wf.input("n", default=5)
    node = wf.python(fn, role=py, id="x", **options)
    wf.edge(n, node)
    result, _ = await finish(executor, wf)
    assert result.status == RunStatus.FAILED
    assert result.failed_node == "x"
    assert result.nodes["x"].state == NodeState.FAILED
    return result


async def test_wrong_keys_for_multi_port_outputs(executor):
    result = await one_node_failure(executor, fns.wrong_keys, outputs={"lo": "json", "hi": "json"})
    assert result.error == ("node 'x' failed: NodeOutputError: node 'x' returned keys ['bogus', 'lo'];"
                            " expected ['lo', 'hi'] (missing ['hi']) (unknown ['bogus'])")


async def test_router_choosing_a_target_outside_its_routes(executor):
    wf, py = new_workflow()
    n = wf.input("n", default=1)
    r = wf.python(fns.route_to, role=py, id="r", params={"to": ["a", "elsewhere"]}, routes=["a", "b"])
    wf.edge(n, r)
    wf.edge(r, wf.python(fns.inc, role=py, id="a"))
    wf.edge(r, wf.python(fns.inc, role=py, id="b"))
    result, _ = await finish(executor, wf)
    assert result.status == RunStatus.FAILED
    assert result.failed_node == "r"
    assert result.error == "node 'r' failed: chose ['elsewhere'], which are not among its routes ['a', 'b']"
    assert final_states(result) == {"n": "done", "r": "failed", "a": "cancelled", "b": "cancelled"}


async def test_non_router_returning_a_route(executor):
    result = await one_node_failure(executor, fns.route_fake)
    assert result.error == "node 'x' failed: OperationError: node 'x' returned a Route but declares no routes"


async def test_router_returning_a_plain_value(executor):
    wf, py = new_workflow()
    n = wf.input("n", default=1)
    r = wf.python(fns.not_a_route, role=py, id="r", routes=["a"])
    wf.edge(n, r)
    wf.edge(r, wf.python(fns.inc, role=py, id="a"))
    result, _ = await finish(executor, wf)
    assert result.failed_node == "r"
    assert result.error == "node 'r' failed: OperationError: router node 'r' must return Route(to=..., value=...)"


async def test_unimportable_op_fails_the_node(executor):
    wf, py = new_workflow()
    n = wf.input("n", default=1)
    wf.edge(n, wf.node("x", "python", role=py, op="tests.unit.flow.fns:missing", inputs={"x": "json"}))
    result, _ = await finish(executor, wf)
    assert result.failed_node == "x"
    assert result.error == ("node 'x' failed: OperationError: operation 'tests.unit.flow.fns:missing': module"
                            " 'tests.unit.flow.fns' has no 'missing'")


async def test_two_values_on_a_port_without_join(executor):
    wf, py = new_workflow()
    n = wf.input("n", default=1)
    a = wf.python(fns.inc, role=py, id="a")
    b = wf.python(fns.double, role=py, id="b")
    sink = wf.python(fns.identity, role=py, id="sink")
    for branch in (a, b):
        wf.edge(n, branch)
        wf.edge(branch, sink)
    wf.output("out", sink)
    result, _ = await finish(executor, wf)
    assert result.status == RunStatus.FAILED
    assert result.failed_node == "sink"
    assert result.error == ("node 'sink' failed: input port 'x' received 2 values (from a, b); declare a join"
                            " on it")
    assert result.nodes["sink"].attempts == 0


async def test_node_raising_cancelled_error_itself_fails_promptly(executor):
    wf, py = new_workflow()
    n = wf.input("n", default=1)
    wf.edge(n, wf.python(fns.self_cancel, role=py, id="x"))
    # Without a run timeout this run would never finish; with one it fails only at the deadline.
    result, _ = await finish(executor, wf, timeout_s=0.2)
    assert (result.status, result.failed_node) == (RunStatus.FAILED, "x")


async def test_failing_stream_producer_fails_the_run(executor):
    wf, py = new_workflow()
    n = wf.input("n", default=1)
    src = wf.python(fns.boom, role=py, id="src", stream=True)
    cons = wf.python(fns.consume_all, role=py, id="cons")
    wf.edge(n, src)
    wf.edge(src, cons, stream=True)
    result, _ = await finish(executor, wf)
    assert result.failed_node == "src"
    assert result.error == ("node 'src' failed: OperationError: streaming node 'src':"
                            " tests.unit.flow.fns:boom must be a generator function")
    assert final_states(result)["cons"] == "cancelled"


# ------------------------------------------------------------------ capacity
async def test_role_capacity_queues_the_rest(executor, gates):
    wf, py = new_workflow(params={"capacity": 1})
    n = wf.input("n", default=1)
    first = wf.python(fns.gated, role=py, id="first", params={"gate": "first"})
    second = wf.python(fns.gated, role=py, id="second", params={"gate": "second"})
    wf.edge(n, first)
    wf.edge(n, second)
    run = await submit(executor, wf)
    await opened("started:first")
    assert (run.node_state("first"), run.node_state("second")) == (NodeState.RUNNING, NodeState.QUEUED)
    gates["second"].set()
    gates["first"].set()
    result = await run.wait()
    assert result.status == RunStatus.DONE
    assert fns.LOG == ["started:first", "started:second"]



async def test_a_text_output_of_a_stream_reads_as_text_and_other_joins_stay_lists(executor):
    wf, py = new_workflow()
    words = wf.input("items", default=["Hel", "lo", "!"])
    src = wf.python(fns.frames, role=py, id="src", stream=True, outputs={"out": "text"})
    wf.edge(words, src)
    text = wf.node("text", "output", inputs={"value": {"type": "text", "join": "ordered"}})
    listed = wf.node("listed", "output", inputs={"value": {"type": "any", "join": "ordered"}})
    wf.edge(src, text.inp("value"))
    wf.edge(src, listed.inp("value"))
    result, events = await finish(executor, wf)
    assert result.outputs == {"text": "Hello!", "listed": ["Hel", "lo", "!"]}
    final = [e for e in events if isinstance(e, NodeOutputEvent) and e.node == "text"]
    assert [e.value for e in final] == ["Hello!"]


async def test_byte_blobs_are_kept_for_take_blobs_only_when_asked(executor):
    wf, py = new_workflow()
    x = wf.input("x", "text", default="abc")
    blob = wf.python(fns.to_bytes, role=py, id="blob")
    last = wf.python(fns.to_bytes, role=py, id="tail")
    same = wf.python(fns.identity, role=py, id="same", inputs={"x": "any"})
    wf.edge(x, blob)
    wf.edge(blob, same)
    wf.edge(x, last)
    wf.output("out", same)
    wf.output("last", last)
    kept = await submit(executor, wf, keep_blobs=8)
    plain = await submit(executor, wf)
    await kept.wait()
    await plain.wait()
    [event] = [e for e in kept.log.snapshot() if isinstance(e, NodeOutputEvent) and e.node == "blob"]
    assert event.value == {"bytes": 3}
    assert kept.take_blobs(event.seq) == [HeldBlob((), b"abc")] and kept.take_blobs(event.seq) == []  # taken once
    # Not the input's value, nor what only output nodes take (`tail`'s, `same`'s): the run's outputs.
    assert all(kept.take_blobs(e.seq) == [] for e in kept.log.snapshot())
    assert all(plain.take_blobs(e.seq) == [] for e in plain.log.snapshot())


def blob_streams() -> Workflow:
    """x -> `album` (blobs in a list and a dict, fns.blob_album) and x -> `film` (a blob frame per
    item, fns.byte_frames); neither feeds an output."""
    wf, py = new_workflow()
    x = wf.input("x", "json", default=["a", "b", "c"])
    wf.edge(x, wf.python(fns.blob_album, role=py, id="album"))
    wf.edge(x, wf.python(fns.byte_frames, role=py, id="film", stream=True, outputs={"out": "any"}))
    wf.output("out", wf.input("y", "json", default=1))
    return wf


async def test_blobs_in_lists_dicts_and_streamed_frames_are_kept_at_their_places(executor):
    result, events = await finish(executor, blob_streams(), keep_blobs=100)
    assert result.status == RunStatus.DONE
    run = executor.get(result.run_id)
    [album] = [e for e in events if isinstance(e, NodeOutputEvent) and e.node == "album"]
    assert album.value["list"] == [{"bytes": 1}, {"bytes": 1}] and album.value["nested"] == {"k": {"bytes": 1}}
    assert album.value["n"] == 3 and len(album.value["many"]) == 65  # too long to open: previewed whole
    assert run.take_blobs(album.seq) == [HeldBlob(("list", 0), b"a"), HeldBlob(("list", 1), b"b"),
                                         HeldBlob(("nested", "k"), b"c")]
    film = [e for e in events if isinstance(e, NodeOutputEvent) and e.node == "film"]
    assert [(e.frame, e.value) for e in film] == [(0, {"bytes": 1}), (1, {"bytes": 1}), (2, {"bytes": 1})]
    assert [run.take_blobs(e.seq) for e in film] == [[HeldBlob((), item)] for item in (b"a", b"b", b"c")]


async def test_a_run_keeps_no_more_blobs_than_asked(executor):
    result, events = await finish(executor, blob_streams(), keep_blobs=2)
    run = executor.get(result.run_id)
    held = [blob for e in events for blob in run.take_blobs(e.seq)]
    assert len(held) == 2  # of 6: whichever node came first, and its first ones
