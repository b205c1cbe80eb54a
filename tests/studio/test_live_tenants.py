"""Tenants against a live studio (daphne in a subprocess) hosting a deployment of
`workflows/chat.py` on real role workers, through the `openai` client on `/v1/chat/completions`:
two users, one deployment, one prompt: the second user's `cached_tokens` is 0 while the first
user's repeat hits; once staff mark the deployment's cache shared, each hits the other's pages."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from studio.accounts.models import ApiToken
from tests.studio.factories import example_spec
from tests.studio.livestudio import LiveStudio, wait_running
from tests.studio.test_live_server import Server

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis,
              pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL (the deployment's workers)")]
MODEL = "tenants-chat"
SECRET = [{"role": "user", "content": "The launch code is 4242-7319, keep it safe."}]
PAGES = 4  # of 16 tokens (one a byte) in the rendered prompt, before its last token


@pytest.fixture
def server(live_studio: LiveStudio) -> Iterator[Server]:
    with live_studio.serving() as server:
        yield server


def cached(client: openai.OpenAI) -> int:
    done = client.chat.completions.create(model=MODEL, messages=SECRET, max_tokens=2, temperature=0)
    assert done.usage.prompt_tokens > PAGES * 16
    return done.usage.prompt_tokens_details.cached_tokens


def test_two_users_of_one_deployment_share_no_cache_unless_staff_share_it(server: Server,
                                                                          user: Any, staff: Any) -> None:
    owner = ApiToken.objects.issue(user, "live-tenants").secret
    root = ApiToken.objects.issue(staff, "live-tenants").secret
    status, wf = server.request("POST", "/api/workflows/", {"spec": example_spec("chat", tiny=True)}, owner)
    assert status == 201, wf
    status, d = server.request("POST", "/api/deployments/", {"workflow": wf["id"], "name": MODEL}, owner)
    assert status == 201, d
    d = wait_running(server, d["id"], owner)
    assert d["status"] == "running" and d["cache_scope"] == "user", d

    def client(token: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=server.base + "/v1", api_key=token, max_retries=0, timeout=60)

    mine, theirs = client(owner), client(root)  # staff may use any deployment: one llm worker for both
    assert cached(mine) == 0
    assert cached(mine) == PAGES * 16  # the owner's repeat hits
    assert cached(theirs) == 0  # the same prompt of another user: nothing to tell it was asked before
    assert cached(theirs) == PAGES * 16

    url = f"/api/deployments/{d['id']}/cache-scope/"
    assert server.request("POST", url, {"cache_scope": "shared"}, owner)[0] == 403  # not the owner's to share
    status, shared = server.request("POST", url, {"cache_scope": "shared"}, root)
    assert status == 200 and shared["cache_scope"] == "shared", shared
    assert cached(mine) == 0  # a new scope: nothing either user cached before is in it
    assert cached(theirs) == PAGES * 16  # the deployment's users now share one cache
    assert cached(mine) == PAGES * 16

    assert server.request("POST", f"/api/deployments/{d['id']}/stop/", None, owner)[0] == 200
