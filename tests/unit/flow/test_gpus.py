"""Which GPUs of a node each replica gets: exact indices for packing, tensor-parallel ranks,
GPUs already held, and the error when they do not fit; and the slots placement gives them."""

from __future__ import annotations

import pytest

from engine.flow.gpus import GpuAssignmentError, GpuGrant, GpuPool, GpuRequest, assign_gpus, gpu_environment
from engine.flow.placement import NodeOffer, Placement, PlacementError, RoleDemand, Slot, place
from engine.spec.resources import Amounts, role_resources


def seats(grants: tuple[GpuGrant, ...]) -> dict[tuple[str, int], tuple[int, ...]]:
    return {(g.role, g.replica): g.gpus for g in grants}


def test_single_gpu_replicas_get_distinct_gpus_in_order() -> None:
    grants = assign_gpus(4, (), [GpuRequest("lm", 0, 1), GpuRequest("lm", 1, 1), GpuRequest("enc", 0, 1)])
    assert seats(grants) == {("enc", 0): (0,), ("lm", 0): (1,), ("lm", 1): (2,)}
    assert [g.role for g in grants] == ["lm", "lm", "enc"]  # the order asked in


def test_larger_replicas_go_first_on_consecutive_gpus() -> None:
    # 1 GPU for "a", then a tensor-parallel replica of 2 ranks: it goes first and sits side by side.
    grants = assign_gpus(4, (), [GpuRequest("a", 0, 1), GpuRequest("lm", 0, 1, tp_size=2)])
    assert seats(grants) == {("lm", 0): (0, 1), ("a", 0): (2,)}


def test_tensor_parallel_ranks_each_get_their_own_gpus() -> None:
    (grant,) = assign_gpus(4, (), [GpuRequest("lm", 0, 2, tp_size=2)])
    assert grant.gpus == (0, 1, 2, 3) and grant.per_rank == 2
    assert [grant.rank_gpus(r) for r in range(2)] == [(0, 1), (2, 3)]


def test_held_gpus_are_skipped_and_a_run_of_free_ones_is_preferred() -> None:
    # 0 and 2 are held: the 2-GPU replica takes 3, 4 (a run) rather than 1, 3.
    grants = assign_gpus(5, {0, 2}, [GpuRequest("lm", 0, 1, tp_size=2), GpuRequest("enc", 0, 1)])
    assert seats(grants) == {("lm", 0): (3, 4), ("enc", 0): (1,)}


def test_without_a_run_the_lowest_free_gpus_are_taken() -> None:
    assert seats(assign_gpus(4, {1, 2}, [GpuRequest("lm", 0, 1, tp_size=2)])) == {("lm", 0): (0, 3)}


def test_cpu_replicas_get_no_gpus_and_need_none() -> None:
    assert seats(assign_gpus(0, (), [GpuRequest("py", 0, 0), GpuRequest("py", 1, 0, tp_size=2)])) == {
        ("py", 0): (), ("py", 1): ()}


def test_not_enough_gpus_names_the_replica_and_what_is_free() -> None:
    with pytest.raises(GpuAssignmentError) as info:
        assign_gpus(3, {0}, [GpuRequest("lm", 0, 1, tp_size=2), GpuRequest("lm", 1, 1)])
    assert str(info.value) == ("role 'lm', replica 1: needs 1 GPUs, the node has 3, held by others: 0, taken by"
                               " larger replicas here: 1, 2, free: none")


def test_a_replica_larger_than_the_free_gpus_says_its_ranks() -> None:
    with pytest.raises(GpuAssignmentError, match=r"replica 0: needs 4 GPUs \(2 ranks of 2\), the node has 4, held by"
                                                 r" others: 3, .* free: 0, 1, 2$"):
        assign_gpus(4, [3], [GpuRequest("lm", 0, 2, tp_size=2)])


@pytest.mark.parametrize(("count", "held", "requests", "message"), [
    (-1, (), [], "at least 0 GPUs"),
    (2, (2,), [], "GPUs 2 are held but the node has 2"),
    (2, (), [GpuRequest("lm", 0, -1)], "needs at least 0 GPUs per process and 1 process"),
    (2, (), [GpuRequest("lm", 0, 1, tp_size=0)], "needs at least 0 GPUs per process and 1 process"),
    (2, (), [GpuRequest("lm", 0, 1), GpuRequest("lm", 0, 1)], "replica 0 is asked for twice"),
])
def test_malformed_input_is_refused(count, held, requests, message) -> None:
    with pytest.raises(GpuAssignmentError, match=message):
        assign_gpus(count, held, requests)


def test_the_environment_names_the_gpus_in_bus_order() -> None:
    assert gpu_environment((2, 3)) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert gpu_environment(()) == {}


# -- placement's slots ------------------------------------------------------------------------------

def demand(role: str, replicas: int = 1, tp: int = 1, **resources: object) -> RoleDemand:
    return RoleDemand(role, replicas, tp, role_resources(resources))


def gpu_node(name: str, gpus: int, held: frozenset[int] = frozenset()) -> NodeOffer:
    return NodeOffer(name, Amounts(gpus - len(held), 8, 32), {}, 80.0, gpu_count=gpus, held_gpus=held)


def test_placement_slots_name_distinct_gpus_of_their_node() -> None:
    placement = place([demand("lm", replicas=2, tp=2, gpus=1), demand("enc", gpus=1), demand("py", cpus=1)],
                      [gpu_node("a", 4), gpu_node("b", 2, frozenset({0}))])
    assert placement.slots == (Slot("enc", 0, "b", (1,)), Slot("lm", 0, "a", (0, 1)), Slot("lm", 1, "a", (2, 3)),
                               Slot("py", 0, "a"))


def test_gpus_other_deployments_hold_are_not_given() -> None:
    placement = place([demand("lm", replicas=2, gpus=1)], [gpu_node("a", 4, frozenset({0, 2}))])
    assert [s.gpus for s in placement.slots] == [(1,), (3,)]


def test_replicas_that_stay_keep_their_gpus_and_new_ones_fill_around_them() -> None:
    before = Placement((Slot("lm", 0, "a", (2,)), Slot("lm", 1, "b", (0,))))
    after = place([demand("lm", replicas=3, gpus=1)], [gpu_node("a", 4)], keep=before)
    assert after.slots == (Slot("lm", 0, "a", (2,)), Slot("lm", 1, "a", (0,)), Slot("lm", 2, "a", (1,)))


def test_a_kept_replica_whose_gpus_are_taken_meanwhile_gets_others() -> None:
    before = Placement((Slot("lm", 0, "a", (0,)),))
    after = place([demand("lm", gpus=1)], [gpu_node("a", 2, frozenset({0}))], keep=before)
    assert after.slots == (Slot("lm", 0, "a", (1,)),)


def test_gpus_free_by_count_but_not_by_index_are_not_counted() -> None:
    # The node says 2 are free, but both its GPUs are held by index: nothing fits.
    offer = NodeOffer("a", Amounts(2, 8, 32), {}, 80.0, gpu_count=2, held_gpus=frozenset({0, 1}))
    assert offer.free_gpus == 0
    with pytest.raises(PlacementError, match="needs 1 GPU, 0 free"):
        place([demand("lm", gpus=1)], [offer])


def test_a_pool_holds_what_it_gave_until_it_is_given_back() -> None:
    pool = GpuPool(3)
    assert seats(pool.take([GpuRequest("a", 0, 1), GpuRequest("b", 0, 1)])) == {("a", 0): (0,), ("b", 0): (1,)}
    assert seats(pool.take([GpuRequest("c", 0, 1)])) == {("c", 0): (2,)}
    with pytest.raises(GpuAssignmentError, match="free: none"):
        pool.take([GpuRequest("d", 0, 1)])
    assert pool.held == {0, 1, 2}  # the failed take held nothing more
    pool.give_back((1,))
    assert seats(pool.take([GpuRequest("d", 0, 1)])) == {("d", 0): (1,)}
