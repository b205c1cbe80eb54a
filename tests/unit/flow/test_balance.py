"""Load-balancing policies: generic contract over every policy, then each policy's behaviour."""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any

import jsonschema
import pytest

from engine.flow.balance import (
    POLICY_NAMES,
    BalanceRequest,
    Candidate,
    ConsistentHash,
    KVAware,
    LeastOutstanding,
    NoWorkerError,
    Policy,
    PowerOfTwoChoices,
    RandomChoice,
    RoundRobin,
    candidates_from,
    make_policy,
    policy_param_schema,
)
from engine.flow.discovery import WorkerInfo, WorkerLoad, WorkerSnapshot

ROLE = "llm"

# Params that make every policy deterministic.
SEEDED: dict[str, dict[str, Any]] = {"random": {"seed": 7}, "power_of_two": {"seed": 7}}


def policy(name: str, **params: Any) -> Policy:
    return make_policy(name, role=ROLE, **{**SEEDED.get(name, {}), **params})


def cand(worker_id: str, outstanding: int = 0, capacity: int = 1, cached: int = 0) -> Candidate:
    return Candidate(worker_id, outstanding=outstanding, capacity=capacity, cached_prefix_pages=cached)


def req(i: int | str, session: str | None = None, pages: int = 0) -> BalanceRequest:
    return BalanceRequest(f"req-{i}", session_key=session, prefix_pages=tuple(f"p{n}" for n in range(pages)))


def idle(n: int) -> list[Candidate]:
    return [cand(f"w{i}") for i in range(n)]


def choices(p: Policy, candidates: list[Candidate], n: int, **req_kw: Any) -> list[str]:
    return [p.choose(req(i, **req_kw), candidates) for i in range(n)]


# --- every policy -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_empty_candidates_raise_no_worker_naming_the_role(name: str) -> None:
    with pytest.raises(NoWorkerError, match="'llm'") as info:
        policy(name).choose(req(0), [])
    assert info.value.role == ROLE


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_single_candidate_is_always_chosen(name: str) -> None:
    p = policy(name)
    assert set(choices(p, [cand("only", outstanding=5, cached=0)], 20, pages=3)) == {"only"}


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_choice_is_one_of_the_candidates(name: str) -> None:
    candidates = [cand("a", 1), cand("b", 0, cached=2), cand("c", 3, capacity=2)]
    assert set(choices(policy(name), candidates, 200, pages=4)) <= {"a", "b", "c"}


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_same_params_give_the_same_sequence_regardless_of_candidate_order(name: str) -> None:
    candidates = [cand("a", 2), cand("b", 0), cand("c", 1, capacity=4), cand("d", 2, cached=1)]
    first = choices(policy(name), candidates, 300, pages=2)
    second = choices(policy(name), list(reversed(candidates)), 300, pages=2)
    assert first == second


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_make_policy_builds_the_named_policy(name: str) -> None:
    p = policy(name)
    assert p.name == name
    assert p.role == ROLE


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_param_schema_is_valid_and_matches_the_constructor(name: str) -> None:
    schema = policy_param_schema(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False
    cls = type(policy(name))
    ctor_params = set(inspect.signature(cls).parameters) - {"role"}
    assert set(schema["properties"]) == ctor_params
    # The documented defaults are the constructor's defaults, and build a policy.
    for param, spec in schema["properties"].items():
        assert spec["default"] == inspect.signature(cls).parameters[param].default
    defaults = {param: spec["default"] for param, spec in schema["properties"].items()}
    assert make_policy(name, role=ROLE, **defaults).name == name


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_make_policy_rejects_unknown_params(name: str) -> None:
    with pytest.raises(ValueError, match="bogus"):
        make_policy(name, role=ROLE, bogus=1)


def test_make_policy_rejects_an_unknown_name_listing_the_valid_ones() -> None:
    with pytest.raises(ValueError) as info:
        make_policy("fastest", role=ROLE)
    message = str(info.value)
    assert "'fastest'" in message
    assert all(name in message for name in POLICY_NAMES)
    with pytest.raises(ValueError, match="round_robin"):
        policy_param_schema("fastest")


def test_policy_names_are_exactly_the_documented_ones() -> None:
    assert POLICY_NAMES == (
        "round_robin",
        "random",
        "least_outstanding",
        "power_of_two",
        "consistent_hash",
        "kv_aware",
    )


@pytest.mark.parametrize(
    ("name", "params", "bad"),
    [
        ("consistent_hash", {"vnodes": 0}, "vnodes"),
        ("consistent_hash", {"vnodes": True}, "vnodes"),
        ("kv_aware", {"overlap_weight": -1.0}, "overlap_weight"),
        ("kv_aware", {"load_weight": "heavy"}, "load_weight"),
        ("random", {"seed": 1.5}, "seed"),
    ],
)
def test_make_policy_rejects_invalid_param_values(name: str, params: dict[str, Any], bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        make_policy(name, role=ROLE, **params)


def test_direct_construction_validates_too() -> None:
    with pytest.raises(ValueError, match="vnodes"):
        ConsistentHash(role=ROLE, vnodes=0)
    with pytest.raises(ValueError, match="load_weight"):
        KVAware(role=ROLE, load_weight=float("inf"))


# --- candidates -------------------------------------------------------------------------------


def test_candidate_validates_counts() -> None:
    with pytest.raises(ValueError, match="capacity"):
        cand("a", capacity=0)
    with pytest.raises(ValueError, match="counts"):
        cand("a", outstanding=-1)
    assert cand("a", outstanding=3, capacity=4).load == 0.75


def test_candidates_from_prefers_dispatcher_counts_and_defaults_cache_to_zero() -> None:
    snapshots = [
        WorkerSnapshot(WorkerInfo("w1", ROLE, "tcp://h:1", capacity=4), WorkerLoad(outstanding=2), 10.0),
        WorkerSnapshot(WorkerInfo("w2", ROLE, "tcp://h:2"), WorkerLoad(outstanding=7), 10.0),
    ]
    assert candidates_from(snapshots, outstanding={"w2": 1}, cached={"w1": 3}) == [
        Candidate("w1", outstanding=2, capacity=4, cached_prefix_pages=3),
        Candidate("w2", outstanding=1, capacity=1, cached_prefix_pages=0),
    ]
    assert candidates_from(snapshots) == [Candidate("w1", 2, 4, 0), Candidate("w2", 7, 1, 0)]


# --- round robin ------------------------------------------------------------------------------


def test_round_robin_is_exactly_even_and_cycles_in_worker_id_order() -> None:
    picks = choices(RoundRobin(role=ROLE), [cand("c"), cand("a"), cand("b")], 300)
    assert picks[:6] == ["a", "b", "c", "a", "b", "c"]
    assert Counter(picks) == {"a": 100, "b": 100, "c": 100}


def test_round_robin_ignores_load() -> None:
    picks = choices(RoundRobin(role=ROLE), [cand("a", 50), cand("b", 0)], 4)
    assert picks == ["a", "b", "a", "b"]


# --- random and power of two ------------------------------------------------------------------


@pytest.mark.parametrize("cls", [RandomChoice, PowerOfTwoChoices])
def test_seeded_random_policies_are_roughly_even_and_reproducible(cls: type) -> None:
    candidates = idle(4)
    picks = choices(cls(role=ROLE, seed=11), candidates, 4000)
    counts = Counter(picks)
    assert set(counts) == {"w0", "w1", "w2", "w3"}
    assert all(850 <= n <= 1150 for n in counts.values()), counts
    assert choices(cls(role=ROLE, seed=11), candidates, 4000) == picks
    assert choices(cls(role=ROLE, seed=12), candidates, 4000) != picks


def test_power_of_two_never_picks_the_most_loaded_and_favours_the_least() -> None:
    candidates = [cand("w0", 0), cand("w1", 1), cand("w2", 2), cand("w3", 9)]
    counts = Counter(choices(PowerOfTwoChoices(role=ROLE, seed=3), candidates, 3000))
    assert "w3" not in counts
    # The least loaded wins every pair it is drawn in: 3 of the 6 pairs.
    assert 1300 <= counts["w0"] <= 1700, counts
    assert counts["w0"] > counts["w1"] > counts["w2"]


# --- least outstanding ------------------------------------------------------------------------


def test_least_outstanding_picks_the_least_loaded() -> None:
    p = LeastOutstanding(role=ROLE)
    assert p.choose(req(0), [cand("a", 3), cand("b", 1), cand("c", 2)]) == "b"


def test_least_outstanding_breaks_ties_by_load_ratio_then_worker_id() -> None:
    p = LeastOutstanding(role=ROLE)
    assert p.choose(req(0), [cand("a", 2, capacity=2), cand("b", 2, capacity=8), cand("c", 4)]) == "b"
    assert p.choose(req(0), [cand("b", 1, capacity=2), cand("a", 1, capacity=2)]) == "a"


# --- consistent hash --------------------------------------------------------------------------


def owners(p: ConsistentHash, candidates: list[Candidate], keys: list[str]) -> dict[str, str]:
    return {k: p.choose(BalanceRequest(f"r-{k}", session_key=k), candidates) for k in keys}


KEYS = [f"session-{i}" for i in range(3000)]


def test_consistent_hash_keeps_affinity_across_requests_and_instances() -> None:
    candidates = idle(5)
    first = owners(ConsistentHash(role=ROLE), candidates, KEYS)
    again = owners(ConsistentHash(role=ROLE), list(reversed(candidates)), KEYS)
    assert first == again
    # Same session, different requests -> same worker; without a session the request id is the key.
    p = ConsistentHash(role=ROLE)
    assert {p.choose(BalanceRequest(f"r{i}", session_key="s-42"), candidates) for i in range(50)} == {
        first["session-42"]
    }
    assert p.choose(BalanceRequest("session-42"), candidates) == first["session-42"]


def test_consistent_hash_spreads_keys() -> None:
    counts = Counter(owners(ConsistentHash(role=ROLE), idle(5), KEYS).values())
    assert set(counts) == {f"w{i}" for i in range(5)}
    assert all(400 <= n <= 800 for n in counts.values()), counts  # ideal 600


def test_consistent_hash_moves_only_the_new_workers_share_when_one_is_added() -> None:
    p = ConsistentHash(role=ROLE)
    before = owners(p, idle(10), KEYS)
    after = owners(p, [*idle(10), cand("w-new")], KEYS)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "w-new" for k in moved)
    assert 0.04 * len(KEYS) <= len(moved) <= 2 * len(KEYS) / 11  # ideal 1/11 ~ 9%


def test_consistent_hash_moves_only_the_removed_workers_keys() -> None:
    p = ConsistentHash(role=ROLE)
    before = owners(p, idle(10), KEYS)
    after = owners(p, [c for c in idle(10) if c.worker_id != "w3"], KEYS)
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved == {k for k in KEYS if before[k] == "w3"}
    assert len(moved) <= 2 * len(KEYS) / 10


def test_consistent_hash_ignores_load() -> None:
    p = ConsistentHash(role=ROLE)
    target = p.choose(BalanceRequest("r", session_key="s"), idle(4))
    loaded = [cand(c.worker_id, 100 if c.worker_id == target else 0) for c in idle(4)]
    assert p.choose(BalanceRequest("r", session_key="s"), loaded) == target


# --- KV-aware ---------------------------------------------------------------------------------


def test_kv_aware_cost_formula_exact_values() -> None:
    r = req(0, pages=8)
    default = KVAware(role=ROLE)
    # uncached = 8 - 5 = 3 pages; load = 3 outstanding / 2 slots = 1.5
    assert default.cost(r, cand("a", outstanding=3, capacity=2, cached=5)) == 4.5
    weighted = KVAware(role=ROLE, overlap_weight=2.0, load_weight=0.5)
    assert weighted.cost(r, cand("a", outstanding=3, capacity=2, cached=5)) == 6.75
    # Cold idle worker pays for every page; a cached count above the prefix length is clamped.
    assert default.cost(r, cand("b")) == 8.0
    assert default.cost(r, cand("c", outstanding=1, cached=12)) == 1.0
    # No prefix: only the load counts.
    assert default.cost(req(1), cand("d", outstanding=4, capacity=8, cached=3)) == 0.5


def test_kv_aware_picks_the_worker_holding_the_prefix() -> None:
    candidates = [cand("cold-a", 1), cand("warm", 2, cached=8), cand("cold-b", 0)]
    # warm: 0 + 2 = 2; cold-a: 8 + 1 = 9; cold-b: 8 + 0 = 8
    assert KVAware(role=ROLE).choose(req(0, pages=8), candidates) == "warm"


def test_kv_aware_prefers_a_cold_worker_when_the_warm_one_is_overloaded() -> None:
    candidates = [cand("warm", 12, cached=8), cand("cold", 1)]
    # warm: 0 + 12 = 12; cold: 8 + 1 = 9
    assert KVAware(role=ROLE).choose(req(0, pages=8), candidates) == "cold"
    # Raising the price of prefill flips it back to the warm worker: 0 + 12 < 24 + 1.
    assert KVAware(role=ROLE, overlap_weight=3.0).choose(req(0, pages=8), candidates) == "warm"


def test_kv_aware_normalises_load_by_capacity() -> None:
    # Both hold half the prefix; 6 outstanding on 8 slots is lighter than 2 on 1 slot.
    candidates = [cand("small", 2, capacity=1, cached=4), cand("big", 6, capacity=8, cached=4)]
    assert KVAware(role=ROLE).choose(req(0, pages=8), candidates) == "big"


def test_kv_aware_breaks_cost_ties_by_outstanding_then_worker_id() -> None:
    p = KVAware(role=ROLE)
    # a: 2 + 2/2 = 3; b: 2 + 4/4 = 3 -> equal cost, a has fewer outstanding.
    assert (
        p.choose(req(0, pages=4), [cand("b", 4, capacity=4, cached=2), cand("a", 2, capacity=2, cached=2)])
        == "a"
    )
    assert p.choose(req(0, pages=4), [cand("z", 1, cached=2), cand("y", 1, cached=2)]) == "y"
