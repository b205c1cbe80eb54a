"""A node call's tenant: the run's wins over a node's param, and it scopes session keys."""

from __future__ import annotations

import msgspec

from engine.data import wire
from engine.spec.calls import NodeCall, node_tenant, session_key


def call(params: dict, tenant: str | None) -> NodeCall:
    return NodeCall("r", "n", None, params, {}, ("out",), False, False, 1, 1, tenant)


def test_the_runs_tenant_wins_over_a_node_param():
    assert node_tenant("user:2", {"tenant": "user:1"}) == "user:2"
    assert node_tenant("user:2", {}) == "user:2"
    assert node_tenant(None, {"tenant": "mine"}) == "mine"  # the command line, as before
    assert node_tenant(None, {"tenant": 5}) is None and node_tenant(None, {}) is None


def test_a_session_is_keyed_within_its_tenant():
    a, b = call({"session": "s1"}, "user:1"), call({"session": "s1"}, "user:2")
    assert a.session_key() == session_key("user:1", "s1") != b.session_key()
    assert call({"session": "s1"}, None).session_key() == "s1"
    assert call({}, "user:1").session_key() is None and call({"session": 3}, "user:1").session_key() is None
    # no tenant's id and session id make another's key (the pair is encoded, not joined)
    assert session_key("user:1", "s1") != session_key("user:1:s1", "") != session_key("user", "1:s1")


def test_the_call_travels_to_workers_as_one_header():
    """The worker's call is the dispatcher's, field for field: tenant and kind included."""
    sent = NodeCall("r", "n", None, {"max_new_tokens": 3}, {"prompt": "hi"}, ("out",), False, False, 2, 1,
                    tenant="user:1", kind="llm")
    request = wire.ExecuteRequest(1, "llm", sent.header(), {})
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=wire.ExecuteRequest)
    assert NodeCall.of(decoded.call, {"prompt": "hi"}) == sent
    bare = NodeCall("r", "n", None, {}, {}, ("out",), False, False, 1, 1)
    assert (bare.header().tenant, bare.header().kind) == (None, None)
