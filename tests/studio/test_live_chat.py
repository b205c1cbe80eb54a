"""Chat against a live studio (daphne in a subprocess) hosting a deployment of
`workflows/chat.py` on real role workers: the `openai` package's client on
`/v1/chat/completions` (streaming and not) and `/v1/models`, server-side sessions,
`/ws/metrics/`, and bad input. Greedy replies are checked against Hugging Face
`generate` on the same tiny model. A deployment of `workflows/vision_chat.py` answers messages
with an `image_url` part; its replies are checked against the same pipeline run in process."""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import json
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
import torch
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect as ws_connect

from engine.compute.models import load_builtin
from engine.flow.dispatch import InProcessDispatcher
from engine.flow.executor import Executor
from engine.flow.validate import parse_spec
from engine.spec.kinds import default_kinds
from studio.accounts.models import ApiToken
from tests.studio.factories import example_spec
from tests.studio.livestudio import LiveStudio, poll, wait_running
from tests.studio.test_live_server import Server, scrape

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis,
              pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL (worker metrics)")]
MODEL = "tiny-chat"
NEW = 8


@pytest.fixture
def server(live_studio: LiveStudio) -> Iterator[Server]:
    with live_studio.serving() as server:
        yield server


def hf_reply(prompt: str, new: int) -> str:
    """The greedy reply of Hugging Face `generate` on the built-in model (the reference)."""
    loaded = load_builtin("tiny-llama")
    ids = torch.tensor([loaded.tokenizer(prompt).input_ids])
    with torch.no_grad():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                    eos_token_id=list(loaded.eos_token_ids), pad_token_id=loaded.eos_token_ids[0])
    return loaded.tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


def raw(server: Server, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, Any]:
    request = urllib.request.Request(server.base + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def llm_workers(server: Server, deployment_id: str, token: str) -> list[dict[str, Any]]:
    status, workers = server.request("GET", f"/api/workers/?deployment={deployment_id}&role=llm", token=token)
    assert status == 200, workers
    return workers


def wait_workers(server: Server, deployment_id: str, token: str, ready: Callable[[Any], bool]) -> list[Any]:
    return poll(server, lambda: llm_workers(server, deployment_id, token), ready,
                f"the llm workers of {deployment_id} as expected")


async def first_metrics(url: str, token: str) -> dict[str, Any]:
    async with ws_connect(url, additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=10) as ws:
        history = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert history["type"] == "history" and history["range"] == "5m", history  # the studio's history first
        while True:  # the first messages may predate the heartbeat that counts the turns' KV pages
            message = json.loads(await asyncio.wait_for(ws.recv(), 10))
            if message["workers"] and all(w["load"]["metrics"].get("device.pages_used", 0) > 0
                                          for w in message["workers"] if w["info"]["role"] == "llm"):
                return message


def test_openai_client_sessions_and_metrics_against_a_live_chat_deployment(server: Server, user: Any) -> None:
    token = ApiToken.objects.issue(user, "live-chat").secret
    status, wf = server.request("POST", "/api/workflows/", {"spec": example_spec("chat", tiny=True)}, token)
    assert status == 201, wf
    status, d = server.request("POST", "/api/deployments/", {"workflow": wf["id"], "name": MODEL}, token)
    assert status == 201, d
    d = wait_running(server, d["id"], token)
    assert d["status"] == "running" and d["chat"] is True, d

    client = openai.OpenAI(base_url=server.base + "/v1", api_key=token, max_retries=0, timeout=60)
    listed = client.models.list().data
    assert [m.id for m in listed] == [MODEL]
    assert (listed[0].owned_by, listed[0].deployment, listed[0].workflow, listed[0].version, listed[0].status) == (
        user.username, d["id"], "chat", 1, "running")
    # tiny-llama: random weights, for testing
    assert (listed[0].weights, listed[0].weights_label, listed[0].random_weights_roles) == (
        "random", "random weights (for testing)", ["llm"])

    messages = [{"role": "user", "content": "Hello"}]
    reference = hf_reply("### User:\nHello\n\n### Assistant:\n", NEW)
    done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0)
    assert done.object == "chat.completion" and done.model == MODEL
    assert done.choices[0].message.content == reference
    assert done.usage.prompt_tokens == len(b"### User:\nHello\n\n### Assistant:\n")  # one token a byte
    assert done.usage.completion_tokens == NEW and done.choices[0].finish_reason == "length"
    # The deployment's id reaches it as its name does (what /v1/models lists as `deployment`).
    by_id = client.chat.completions.create(model=d["id"], messages=messages, max_tokens=NEW, temperature=0)
    assert by_id.model == d["id"] and by_id.choices[0].message.content == reference

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) > 1 and "".join(deltas) == reference  # token by token
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == done.usage.total_tokens

    # bad input, as the client sees it
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=messages)
    png = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()
    for bad in (dict(messages=[]), dict(messages=[{"role": "robot", "content": "x"}]),
                dict(messages=messages, temperature=5), dict(messages=messages, n=2),
                dict(messages=messages, max_tokens=0), dict(messages=messages, stop=[""]),
                dict(messages=messages, tools=[{"type": "function", "function": {"name": "f"}}]),
                dict(messages=[{"role": "user", "content": [{"type": "image_url",
                                                             "image_url": {"url": "http://x/a.png"}}]}]),
                dict(messages=[{"role": "user", "content": [{"type": "text", "text": "see"},
                                                            {"type": "image_url", "image_url": {"url": png}}]}])):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, **bad)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0).models.list()
    assert raw(server, "POST", "/v1/chat/completions", b"{", {"Content-Type": "application/json",
                                                              "Authorization": f"Bearer {token}"})[0] == 400
    assert raw(server, "GET", "/v1/chat/completions", None, {"Authorization": f"Bearer {token}"})[0] == 405
    status, body = raw(server, "POST", "/v1/chat/completions", b"{}", {"Content-Type": "application/json"})
    assert status == 401 and body["error"]["type"] == "authentication_error"

    # a session keeps the history server-side: turn 2 sends only the new message, and its
    # reply equals the stateless completion of the whole conversation
    status, session = server.request("POST", "/api/sessions/", {"deployment": d["id"], "title": "t"}, token)
    assert status == 201, session
    turns_url = session["links"]["turns"]
    status, first = server.request("POST", turns_url, {"content": "Hello", "max_tokens": NEW}, token)
    assert status == 201, first
    assert first["message"]["content"] == reference
    status, second = server.request("POST", turns_url, {"content": "And?", "max_tokens": NEW}, token)
    assert status == 201, second
    history = [*messages, {"role": "assistant", "content": reference}, {"role": "user", "content": "And?"}]
    whole = client.chat.completions.create(model=MODEL, messages=history, max_tokens=NEW, temperature=0)
    assert second["message"]["content"] == whole.choices[0].message.content
    assert second["usage"]["prompt_tokens"] == whole.usage.prompt_tokens  # the session's history counts

    # the llm worker is killed and replaced (supervision): the next turn reaches a worker that
    # never held the session, and rebuilds it from the history the turn brings
    (llm,) = llm_workers(server, d["id"], token)
    os.kill(llm["info"]["pid"], signal.SIGKILL)
    (fresh,) = wait_workers(server, d["id"], token, lambda ws: len(ws) == 1 and ws[0]["info"]["pid"] != llm["info"]["pid"])
    status, third = server.request("POST", turns_url, {"content": "Go on", "max_tokens": NEW}, token)
    assert status == 201, third
    history += [{"role": "assistant", "content": second["message"]["content"]}, {"role": "user", "content": "Go on"}]
    whole = client.chat.completions.create(model=MODEL, messages=history, max_tokens=NEW, temperature=0)
    assert third["message"]["content"] == whole.choices[0].message.content
    assert third["usage"]["prompt_tokens"] == whole.usage.prompt_tokens
    wait_workers(server, d["id"], token, lambda ws: [w["load"]["metrics"].get("llm.sessions_resumed") for w in ws] == [1])
    status, got = server.request("GET", session["links"]["self"], token=token)
    assert [m["role"] for m in got["messages"]] == ["user", "assistant"] * 3 and got["turns"] == 3
    assert server.request("POST", turns_url, {"content": ""}, token)[0] == 201  # an empty turn is a turn
    assert server.request("POST", turns_url, {"text": "x"}, token)[0] == 400
    assert server.request("POST", turns_url, {"content": 5}, token)[0] == 400
    assert server.request("POST", turns_url, {"content": "x", "temperature": -1}, token)[0] == 400
    assert server.request("POST", turns_url, {"content": "x"}, None)[0] == 401
    assert server.request("POST", session["links"]["close"], None, token)[1]["closed"] is True
    assert server.request("POST", turns_url, {"content": "x"}, token)[0] == 409
    assert server.request("POST", "/api/sessions/", {"deployment": "x"}, token)[0] == 400

    # live worker metrics, with the gauge names the Cluster page charts
    message = asyncio.run(first_metrics(server.base.replace("http://", "ws://") + "/ws/metrics/", token))
    assert message["type"] == "workers"
    roles = {w["info"]["role"]: w for w in message["workers"]}
    assert set(roles) == {"llm", "py"} and {(w["deployment"], w["deployment_name"]) for w in message["workers"]} == {(d["id"], d["name"])}
    gauges = roles["llm"]["load"]["metrics"]
    assert 0.0 <= gauges["device.hit_rate"] <= 1.0 and gauges["device.pages_used"] > 0
    text = scrape(server.base)
    assert f'omniflow_kv_hit_rate{{deployment="{d["id"]}",role="llm",' in text
    occupancy = {s.labels["tier"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "omniflow_kv_occupancy" and s.labels["worker"] == fresh["info"]["worker_id"]}
    assert set(occupancy) == {"device", "host", "disk"} and occupancy["device"] > 0  # workflows/chat.py's tiers
    # the history the studio keeps (in Redis: one sampler for the cluster), both llm workers'
    status, history = server.request("GET", f"/api/metrics/history/?range=5m&deployment={d['id']}", token=token)
    assert status == 200, history
    series = {w["worker_id"]: w for w in history["workers"]}
    assert {llm["info"]["worker_id"], fresh["info"]["worker_id"]} <= set(series)  # the killed one too
    last = series[fresh["info"]["worker_id"]]["points"][-1]
    assert set(last["tiers"]) == {"device", "host", "disk"} and last["tiers"]["device"]["pages_used"] > 0
    assert last["rss_bytes"] > 0
    assert 'omniflow_node_latency_seconds_count{kind="llm"}' in text

    status, stopped = server.request("POST", f"/api/deployments/{d['id']}/stop/", None, token)
    assert status == 200
    assert wait_running(server, d["id"], token)["status"] in ("stopping", "stopped")
    assert [m.id for m in client.models.list()] == []


def picture_png(width: int = 40, height: int = 28) -> bytes:
    """A PNG made here: a red-to-blue gradient with a green square."""
    img = Image.new("RGB", (width, height))
    img.putdata([(255 * x // (width - 1), 60, 255 - 255 * x // (width - 1)) for _ in range(height) for x in range(width)])
    img.paste((20, 220, 40), (8, 6, 20, 18))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def pipeline_reply(spec: dict[str, Any], prompt: str, image: bytes, new: int) -> dict[str, Any]:
    """The vision chat pipeline run directly through the engine, in this process (the reference):
    the same prompt and picture, greedy, `new` tokens."""
    spec = copy.deepcopy(spec)
    reply = next(n for n in spec["nodes"] if n["id"] == "reply")
    reply["params"] = {**reply.get("params", {}), "max_new_tokens": new, "temperature": 0.0}
    kinds = default_kinds()

    async def run() -> dict[str, Any]:
        executor = Executor(InProcessDispatcher(kinds), kinds)
        try:
            result = await (await executor.submit(parse_spec(spec), {"prompt": prompt, "image": image})).wait()
        finally:
            await executor.aclose()
        assert result.status == "done", result.error
        return result.outputs

    return asyncio.run(run())


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def test_openai_client_sends_an_image_part_to_a_live_vision_chat_deployment(server: Server, user: Any) -> None:
    token = ApiToken.objects.issue(user, "live-vision").secret
    spec = example_spec("vision_chat", tiny=True)
    status, wf = server.request("POST", "/api/workflows/", {"spec": spec}, token)
    assert status == 201, wf
    status, d = server.request("POST", "/api/deployments/", {"workflow": wf["id"], "name": "tiny-vision"}, token)
    assert status == 201, d
    picture = picture_png()
    question = [{"type": "text", "text": "What is in the picture?"},
                {"type": "image_url", "image_url": {"url": data_url(picture)}}]
    prompt = "### User:\nWhat is in the picture?\n\n### Assistant:\n"  # the simple template, written out
    reference = pipeline_reply(spec, prompt, picture, NEW)  # while the deployment's workers start
    d = wait_running(server, d["id"], token)
    assert d["status"] == "running" and d["chat"] is True, d

    client = openai.OpenAI(base_url=server.base + "/v1", api_key=token, max_retries=0, timeout=60)
    done = client.chat.completions.create(model="tiny-vision", messages=[{"role": "user", "content": question}],
                                          max_tokens=NEW, temperature=0)
    assert done.choices[0].message.content == reference["text"] and reference["text"]
    assert done.usage.completion_tokens == NEW
    assert done.usage.prompt_tokens == reference["usage"]["prompt_tokens"]
    assert done.usage.prompt_tokens > len(prompt.encode())  # the picture's placeholders count: it was spliced in
    chunks = list(client.chat.completions.create(model="tiny-vision", max_tokens=NEW, temperature=0, stream=True,
                                                 messages=[{"role": "user", "content": question}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference["text"]

    # bad images: the documented OpenAI-shaped JSON error, naming the part, before any run starts
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    bad_parts = {
        "data:image/png;base64,@@not-base64@@": "not valid base64",
        "data:image/png,rawbytes": "must be base64",
        data_url(b"just some text, not a picture"): "not in a format",
        data_url(b"hello", "text/plain"): "not an image",
        data_url(picture[: len(picture) // 2]): "broken",
        "https://example.com/cat.png": "only data: URLs",
    }
    for url, why in bad_parts.items():
        body = {"model": "tiny-vision", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": url}}]}]}
        status, error = raw(server, "POST", "/v1/chat/completions", json.dumps(body).encode(), headers)
        assert status == 400, (url, error)
        assert error["error"]["type"] == "invalid_request_error" and error["error"]["param"] == (
            "messages[0].content[1]"), error
        assert why in error["error"]["message"], (why, error)
    with pytest.raises(openai.BadRequestError, match="takes 1 image"):
        client.chat.completions.create(model="tiny-vision", messages=[{"role": "user", "content": [
            *question, {"type": "image_url", "image_url": {"url": data_url(picture)}}]}])
    with pytest.raises(openai.UnprocessableEntityError):  # the picture is a required input
        client.chat.completions.create(model="tiny-vision", messages=[{"role": "user", "content": "hi"}])
    status, runs = server.request("GET", f"/api/runs/?deployment={d['id']}", token=token)
    assert status == 200 and runs["count"] == 2, runs  # only the two good completions ran

    status, _ = server.request("POST", f"/api/deployments/{d['id']}/stop/", None, token)
    assert status == 200
    assert wait_running(server, d["id"], token)["status"] in ("stopping", "stopped")


def test_openai_client_against_a_live_prefill_decode_chat_deployment(server: Server, user: Any) -> None:
    """A deployment of `workflows/pd_chat.py` is a chat model: the prefill role computes the rendered
    conversation and the decode role, another worker, pulls its pages and answers; greedy, the
    answer is Hugging Face's, streamed or not, and the request's `max_tokens` reaches the pair (the
    prefill node samples with it, the decode node continues). It keeps no sessions: opening one is
    refused, naming why."""
    token = ApiToken.objects.issue(user, "live-pd").secret
    status, wf = server.request("POST", "/api/workflows/", {"spec": example_spec("pd_chat", tiny=True)}, token)
    assert status == 201, wf
    status, d = server.request("POST", "/api/deployments/", {"workflow": wf["id"], "name": "pd"}, token)
    assert status == 201, d
    d = wait_running(server, d["id"], token)
    assert d["status"] == "running" and d["chat"] is True, d

    client = openai.OpenAI(base_url=server.base + "/v1", api_key=token, max_retries=0, timeout=60)
    assert "pd" in [m.id for m in client.models.list().data]
    messages = [{"role": "user", "content": "Hello"}]
    reference = hf_reply("### User:\nHello\n\n### Assistant:\n", NEW)
    done = client.chat.completions.create(model="pd", messages=messages, max_tokens=NEW, temperature=0)
    assert done.choices[0].message.content == reference
    assert done.usage.completion_tokens == NEW and done.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="pd", messages=messages, max_tokens=NEW, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference

    status, refused = server.request("POST", "/api/sessions/", {"deployment": d["id"], "title": "t"}, token)
    assert status == 400 and "keeps no sessions" in json.dumps(refused), refused
    status, _ = server.request("POST", f"/api/deployments/{d['id']}/stop/", None, token)
    assert status == 200
