"""The chat pieces without a server: OpenAI request checking, prompt templates (simple and a
checkpoint's Jinja template), session turns that send only the new text, chat shapes."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from studio.workflows.chat.openai import OpenAIError, parse_chat_request
from studio.workflows.chat.shape import NotAChatWorkflow, chat_shape
from studio.workflows.chat.templates import ChatTemplate, template_for
from tests.studio.factories import example_spec, spec_doc

USER = [{"role": "user", "content": "hi"}]


def request(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, **fields}


def png_bytes(size: tuple[int, int] = (6, 4)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (200, 40, 90)).save(out, format="PNG")
    return out.getvalue()


def image_part(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    url = f"data:{media_type};base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def test_a_full_request_maps_to_llm_params() -> None:
    png = png_bytes()
    chat = parse_chat_request(request(
        messages=[{"role": "system", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "look: "}, image_part(png),
                                               {"type": "text", "text": "ok?"}]}],
        max_completion_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop="\n", presence_penalty=1,
        frequency_penalty=-1, stream=True, stream_options={"include_usage": True}, user="u", n=1))
    assert chat.conversation.messages == [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "look: ok?"}]
    assert chat.conversation.images == [png]
    assert chat.sampling == {"max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["\n"],
                             "presence_penalty": 1.0, "frequency_penalty": -1.0}
    assert chat.stream and chat.include_usage


@pytest.mark.parametrize(("body", "param"), [
    ([], None),
    ({"messages": USER}, "model"),
    (request(model=" "), "model"),
    (request(messages=[]), "messages"),
    (request(messages="hi"), "messages"),
    (request(messages=[{"role": "assistant", "content": "x"}]), "messages"),
    (request(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
    (request(messages=[{"role": "user", "content": None}]), "messages[0].content"),
    (request(messages=[{"role": "user", "content": [{"type": "audio"}]}]), "messages[0].content[0]"),
    (request(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]),
     "messages[0].content[0]"),
    (request(messages=[{"role": "user", "content": [{"type": "image_url",
                                                     "image_url": {"url": "data:image/png;base64,@@"}}]}]),
     "messages[0].content[0]"),
    (request(messages=[{"role": "assistant", "content": [{"type": "image_url", "image_url": "data:,x"}]}, *USER]),
     "messages[0].content[0]"),
    (request(messages=[{"role": "user", "content": [image_part(b"hello", "text/plain")]}]), "messages[0].content[0]"),
    (request(messages=[{"role": "user", "content": [image_part(b"hello")]}]), "messages[0].content[0]"),
    (request(messages=[{"role": "user", "content": [image_part(png_bytes()[:-20])]}]), "messages[0].content[0]"),
    (request(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                    image_part(png_bytes()[:40])]}]), "messages[0].content[1]"),
    (request(max_tokens=0), "max_tokens"),
    (request(max_tokens=True), "max_tokens"),
    (request(max_tokens=10**9), "max_tokens"),
    (request(temperature=2.5), "temperature"),
    (request(temperature="1"), "temperature"),
    (request(top_p=0), "top_p"),
    (request(seed=-1), "seed"),
    (request(stop=["a", "b", "c", "d", "e"]), "stop"),
    (request(stop=[""]), "stop"),
    (request(presence_penalty=3), "presence_penalty"),
    (request(n=2), "n"),
    (request(stream="yes"), "stream"),
    (request(stream_options={"include_usage": True}), "stream_options"),
    (request(tools=[{"type": "function"}]), "tools"),
    (request(logprobs=True), "logprobs"),
    (request(response_format={"type": "json_object"}), "response_format"),
])
def test_bad_requests_name_their_field(body: Any, param: str | None) -> None:
    with pytest.raises(OpenAIError) as caught:
        parse_chat_request(body)
    assert caught.value.status == 400 and caught.value.param == param
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


def test_simple_template_and_session_turns() -> None:
    t = template_for("tiny-llama")
    assert t.name == "simple"
    history = [{"role": "system", "content": "S"}, {"role": "user", "content": "A"}]
    first = t.render(history)
    assert first == "### System:\nS\n\n### User:\nA\n\n### Assistant:\n"
    assert t.turn([], history) == t.turn([{"role": "system", "content": "S"}], history[1:]) == first
    history += [{"role": "assistant", "content": " r1"}]
    new = [{"role": "user", "content": "B"}]
    increment = t.turn(history, new)
    # what the LLM holds (the first prompt and its reply) + the increment = the whole conversation
    assert first + " r1" + increment == t.render(history + new)
    assert increment == "\n\n### User:\nB\n\n### Assistant:\n"


def test_a_checkpoint_template_is_rendered_like_transformers(tmp_path: Path) -> None:
    source = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
              "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source, "bos_token": "<s>",
                                                               "eos_token": {"content": "</s>"}}))
    t = template_for(str(tmp_path))
    assert t.name == "model"
    assert t.render(USER) == "<s><|user|>hi</s><|assistant|>"
    turn = t.turn([*USER, {"role": "assistant", "content": "yo"}], [{"role": "user", "content": "more"}])
    assert turn == "</s><|user|>more</s><|assistant|>"
    bad = ChatTemplate("{{ raise_exception('no system messages') }}")
    with pytest.raises(ValueError, match="no system messages"):
        bad.render(USER)
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError):
        sandboxed.render(USER)


def test_chat_shapes() -> None:
    shape = chat_shape(example_spec("chat"))
    assert (shape.prompt_input, shape.llm_node, shape.reply_output, shape.usage_output, shape.streams) == (
        "prompt", "reply", "text", "usage", True)
    assert shape.model == "tiny-llama" and shape.image_inputs == ()
    vision = chat_shape(example_spec("vision_chat"))
    assert (vision.prompt_input, vision.image_inputs, vision.llm_node, vision.reply_output) == (
        "prompt", ("image",), "reply", "text")
    with pytest.raises(NotAChatWorkflow) as caught:
        chat_shape(spec_doc())
    assert caught.value.problems == ["it needs exactly one node of kind 'llm' (it has 0)"]
