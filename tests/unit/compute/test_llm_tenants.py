"""Tenants on one `llm` unit (the flow executor in process, as the studio's runs without a
deployment share it): a run's tenant salts its page keys and scopes its sessions, so another
tenant's identical prompt gets no cached token while the first tenant's repeat hits."""

from __future__ import annotations

from typing import Any

import pytest

from engine.compute.kinds import register
from engine.flow.dispatch import InProcessDispatcher
from engine.flow.dsl import Workflow
from engine.flow.executor import Executor
from engine.spec.calls import session_key
from engine.spec.graph import RoleSpec
from engine.spec.kinds import default_kinds
from tests.unit.compute.conftest import prompt_ids

PAGE = 4
NEW = 4
PROMPT = prompt_ids(90, 21)  # 5 full pages before the last prompt token


@pytest.fixture
def kinds():
    registry = default_kinds(load_entry_points=False)
    register(registry)
    return registry


@pytest.fixture
def units() -> list[Any]:
    return []


@pytest.fixture
async def executor(kinds, units):
    def build(role: RoleSpec) -> Any:
        units.append(kinds.role_kind(role.kind).load_runner()(role))
        return units[-1]

    ex = Executor(InProcessDispatcher(kinds, build=build), kinds)
    yield ex
    await ex.aclose()


def workflow(params: dict[str, Any] | None = None) -> Workflow:
    wf = Workflow("tenants")
    llm = wf.role("llm", kind="llm", model="tiny-llama", params={"page_size": PAGE})
    gen = wf.node("gen", "llm", role=llm, params={"max_new_tokens": NEW, **(params or {})})
    wf.edge(wf.input("prompt", "tokens"), gen.inp("tokens"))
    wf.output("tokens", gen.out("tokens"), "tokens")
    wf.output("kv", gen.out("kv"), "kv")
    return wf


async def usage(executor: Executor, tokens: list[int], tenant: str | None, params: dict | None = None) -> dict:
    result = await (await executor.submit(workflow(params).to_spec(), {"prompt": tokens}, tenant=tenant)).wait()
    assert result.status == "done", result.error
    return {**result.outputs["kv"].to_json(), "tokens": result.outputs["tokens"]}


async def test_another_tenants_identical_prompt_gets_no_cached_token(executor, tiny_llama):
    first = await usage(executor, PROMPT, "user:1")
    assert first["cached_tokens"] == 0
    assert (await usage(executor, PROMPT, "user:1"))["cached_tokens"] == 5 * PAGE  # the owner's repeat hits
    other = await usage(executor, PROMPT, "user:2")
    assert other["cached_tokens"] == 0 and other["tokens"] == first["tokens"]  # same answer, nothing of user:1's
    assert not set(other["page_hashes"]) & set(first["page_hashes"])
    assert (await usage(executor, PROMPT, "user:2"))["cached_tokens"] == 5 * PAGE  # and now its own repeat hits
    assert (await usage(executor, PROMPT, None))["cached_tokens"] == 0  # no tenant is a namespace of its own


async def test_a_node_param_cannot_choose_another_tenants_cache(executor, tiny_llama):
    """A graph that names user:1 in its `tenant` param still runs as its run's tenant."""
    await usage(executor, PROMPT, "user:1")
    stolen = await usage(executor, PROMPT, "user:2", {"tenant": "user:1"})
    assert stolen["cached_tokens"] == 0
    # without a run tenant (the command line) the param namespaces a person's own runs, as before
    assert (await usage(executor, PROMPT, None, {"tenant": "user:1"}))["cached_tokens"] == 5 * PAGE


async def test_one_session_id_of_two_tenants_is_two_sessions(executor, units, tiny_llama):
    mine, theirs = prompt_ids(91, 9), prompt_ids(92, 6)
    first = await usage(executor, mine, "user:1", {"session": "s1"})
    assert first["prompt_tokens"] == len(mine)
    other = await usage(executor, theirs, "user:2", {"session": "s1"})
    assert other["prompt_tokens"] == len(theirs) and other["cached_tokens"] == 0  # none of user:1's history
    more = prompt_ids(93, 3)
    second = await usage(executor, more, "user:1", {"session": "s1"})
    assert second["prompt_tokens"] == len(mine) + NEW + len(more)  # user:1's session went on undisturbed
    assert second["cached_tokens"] >= 2 * PAGE
    (unit,) = units
    assert all(unit.engine.has_session(session_key(t, "s1")) for t in ("user:1", "user:2"))
    assert not unit.engine.has_session("s1")


def test_session_keys_tell_tenants_apart():
    keys = {session_key(t, s) for t in (None, "a", "a:b", "b") for s in ("s", "b:s", "x")}
    assert len(keys) == 12
    assert session_key(None, "s1") == "s1"  # the command line's session ids are as they were
