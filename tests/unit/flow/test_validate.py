"""GraphSpec validation: every problem reported at once, each naming what it is about.

Each test starts from a small valid graph built with the DSL and breaks one thing
(the DSL itself refuses some mistakes, such as a duplicate id, so those are made by
editing the built spec), then asserts the exact issues `check_spec` returns.
"""

from __future__ import annotations

import json

import pytest
from msgspec.structs import replace

from engine.flow.balance import POLICY_NAMES
from engine.flow.dsl import Workflow
from engine.flow.plan import build_plan
from engine.flow.validate import GraphValidationError, Issue, check_spec, parse_spec, validate
from engine.spec.graph import EdgeSpec, GraphSpec, NodeSpec, PortSpec, RoleSpec, encode_spec, spec_to_dict
from engine.spec.kinds import KindRegistry, NodeKind, RoleKind, RoleModels, default_kinds
from tests.unit.flow import fns

OP = "tests.unit.flow.fns:identity"


@pytest.fixture
def kinds() -> KindRegistry:
    registry = default_kinds(load_entry_points=False)
    # A second role kind, so that a python node can be put on a role it cannot run on
    # (validation never imports a runner).
    registry.add_role_kind(RoleKind(name="llm", description="test-only", runner="tests.unit.flow.fns:no_such_unit"))
    return registry


# ------------------------------------------------------------------ factories
def chain() -> Workflow:
    """n -> inc -> out: the valid base most tests break."""
    wf = Workflow("chain")
    py = wf.role("py")
    n = wf.input("n", "json", default=1)
    inc = wf.python(fns.inc, role=py)
    wf.edge(n, inc)
    wf.output("out", inc)
    return wf


def fn_node(wf: Workflow, node_id: str, *, inputs=None, outputs=None, role: str = "py", **options):
    """A python node with explicit ports (default: `x` in, `out` out, both json)."""
    return wf.node(node_id, "python", role=role, op=OP, inputs={"x": "json"} if inputs is None else inputs,
                   outputs={"out": "json"} if outputs is None else outputs, **options)


def with_nodes(spec: GraphSpec, *nodes: NodeSpec) -> GraphSpec:
    return replace(spec, nodes=[*spec.nodes, *nodes])


def with_edges(spec: GraphSpec, *edges: EdgeSpec) -> GraphSpec:
    return replace(spec, edges=[*spec.edges, *edges])


def with_roles(spec: GraphSpec, *roles: RoleSpec) -> GraphSpec:
    return replace(spec, roles=[*spec.roles, *roles])


def codes(issues: list[Issue]) -> list[str]:
    return [i.code for i in issues]


# ------------------------------------------------------------------ valid graphs
def test_valid_chain_has_no_issues_and_plans(kinds):
    spec = chain().to_spec()
    assert check_spec(spec, kinds) == []
    validate(spec, kinds)
    plan = build_plan(spec, kinds)
    assert plan.order == ("n", "inc", "out")
    assert plan.input_nodes == ("n",)
    assert plan.output_nodes == ("out",)
    assert plan.triggers == {"n": (), "inc": (frozenset({"n"}),), "out": (frozenset({"inc"}),)}


def test_empty_workflow():
    spec = GraphSpec(version=1, name="empty", roles=[], nodes=[], edges=[])
    assert check_spec(spec, default_kinds()) == [Issue("empty", "the workflow has no nodes")]


# ------------------------------------------------------------------ ids, roles and kinds
def test_duplicate_node_id(kinds):
    spec = chain().to_spec()
    spec = with_nodes(spec, spec.node("inc"))
    assert check_spec(spec, kinds) == [Issue("duplicate_id", "node id 'inc' is used twice", node="inc")]


def test_duplicate_role(kinds):
    spec = with_roles(chain().to_spec(), RoleSpec(name="py", kind="python"))
    assert check_spec(spec, kinds) == [Issue("duplicate_id", "role 'py' is declared twice", role="py")]


def test_unknown_role(kinds):
    wf = chain()
    fn_node(wf, "orphan", role="nope")
    wf.edge("n", "orphan")
    assert check_spec(wf.to_spec(), kinds) == [
        Issue("unknown_role", "node 'orphan' names unknown role 'nope'", node="orphan", role="nope"),
    ]


def test_missing_role(kinds):
    wf = chain()
    wf.node("norole", "python", op=OP, inputs={"x": "json"}, outputs={"out": "json"})
    wf.edge("n", "norole")
    assert check_spec(wf.to_spec(), kinds) == [
        Issue("missing_role", "node 'norole' of kind 'python' needs a role", node="norole"),
    ]


def test_unknown_node_kind(kinds):
    wf = chain()
    wf.node("weird", "teleport", inputs={"x": "json"})
    wf.edge("n", "weird")
    assert check_spec(wf.to_spec(), kinds) == [
        Issue("unknown_kind", "node 'weird' has unknown kind 'teleport'", node="weird"),
    ]


def test_unknown_role_kind(kinds):
    wf = chain()
    wf.role("gpu", kind="quantum")
    assert check_spec(wf.to_spec(), kinds) == [
        Issue("unknown_role_kind", "role 'gpu' has unknown kind 'quantum' (known: python, llm)", role="gpu"),
    ]


def test_unknown_balance_policy(kinds):
    wf = chain()
    wf.role("fast", balance="fastest")
    issues = check_spec(wf.to_spec(), kinds)
    assert codes(issues) == ["unknown_policy"]
    assert issues[0].role == "fast"
    assert "'fastest'" in issues[0].message
    # The message lists the valid choices.
    assert all(name in issues[0].message for name in POLICY_NAMES)


def test_resources_are_read_and_every_bad_field_named(kinds):
    wf = chain()
    wf.role("gpu", resources={"gpus": 1, "cpus": 2, "memory_gb": 4.5, "labels": {"kind": "gpu"}, "colocate": "w"})
    assert check_spec(wf.to_spec(), kinds) == []
    wf.role("bad", resources={"gpus": -1, "labels": {"zone": 7}, "disks": 2})
    issues = check_spec(wf.to_spec(), kinds)
    assert [(i.code, i.role, i.path) for i in issues] == [
        ("bad_resources", "bad", "resources.disks"), ("bad_resources", "bad", "resources.gpus"),
        ("bad_resources", "bad", "resources.labels.zone")]
    assert issues[1].message == "role 'bad': resources.gpus: must be between 0 and 1024, not -1"


def test_a_colocate_group_asking_for_two_values_of_a_label_is_refused(kinds):
    wf = chain()
    wf.role("lm", resources={"labels": {"zone": "a"}, "colocate": "w"})
    wf.role("dit", resources={"labels": {"zone": "b"}, "colocate": "w"})
    (issue,) = check_spec(wf.to_spec(), kinds)
    assert (issue.code, issue.role) == ("colocate_conflict", "dit")
    assert "asks for label zone=b and 'lm' for zone=a" in issue.message


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_known_policy_is_accepted(kinds, policy):
    wf = chain()
    wf.role("other", balance=policy)
    assert check_spec(wf.to_spec(), kinds) == []


def test_node_kind_role_kind_mismatch(kinds):
    wf = chain()
    wf.role("big", kind="llm")
    fn_node(wf, "misplaced", role="big")
    wf.edge("n", "misplaced")
    assert check_spec(wf.to_spec(), kinds) == [
        Issue("role_kind_mismatch", "node 'misplaced' of kind 'python' cannot run on role 'big' of kind 'llm'"
              " (needs python)", node="misplaced", role="big"),
    ]


def model_kinds() -> KindRegistry:
    """The test kinds plus `lm`, whose roles need a model (`real-lm`, `tiny-lm` or a checkpoint), and
    `enc`, whose model is optional and built-in only."""
    registry = default_kinds(load_entry_points=False)
    registry.add_role_kind(RoleKind(name="lm", description="test-only", runner="tests.unit.flow.fns:no_such_unit",
                                    models=RoleModels(required=True, builtin="tests.unit.flow.fns:two_models",
                                                      checkpoints=True)))
    registry.add_role_kind(RoleKind(name="enc", description="test-only", runner="tests.unit.flow.fns:no_such_unit",
                                    models=RoleModels(required=False, builtin="tests.unit.flow.fns:two_models")))
    return registry


def test_a_role_whose_kind_needs_a_model_names_one():
    wf = chain()
    wf.role("lm", kind="lm")
    wf.role("enc", kind="enc")  # optional: the kind has a default
    assert check_spec(wf.to_spec(), model_kinds()) == [
        Issue("model_missing", "role 'lm' of kind 'lm' needs a model: a built-in one (real-lm, tiny-lm) or a"
              " checkpoint folder", role="lm", path="model"),
    ]


def test_model_names_are_built_in_or_checkpoints_the_lookup_finds():
    wf = chain()
    wf.role("a", kind="lm", model="tiny-lm")
    wf.role("b", kind="lm", model="org/ckpt")
    wf.role("c", kind="lm", model="no-such-model")
    wf.role("d", kind="enc", model="org/ckpt")  # built-in names only
    spec = wf.to_spec()
    asked: list[str] = []

    def lookup(name: str) -> bool:
        asked.append(name)
        return name == "org/ckpt"

    assert check_spec(spec, model_kinds(), checkpoints=lookup) == [
        Issue("model_unknown", "role 'c': model 'no-such-model' is neither a built-in model of kind 'lm' (real-lm,"
              " tiny-lm) nor a checkpoint folder in the model directories", role="c", path="model"),
        Issue("model_unknown", "role 'd': model 'org/ckpt' is neither a built-in model of kind 'enc' (real-lm,"
              " tiny-lm)", role="d", path="model"),
    ]
    assert asked == ["org/ckpt", "no-such-model"]  # built-in names never reach the file system
    assert check_spec(spec, model_kinds()) == []  # without a lookup only missing models are found


def test_the_llm_kinds_know_the_catalogues_models():
    kinds = default_kinds()
    llm = kinds.role_kind("llm").models
    assert llm is not None and llm.required and llm.checkpoints
    weights = {m.name: m.random_weights for m in llm.builtin_models()}
    assert weights["tiny-llama"] is True and weights["smollm2-135m"] is False
    assert kinds.role_kind("diffusion").models == llm  # the LLM whose transformer denoises
    vae = kinds.role_kind("vae_decoder").models
    assert vae is not None and not vae.required and not vae.checkpoints
    assert [m.name for m in vae.builtin_models()] == ["tiny-vae"]
    assert kinds.role_kind("python").models is None


def test_executor_node_takes_no_role_and_no_op(kinds):
    spec = chain().to_spec()
    n = replace(spec.node("n"), role="py", op=OP)
    spec = replace(spec, nodes=[n, *spec.nodes[1:]])
    assert check_spec(spec, kinds) == [
        Issue("unexpected_role", "node 'n' of kind 'input' runs in the executor and takes no role", node="n"),
        Issue("unexpected_op", "node 'n' of kind 'input' takes no op", node="n"),
    ]


def test_missing_op(kinds):
    wf = chain()
    wf.node("noop", "python", role="py", inputs={"x": "json"}, outputs={"out": "json"})
    wf.edge("n", "noop")
    assert check_spec(wf.to_spec(), kinds) == [
        Issue("missing_op", "node 'noop' of kind 'python' needs an op", node="noop", path="op"),
    ]


# ------------------------------------------------------------------ edges and ports
def test_unknown_source_port(kinds):
    spec = with_edges(chain().to_spec(), EdgeSpec("inc", "nope", "out", "value"))
    eid = "inc.nope->out.value"
    assert check_spec(spec, kinds) == [
        Issue("unknown_port", f"edge {eid}: node 'inc' has no output port 'nope' (outputs: out)", edge=eid,
              node="inc", port="nope"),
    ]


def test_unknown_target_port(kinds):
    spec = with_edges(chain().to_spec(), EdgeSpec("n", "value", "inc", "y"))
    eid = "n.value->inc.y"
    assert check_spec(spec, kinds) == [
        Issue("unknown_port", f"edge {eid}: node 'inc' has no input port 'y' (inputs: x)", edge=eid,
              node="inc", port="y"),
    ]


def test_edge_with_both_ports_unknown_reports_both(kinds):
    spec = with_edges(chain().to_spec(), EdgeSpec("n", "v", "inc", "y"))
    issues = check_spec(spec, kinds)
    assert [(i.code, i.node, i.port) for i in issues] == [("unknown_port", "n", "v"), ("unknown_port", "inc", "y")]
    assert {i.edge for i in issues} == {"n.v->inc.y"}


def test_edge_to_unknown_node(kinds):
    spec = with_edges(chain().to_spec(), EdgeSpec("ghost", "out", "inc", "x"))
    assert check_spec(spec, kinds) == [
        Issue("unknown_node", "edge ghost.out->inc.x: no node 'ghost'", edge="ghost.out->inc.x", node="ghost"),
    ]


def test_duplicate_edge(kinds):
    spec = chain().to_spec()
    spec = with_edges(spec, spec.edges[0])
    assert check_spec(spec, kinds) == [
        Issue("duplicate_edge", "edge n.value->inc.x is declared twice", edge="n.value->inc.x"),
    ]


def test_dangling_required_input(kinds):
    wf = chain()
    fn_node(wf, "pair", inputs={"x": "json", "y": "json", "z": {"type": "json", "optional": True}})
    wf.edge("n", "pair.x")
    assert check_spec(wf.to_spec(), kinds) == [
        Issue("dangling_port", "input port pair.y is not connected (connect it or mark it optional)",
              node="pair", port="y"),
    ]


def prompted(kind: str, *ports: str, role_kind: str = "llm") -> GraphSpec:
    """Input nodes wired into node `gen` of `kind` on ports `ports` (each from an input of its type),
    `gen`'s first output to an output: nothing else is missing."""
    wf = Workflow("prompted")
    role = wf.role("lm", kind=role_kind, model="tiny-llama")
    gen = wf.node("gen", kind, role=role)
    types = {"prompt": "text", "tokens": "tokens", "kv": "kv", "items": "json", "embeds": "tensor"}
    for port in ports:
        wf.edge(wf.input(f"in_{port}", types[port]), gen.inp(port))
    wf.output("out", gen.out("latents" if kind == "diffusion" else "kv"))
    return wf.to_spec()


@pytest.mark.parametrize(("kind", "role_kind", "ports"), [
    ("llm", "llm", "gen.prompt or gen.tokens"),
    ("llm", "sglang_llm", "gen.prompt or gen.tokens"),
    ("llm.prefill", "llm", "gen.prompt or gen.tokens"),
    ("diffusion", "diffusion", "gen.prompt or gen.tokens or gen.kv"),
])
def test_a_model_node_without_a_prompt_wired_is_an_issue_on_its_node(kind, role_kind, ports):
    """What the runners refuse at run time (`engine.compute.prompts.call_prompt`, the diffusion
    unit's `node_prompt`) is found before it: none of the node's prompt ports has an edge. Media
    items ride along with a prompt, they are not one."""
    kinds = default_kinds()
    media = ("items", "embeds") if kind == "llm" else ()
    assert check_spec(prompted(kind, *media, role_kind=role_kind), kinds) == [
        Issue("missing_input", f"node 'gen' needs a prompt: connect its input port {ports}",
              node="gen", port="prompt"),
    ]


@pytest.mark.parametrize(("kind", "role_kind", "wired"), [
    ("llm", "llm", ("prompt",)),
    ("llm", "llm", ("tokens",)),
    ("llm", "llm", ("prompt", "items", "embeds")),
    ("llm", "sglang_llm", ("tokens",)),
    ("llm.prefill", "llm", ("prompt",)),
    ("llm.prefill", "llm", ("tokens",)),
    ("diffusion", "diffusion", ("prompt",)),
    ("diffusion", "diffusion", ("tokens",)),
    ("diffusion", "diffusion", ("kv",)),
])
def test_any_one_of_the_prompt_ports_wired_is_enough(kind, role_kind, wired):
    assert check_spec(prompted(kind, *wired, role_kind=role_kind), default_kinds()) == []


def test_a_prompt_port_the_node_makes_required_is_reported_once():
    wf = Workflow("narrowed")
    role = wf.role("lm", kind="llm", model="tiny-llama")
    gen = wf.node("gen", "llm", role=role, inputs={"prompt": "text"})
    wf.output("out", gen.out("kv"))
    assert check_spec(wf.to_spec(), default_kinds()) == [
        Issue("dangling_port", "input port gen.prompt is not connected (connect it or mark it optional)",
              node="gen", port="prompt"),
    ]


def test_both_prompt_ports_wired_are_left_to_the_run():
    """A router may feed text on one branch and token ids on the other, so two wired alternatives
    are valid; a run that delivers both fails its node (`call_prompt`: exactly one)."""
    assert check_spec(prompted("llm", "prompt", "tokens"), default_kinds()) == []


def test_the_llm_kinds_prompt_choice_is_what_the_runners_read():
    """The catalogue's choice against the reader the llm runners share: a call with nothing on the
    choice's ports is refused, one with a value on any single port is read."""
    from engine.compute.prompts import call_prompt
    from engine.spec.calls import NodeCall

    def call(**inputs) -> NodeCall:
        return NodeCall("r", "gen", None, {}, inputs, ("text",), False, False, 0, 0)

    values = {"prompt": "hi", "tokens": [1, 2]}
    for kind in ("llm", "llm.prefill"):
        (choice,) = default_kinds().node_kind(kind).needs
        assert choice.ports == ("prompt", "tokens")
        with pytest.raises(ValueError, match="exactly one of the inputs 'prompt' \\(text\\) or 'tokens'"):
            call_prompt(call(items=[]), ValueError)
        for port in choice.ports:
            assert call_prompt(call(**{port: values[port]}), ValueError) == values[port]


def test_two_edges_into_a_plain_port_are_left_to_the_run(kinds):
    """A merge port after a router (one branch delivers) is valid; two deliveries on it
    fail the run instead (see test_executor)."""
    wf = chain()
    fn_node(wf, "twice")
    wf.edge("n", "twice")
    wf.edge("inc", "twice")
    assert check_spec(wf.to_spec(), kinds) == []


def test_port_type_mismatch(kinds):
    wf = chain()
    wf.input("t", "text", default="hi")
    fn_node(wf, "needs_image", inputs={"img": "image"})
    wf.edge("t", "needs_image")
    eid = "t.value->needs_image.img"
    assert check_spec(wf.to_spec(), kinds) == [
        Issue("type_mismatch", f"edge {eid}: output t.value is text but input needs_image.img expects image",
              edge=eid, node="needs_image", port="img"),
    ]


@pytest.mark.parametrize(("source", "target"), [("text", "any"), ("any", "image"), ("tensor", "tensor")])
def test_compatible_port_types(kinds, source, target):
    wf = Workflow("types")
    py = wf.role("py")
    wf.input("v", source, default=None)
    fn_node(wf, "sink", inputs={"x": target}, role=py.name)
    wf.edge("v", "sink")
    assert check_spec(wf.to_spec(), kinds) == []


def test_fixed_ports_of_a_kind(kinds):
    spec = chain().to_spec()
    ports = {"value": PortSpec(type="any"), "extra": PortSpec(type="json", optional=True)}
    out = replace(spec.node("out"), inputs=ports)
    spec = replace(spec, nodes=[*spec.nodes[:2], out])
    assert check_spec(spec, kinds) == [
        Issue("wrong_ports", "node 'out' of kind 'output' must have input ports ['value'], not ['extra', 'value']",
              node="out"),
    ]


def test_a_node_may_leave_out_a_kinds_optional_outputs_but_no_other(kinds):
    """Graphs saved before a kind grew an optional output (the llm node's `usage`) stay valid."""
    kinds.add_node_kind(NodeKind(name="gen", description="a generator", role_kinds=("python",), inputs={},
                                 outputs={"out": PortSpec(type="json"), "extra": PortSpec(type="json", optional=True)}))
    wf = Workflow("older")
    wf.role("py")
    wf.node("g", "gen", role="py", inputs={}, outputs={"out": "json"})
    wf.output("y", "g.out")
    assert check_spec(wf.to_spec(), kinds) == []
    spec = wf.to_spec()
    spec = replace(spec, nodes=[replace(n, outputs={"extra": PortSpec(type="json", optional=True)}) if n.id == "g"
                                else n for n in spec.nodes])
    assert [i.code for i in check_spec(spec, kinds)][:1] == ["wrong_ports"]


# ------------------------------------------------------------------ cycles and reachability
def loop(max_iterations: int | None) -> Workflow:
    """n -> body <-> check -> out: a cycle, bounded when `max_iterations` is given."""
    wf = Workflow("loop")
    wf.role("py")
    wf.input("n", default=1)
    fn_node(wf, "body", inputs={"x": {"type": "json", "join": "all"}}, max_iterations=max_iterations)
    fn_node(wf, "check", routes=["body", "out"])
    wf.edge("n", "body")
    wf.edge("body", "check")
    wf.edge("check", "body")
    wf.output("out", "check")
    return wf


def test_unbounded_cycle(kinds):
    assert check_spec(loop(None).to_spec(), kinds) == [
        Issue("unbounded_cycle", "cycle body -> check -> body has no bound: set max_iterations on one of its nodes",
              node="body"),
    ]


def test_bounded_cycle_passes(kinds):
    assert check_spec(loop(5).to_spec(), kinds) == []


def test_self_loop_is_a_cycle(kinds):
    wf = chain()
    fn_node(wf, "spin", inputs={"x": {"type": "json", "join": "all"}})
    wf.edge("n", "spin")
    wf.edge("spin", "spin")
    assert codes(check_spec(wf.to_spec(), kinds)) == ["unbounded_cycle"]


def test_cycle_nothing_leads_into_is_unreachable(kinds):
    wf = chain()
    fn_node(wf, "ping", max_iterations=3)
    fn_node(wf, "pong")
    fn_node(wf, "after")
    wf.edge("ping", "pong")
    wf.edge("pong", "ping")
    wf.edge("pong", "after")
    assert check_spec(wf.to_spec(), kinds) == [
        Issue("unreachable", f"node {nid!r} can never run: nothing outside its cycle leads to it", node=nid)
        for nid in ("ping", "pong", "after")
    ]


# ------------------------------------------------------------------ routers and triggers
def test_router_naming_a_non_successor(kinds):
    wf = chain()
    fn_node(wf, "router", routes=["out", "inc"])
    wf.edge("n", "router")
    fn_node(wf, "a")
    wf.edge("router", "a")
    assert check_spec(wf.to_spec(), kinds) == [
        Issue("route_not_successor", "router 'router' names 'out', which is not one of its successors (a)",
              node="router"),
        Issue("route_not_successor", "router 'router' names 'inc', which is not one of its successors (a)",
              node="router"),
    ]


def test_trigger_naming_a_non_predecessor(kinds):
    wf = chain()
    fn_node(wf, "t", trigger=[["n"], ["inc", "out"]])
    wf.edge("n", "t")
    assert check_spec(wf.to_spec(), kinds) == [
        Issue("trigger_not_predecessor", "node 't': trigger names 'inc', which has no edge into 't'", node="t"),
        Issue("trigger_not_predecessor", "node 't': trigger names 'out', which has no edge into 't'", node="t"),
    ]


def test_empty_trigger_group(kinds):
    wf = chain()
    fn_node(wf, "t", trigger=[[]])
    wf.edge("n", "t")
    assert check_spec(wf.to_spec(), kinds) == [
        Issue("bad_trigger", "node 't' has an empty trigger group", node="t"),
    ]


def test_stream_router(kinds):
    wf = chain()
    fn_node(wf, "sr", stream=True, routes=["sink"])
    fn_node(wf, "sink", inputs={"x": {"type": "json", "join": "ordered"}})
    wf.edge("n", "sr")
    wf.edge("sr", "sink")
    assert check_spec(wf.to_spec(), kinds) == [
        Issue("stream_router", "node 'sr' cannot both stream and route", node="sr"),
    ]


# ------------------------------------------------------------------ streams
def stream_pair(*, producer_streams: bool, edge_stream: bool, join: str | None) -> Workflow:
    wf = chain()
    fn_node(wf, "producer", stream=producer_streams)
    port = {"type": "json"} if join is None else {"type": "json", "join": join}
    fn_node(wf, "consumer", inputs={"x": port})
    wf.edge("n", "producer")
    wf.edge("producer", "consumer", stream=edge_stream)
    return wf


def test_stream_edge_from_a_non_stream_node(kinds):
    spec = stream_pair(producer_streams=False, edge_stream=True, join=None).to_spec()
    eid = "producer.out->consumer.x"
    assert check_spec(spec, kinds) == [
        Issue("not_a_stream", f"edge {eid} subscribes to a stream but node 'producer' does not stream (set"
              " stream=True on it, or make the edge a plain one)", edge=eid, node="producer"),
    ]


@pytest.mark.parametrize("join", [None, "all"])
def test_plain_edge_from_a_stream_node_needs_ordered_or_dynamic_join(kinds, join):
    spec = stream_pair(producer_streams=True, edge_stream=False, join=join).to_spec()
    eid = "producer.out->consumer.x"
    assert check_spec(spec, kinds) == [
        Issue("stream_needs_join", f"edge {eid}: node 'producer' streams frames; subscribe in stream mode or give"
              " port consumer.x join 'ordered' or 'dynamic'", edge=eid, node="consumer", port="x"),
    ]


@pytest.mark.parametrize(("edge_stream", "join"), [(True, None), (False, "ordered"), (False, "dynamic")])
def test_valid_ways_to_read_a_stream(kinds, edge_stream, join):
    spec = stream_pair(producer_streams=True, edge_stream=edge_stream, join=join).to_spec()
    assert check_spec(spec, kinds) == []


def test_stream_edge_into_a_joining_port(kinds):
    spec = stream_pair(producer_streams=True, edge_stream=True, join="ordered").to_spec()
    assert codes(check_spec(spec, kinds)) == ["stream_join"]


# ------------------------------------------------------------------ params
def test_bad_node_params(kinds):
    spec = chain().to_spec()
    n = replace(spec.node("n"), params={"default": 1, "fallback": 2})
    spec = replace(spec, nodes=[n, *spec.nodes[1:]])
    assert check_spec(spec, kinds) == [
        Issue("bad_param", "node 'n': params: Additional properties are not allowed ('fallback' was unexpected)",
              node="n"),
    ]


def test_bad_role_params(kinds):
    wf = chain()
    wf.role("small", params={"capacity": 0})
    wf.role("typo", params={"capacty": 4})
    assert check_spec(wf.to_spec(), kinds) == [
        Issue("bad_param", "role 'small': params.capacity: 0 is less than the minimum of 1", role="small"),
        Issue("bad_param", "role 'typo': params: Additional properties are not allowed ('capacty' was unexpected)",
              role="typo"),
    ]


def test_param_shadowing_an_input_port(kinds):
    wf = chain()
    fn_node(wf, "shadow", params={"x": 3})
    wf.edge("n", "shadow")
    assert check_spec(wf.to_spec(), kinds) == [
        Issue("param_shadows_port", "node 'shadow': param 'x' has the name of an input port", node="shadow",
              port="x"),
    ]


# ------------------------------------------------------------------ tensor parallelism
def test_tp_size_on_a_kind_that_cannot_shard(kinds):
    wf = chain()
    wf.role("wide", tp_size=2)
    assert check_spec(wf.to_spec(), kinds) == [
        Issue("tp_unsupported", "role 'wide': tp_size 2, but role kind 'python' cannot shard over"
              " tensor-parallel ranks (use tp_size 1)", role="wide"),
    ]


def test_tp_size_is_refused_on_a_kind_with_a_check_but_no_tp_runner(kinds):
    """Without a unit for rank 0 no worker could run it (the catalogue says the kind cannot shard)."""
    kinds.add_role_kind(RoleKind(name="half", description="test-only", runner="tests.unit.flow.fns:no_such_unit",
                                 tensor_parallel="engine.compute.kinds:llm_tp_problems"))
    wf = chain()
    wf.role("wide", kind="half", tp_size=2)
    assert codes(check_spec(wf.to_spec(), kinds)) == ["tp_unsupported"]


@pytest.mark.parametrize("kind", ["python", "vision_encoder", "audio_encoder", "vae_decoder", "audio_decoder"])
def test_tp_size_is_refused_on_every_kind_that_cannot_shard(kind):
    wf = chain()
    wf.role("wide", kind=kind, tp_size=4)
    assert codes(check_spec(wf.to_spec(), default_kinds())) == ["tp_unsupported"]


def test_tp_size_one_is_fine_on_any_kind(kinds):
    wf = chain()
    wf.role("narrow", tp_size=1)
    assert check_spec(wf.to_spec(), kinds) == []


@pytest.mark.parametrize(("model", "tp_size", "problems"), [
    ("tiny-llama", 2, []),                                     # 4 heads, 2 KV heads, MLP 176
    ("tiny-qwen2", 4, []),                                     # 4 heads, 1 KV head (replicated), MLP 128
    ("tiny-llama", 3, ["model 'tiny-llama' has 4 attention heads, not divisible by 3",
                       "model 'tiny-llama' has 2 KV heads: neither a multiple nor a divisor of 3",
                       "model 'tiny-llama' has MLP width 176, not divisible by 3"]),
    ("tiny-llama", 8, ["model 'tiny-llama' has 4 attention heads, not divisible by 8"]),
])
def test_llm_heads_must_split_over_tp_size(model, tp_size, problems):
    wf = chain()
    wf.role("lm", kind="llm", model=model, tp_size=tp_size)
    assert check_spec(wf.to_spec(), default_kinds()) == [
        Issue("tp_indivisible", f"role 'lm': tp_size {tp_size}: {p}", role="lm") for p in problems
    ]


@pytest.mark.parametrize(("tp_size", "issues"), [(2, []), (3, ["tp_indivisible"] * 3)])
def test_diffusion_shards_the_llms_transformer_like_llm(tp_size, issues):
    wf = chain()
    wf.role("dit", kind="diffusion", model="tiny-llama", tp_size=tp_size, params={"tp_timeout_s": 5})
    assert codes(check_spec(wf.to_spec(), default_kinds())) == issues


def test_llm_checkpoint_heads_are_read_from_its_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 6, "num_key_value_heads": 6, "intermediate_size": 96}))
    wf = chain()
    wf.role("lm", kind="llm", model=str(tmp_path), tp_size=4)
    assert codes(check_spec(wf.to_spec(), default_kinds())) == ["tp_indivisible", "tp_indivisible"]
    wf2 = chain()
    wf2.role("lm", kind="llm", model=str(tmp_path), tp_size=3)
    assert check_spec(wf2.to_spec(), default_kinds()) == []


@pytest.mark.parametrize("tp_size", [0, 65, "2", 1.5])
def test_tp_size_out_of_bounds_is_a_schema_error(tp_size):
    doc = spec_to_dict(chain().to_spec())
    doc["roles"][0]["tp_size"] = tp_size
    with pytest.raises(GraphValidationError) as caught:
        parse_spec(doc)
    assert [(i.code, i.path) for i in caught.value.issues] == [("schema", "$.roles[0].tp_size")]


# ------------------------------------------------------------------ everything at once
def test_every_error_is_reported_at_once(kinds):
    wf = chain()
    wf.role("gpu", kind="quantum", balance="fastest")          # unknown_role_kind, unknown_policy
    wf.node("weird", "teleport", inputs={"x": "json"})          # unknown_kind
    fn_node(wf, "orphan", role="nope")                          # unknown_role
    wf.node("noop", "python", role="py", inputs={"x": "json"}, outputs={"out": "json"})  # missing_op
    fn_node(wf, "pair", inputs={"x": "json", "y": "json"})      # dangling_port (y)
    fn_node(wf, "ping")                                         # unbounded_cycle + unreachable
    fn_node(wf, "pong")
    for target in ("weird", "orphan", "noop", "pair.x"):
        wf.edge("n", target)
    wf.edge("ping", "pong")
    wf.edge("pong", "ping")
    spec = wf.to_spec()
    spec = with_nodes(spec, spec.node("inc"))                   # duplicate_id
    spec = with_edges(spec, EdgeSpec("inc", "out", "out", "nope"))  # unknown_port

    with pytest.raises(GraphValidationError) as caught:
        build_plan(spec, kinds)
    issues = caught.value.issues
    assert [(i.code, i.node or i.role) for i in issues] == [
        ("unknown_role_kind", "gpu"),
        ("unknown_policy", "gpu"),
        ("unknown_kind", "weird"),
        ("unknown_role", "orphan"),
        ("missing_op", "noop"),
        ("duplicate_id", "inc"),
        ("unknown_port", "out"),
        ("dangling_port", "pair"),
        ("unbounded_cycle", "ping"),
        ("unreachable", "ping"),
        ("unreachable", "pong"),
    ]
    text = str(caught.value)
    assert text.startswith("invalid workflow (11 problems):\n")
    # Every issue is one line of the error's text.
    assert text.splitlines()[1:] == [f"  - {i.message}" for i in issues]


# ------------------------------------------------------------------ parse_spec
def test_parse_spec_round_trips_a_valid_document(kinds):
    spec = chain().to_spec()
    assert parse_spec(encode_spec(spec)) == spec
    assert parse_spec(encode_spec(spec).decode()) == spec
    assert parse_spec(spec_to_dict(spec)) == spec


def test_parse_spec_malformed_json():
    with pytest.raises(GraphValidationError) as caught:
        parse_spec('{"version": 1, "name": "x",')
    assert caught.value.issues == [
        Issue("malformed_json", "not valid JSON: Expecting property name enclosed in double quotes at line 1"
              " column 28"),
    ]


def test_parse_spec_not_an_object():
    with pytest.raises(GraphValidationError) as caught:
        parse_spec("[1, 2]")
    assert caught.value.issues == [Issue("schema", "a GraphSpec is a JSON object", path="$")]


def test_parse_spec_lists_every_schema_error_with_path_and_node():
    doc = spec_to_dict(chain().to_spec())
    doc["version"] = 2
    doc["nodes"][0]["id"] = "1n"
    doc["nodes"][1]["retries"] = -1
    doc["nodes"][1]["colour"] = "red"
    doc["nodes"][2]["timeout_s"] = 0
    doc["edges"][0].pop("target_port")
    with pytest.raises(GraphValidationError) as caught:
        parse_spec(json.dumps(doc))
    assert [(i.path, i.node) for i in caught.value.issues] == [
        ("$.edges[0]", None),
        ("$.nodes[0].id", "1n"),
        ("$.nodes[1]", "inc"),
        ("$.nodes[1].retries", "inc"),
        ("$.nodes[2].timeout_s", "out"),
        ("$.version", None),
    ]
    assert {i.code for i in caught.value.issues} == {"schema"}
    messages = [i.message for i in caught.value.issues]
    assert messages[0] == "$.edges[0]: 'target_port' is a required property"
    assert messages[2] == "node 'inc': $.nodes[1]: Additional properties are not allowed ('colour' was unexpected)"
    assert messages[3] == "node 'inc': $.nodes[1].retries: -1 is less than the minimum of 0"
    assert messages[5] == "$.version: 2 is not one of [1]"


def test_parse_spec_missing_top_level_fields():
    with pytest.raises(GraphValidationError) as caught:
        parse_spec({"version": 1, "nodes": []})
    assert [i.message for i in caught.value.issues] == [
        "$: 'name' is a required property",
        "$: 'roles' is a required property",
        "$: 'edges' is a required property",
    ]


def test_an_input_default_of_the_wrong_kind_is_an_issue_on_its_node() -> None:
    for kind, default, says in (("text", 42, "give it a string, not a number"),
                                ("tokens", "1 2", "give it a list of token ids (whole numbers), not a string")):
        wf = Workflow("defaults")
        wf.output("out", wf.input("given", kind, default=default), kind)
        issues = [i for i in check_spec(wf.to_spec(), default_kinds()) if i.code == "bad_default"]
        assert [(i.node, i.path) for i in issues] == [("given", "params.default")], issues
        assert says in issues[0].message
    ok = Workflow("fine")
    ok.output("out", ok.input("given", "text", default="hello"), "text")
    assert not [i for i in check_spec(ok.to_spec(), default_kinds()) if i.code == "bad_default"]


def test_an_input_example_is_a_string_the_form_prefills_and_runs_never_read() -> None:
    wf = Workflow("examples")
    wf.output("out", wf.input("question", "text", default="<rendered>", example="What is 2+2?"), "text")
    spec = wf.to_spec()
    assert spec.nodes[0].params == {"default": "<rendered>", "example": "What is 2+2?"}
    assert check_spec(spec, default_kinds()) == []
    plan = build_plan(spec, default_kinds())
    assert plan.input_nodes == ("question",)
    bad = replace(spec, nodes=[replace(spec.nodes[0], params={"example": 7}), *spec.nodes[1:]])
    assert [(i.code, i.node) for i in check_spec(bad, default_kinds())] == [("bad_param", "question")]
    assert "params.example: 7 is not of type 'string'" in check_spec(bad, default_kinds())[0].message
