"""The placement function: exact replica -> node maps for labels, resources, tensor-parallel
packing, spreading, colocate groups and kept placements, and every reason when it cannot."""

from __future__ import annotations

import pytest

from engine.flow.placement import (
    Move,
    NodeOffer,
    Placement,
    PlacementError,
    RoleDemand,
    Slot,
    place,
)
from engine.spec.graph import RoleSpec
from engine.spec.resources import Amounts, ResourcesError, RoleResources, parse_labels, role_resources


def demand(role: str, replicas: int = 1, tp: int = 1, **resources: object) -> RoleDemand:
    return RoleDemand(role, replicas, tp, role_resources(resources))


def node(name: str, gpus: int = 0, cpus: float = 8, memory_gb: float = 32, gpu_memory_gb: float = 0.0,
         **labels: str) -> NodeOffer:
    return NodeOffer(name, Amounts(gpus, cpus, memory_gb), labels, gpu_memory_gb or (80.0 if gpus else 0.0))


def slots(placement: Placement) -> list[tuple[str, int, str]]:
    return [(s.role, s.replica, s.node) for s in placement.slots]


def test_labels_and_resources_place_three_roles_on_two_nodes() -> None:
    nodes = [node("a", gpus=1, cpus=2, kind="gpu", zone="a"), node("b", cpus=4, kind="cpu", zone="b")]
    placement = place([demand("llm", gpus=1, cpus=1), demand("diffusion", cpus=1),
                       demand("decoder", labels={"zone": "a"})], nodes)
    # llm: the only GPU; diffusion: where the most CPUs stay free; decoder: by its label
    assert slots(placement) == [("decoder", 0, "a"), ("diffusion", 0, "b"), ("llm", 0, "a")]
    assert placement.nodes() == ["a", "b"]
    assert placement.counts("a") == {"decoder": 1, "llm": 1}


def test_tensor_parallel_ranks_of_a_replica_share_one_node() -> None:
    nodes = [node("a", gpus=1), node("b", gpus=2), node("c", gpus=1)]
    assert slots(place([demand("lm", tp=2, gpus=1)], nodes)) == [("lm", 0, "b")]
    # four GPUs over three nodes, but no node has two free for the second replica
    with pytest.raises(PlacementError) as info:
        place([demand("lm", replicas=2, tp=2, gpus=1)], nodes)
    (refusal,) = info.value.refusals
    assert (refusal.roles, refusal.replicas, refusal.best_node) == (("lm",), (1,), "a")
    assert refusal.need == Amounts(2, 0, 0)
    assert "once the other roles are placed" in refusal.message


def test_replicas_spread_over_nodes_before_doubling_up() -> None:
    three = [node("a"), node("b"), node("c")]
    assert slots(place([demand("py", replicas=3, cpus=1)], three)) == [("py", 0, "a"), ("py", 1, "b"), ("py", 2, "c")]
    two = three[:2]
    assert [s.node for s in place([demand("py", replicas=3, cpus=1)], two).slots] == ["a", "b", "a"]
    # a node too small for a second one is left alone
    small = [node("a", cpus=1), node("b", cpus=8)]
    assert [s.node for s in place([demand("py", replicas=3, cpus=1)], small).slots] == ["b", "a", "b"]


def test_gpu_less_roles_leave_gpus_free() -> None:
    nodes = [node("gpu", gpus=2, cpus=16), node("cpu", cpus=4)]
    assert slots(place([demand("enc", cpus=1)], nodes)) == [("enc", 0, "cpu")]
    # GPU roles fit tightest: the one-GPU node for a one-GPU role
    nodes = [node("big", gpus=4), node("small", gpus=1)]
    assert slots(place([demand("lm", gpus=1)], nodes)) == [("lm", 0, "small")]


def test_colocate_groups_put_replica_i_of_each_role_on_one_node() -> None:
    nodes = [node("a", gpus=2), node("b", gpus=2)]
    placement = place([demand("llm", replicas=2, gpus=1, colocate="weights"),
                       demand("diffusion", replicas=2, gpus=1, colocate="weights")], nodes)
    assert slots(placement) == [("diffusion", 0, "a"), ("diffusion", 1, "b"), ("llm", 0, "a"), ("llm", 1, "b")]
    # without the group the spread alone would still split them; with one node of room the pair stays whole
    nodes = [node("a", gpus=2), node("b", gpus=1)]
    placement = place([demand("llm", gpus=1, colocate="w"), demand("diffusion", gpus=1, colocate="w")], nodes)
    assert {s.node for s in placement.slots} == {"a"}


def test_a_colocate_group_that_fits_no_node_whole_is_refused_whole() -> None:
    nodes = [node("a", gpus=1), node("b", gpus=1)]
    with pytest.raises(PlacementError) as info:
        place([demand("llm", gpus=1, colocate="w"), demand("diffusion", gpus=1, colocate="w")], nodes)
    (refusal,) = info.value.refusals
    assert refusal.roles == ("diffusion", "llm") and refusal.colocate == "w"
    assert refusal.need == Amounts(2, 0, 0)
    assert refusal.message.startswith("roles 'diffusion', 'llm' (colocate group 'w'), replica 0: cannot be placed")


def test_colocated_roles_asking_for_different_labels_are_refused_with_the_conflict() -> None:
    with pytest.raises(PlacementError) as info:
        place([demand("a", labels={"zone": "x"}, colocate="g"), demand("b", labels={"zone": "y"}, colocate="g")],
              [node("n", zone="x")])
    assert "role 'b' asks for label zone=y, role 'a' for zone=x" in info.value.refusals[0].nodes[0].problems


def test_infeasible_names_every_role_what_it_needs_and_the_best_nodes_free_resources() -> None:
    nodes = [node("a", gpus=1, cpus=4, memory_gb=16, kind="gpu"), node("b", cpus=2, memory_gb=8, kind="cpu")]
    with pytest.raises(PlacementError) as info:
        place([demand("llm", gpus=2, memory_gb=4), demand("enc", cpus=1, labels={"kind": "tpu"}),
               demand("ok", cpus=1)], nodes)
    by_role = {r.roles[0]: r for r in info.value.refusals}
    assert sorted(by_role) == ["enc", "llm"]
    llm = by_role["llm"]
    assert llm.best_node == "a" and llm.best_free == Amounts(1, 4, 16)
    assert llm.message == ("role 'llm', replica 0: cannot be placed: each replica needs 2 GPUs, 0 CPUs, 4 GB;"
                           " the best node, 'a', has 1 GPU, 4 CPUs, 16 GB free (needs 2 GPUs, 1 free)")
    assert [(n.node, n.problems) for n in llm.nodes] == [("a", ("needs 2 GPUs, 1 free",)),
                                                         ("b", ("needs 2 GPUs, 0 free",))]
    enc = by_role["enc"]
    assert [(n.node, n.problems) for n in enc.nodes] == [("a", ("label kind=gpu, needs kind=tpu",)),
                                                         ("b", ("label kind=cpu, needs kind=tpu",))]
    body = enc.to_dict()
    assert body["role"] == "enc" and body["labels"] == {"kind": "tpu"} and body["best_node"] == "a"
    assert str(info.value) == "; ".join(r.message for r in info.value.refusals)


def test_gpu_memory_each_and_no_nodes_at_all() -> None:
    with pytest.raises(PlacementError) as info:
        place([demand("lm", gpus=1, gpu_memory_gb=40)], [node("a", gpus=2, gpu_memory_gb=24)])
    assert info.value.refusals[0].nodes[0].problems == ("GPUs of 24 GB, needs 40 GB each",)
    with pytest.raises(PlacementError) as info:
        place([demand("py", replicas=2)], [])
    assert info.value.refusals[0].replicas == (0, 1)
    assert info.value.refusals[0].message.endswith("there is no live node")


def test_the_search_finds_what_the_greedy_pass_misses() -> None:
    # greedy puts the 3-CPU role on `a` (most left over) and then cannot fit both 2s
    nodes = [node("a", cpus=4), node("b", cpus=3)]
    placement = place([demand("x", cpus=3), demand("y", cpus=2), demand("z", cpus=2)], nodes)
    assert slots(placement) == [("x", 0, "b"), ("y", 0, "a"), ("z", 0, "a")]
    with pytest.raises(PlacementError):  # with no room to search, the greedy answer stands
        place([demand("x", cpus=3), demand("y", cpus=2), demand("z", cpus=2)], nodes, max_steps=3)


def test_a_kept_placement_moves_only_the_replicas_of_lost_nodes() -> None:
    demands = [demand("py", replicas=2, cpus=1), demand("lm", cpus=1)]
    before = place(demands, [node("a"), node("b")])
    assert slots(before) == [("lm", 0, "a"), ("py", 0, "b"), ("py", 1, "a")]
    after = place(demands, [node("a"), node("c")], keep=before)
    assert slots(after) == [("lm", 0, "a"), ("py", 0, "c"), ("py", 1, "a")]
    assert after.moves_from(before) == [Move("py", 0, "b", "c")]
    # node b is gone and nothing else is left: the replica comes back to a
    alone = place(demands, [node("a")], keep=before)
    assert slots(alone) == [("lm", 0, "a"), ("py", 0, "a"), ("py", 1, "a")]
    assert alone.moves_from(before) == [Move("py", 0, "b", "a")]
    # the kept replicas' own resources are theirs: a full node keeps them
    assert slots(place(demands, [node("a", cpus=2), node("b", cpus=1)], keep=before)) == slots(before)


def test_scaling_keeps_the_replicas_it_can() -> None:
    before = place([demand("py", replicas=3, cpus=1)], [node("a"), node("b"), node("c")])
    down = place([demand("py", replicas=2, cpus=1)], [node("a"), node("b"), node("c")], keep=before)
    assert slots(down) == [("py", 0, "a"), ("py", 1, "b")]
    up = place([demand("py", replicas=4, cpus=1)], [node("a"), node("b"), node("c")], keep=before)
    assert slots(up)[:3] == slots(before) and up.moves_from(before) == [Move("py", 3, None, "a")]


def test_placements_round_trip_and_refuse_malformed_entries() -> None:
    placement = Placement((Slot("a", 0, "n1", (2, 3)), Slot("b", 1, "n2")))
    assert Placement.from_list(placement.to_list()) == placement
    assert placement.without(["n2"]).to_list() == [{"role": "a", "replica": 0, "node": "n1", "gpus": [2, 3]}]
    # Written before GPUs had indices: no GPUs.
    assert Placement.from_list([{"role": "a", "replica": 0, "node": "n1"}]).slots == (Slot("a", 0, "n1"),)
    for bad in ({"role": "a", "replica": -1, "node": "n"}, {"role": "a", "replica": True, "node": "n"},
                {"role": 3, "replica": 0, "node": "n"}, {"role": "a", "replica": 0, "node": "n", "gpus": [0, 0]},
                {"role": "a", "replica": 0, "node": "n", "gpus": [-1]}, {"role": "a", "replica": 0, "node": "n",
                                                                         "gpus": "0"}):
        with pytest.raises(ValueError):
            Placement.from_list([bad])


def test_role_demands_read_the_spec() -> None:
    role = RoleSpec(name="lm", kind="llm", replicas=2, tp_size=2, resources={"gpus": 1, "memory_gb": 3})
    lm = RoleDemand.of(role)
    assert (lm.replicas, lm.per_replica) == (2, Amounts(2, 0, 6))
    assert RoleDemand.of(role, replicas=5).replicas == 5
    assert RoleDemand.of(RoleSpec(name="py", kind="python")).resources == RoleResources()


def test_resources_name_every_bad_field() -> None:
    with pytest.raises(ResourcesError) as info:
        role_resources({"gpus": 1.5, "cpus": -1, "memory_gb": "lots", "gpu_memory_gb": float("inf"),
                        "labels": {"zone": 3, "bad name": "x"}, "colocate": "no spaces", "disk": 1})
    fields = [f for f, _ in info.value.problems]
    assert fields == ["disk", "gpus", "cpus", "memory_gb", "gpu_memory_gb", "labels.zone", "labels.bad name",
                      "colocate"]
    with pytest.raises(ResourcesError, match="asks for GPU memory but no GPUs"):
        role_resources({"gpu_memory_gb": 8})
    assert parse_labels(" zone=a, kind=gpu ,") == {"zone": "a", "kind": "gpu"}
    for bad in ("zone", "zone=a,zone=b", "=a", "zone=a b"):
        with pytest.raises(ValueError):
            parse_labels(bad)
