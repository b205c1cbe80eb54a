"""The chat pieces without a server: OpenAI request checking, prompt templates (simple, a
checkpoint's, and smollm2-135m's own, against `tokenizer.apply_chat_template`), session turns
that send only the new text, chat shapes."""

from __future__ import annotations

import base64
import copy
import dataclasses
import io
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from transformers import AutoTokenizer

from engine.compute.models.cache import ModelCache
from engine.compute.models.packaged import PACKAGED_MODELS
from engine.compute.models.tokenizer import build_byte_tokenizer
from studio.workflows.chat.openai import ChatSampling, OpenAIError, parse_chat_request
from studio.workflows.chat.shape import NotAChatWorkflow, chat_shape
from studio.workflows.chat.templates import ChatTemplates, TemplateError
from studio.workflows.chat.turns import LLMTurn
from tests.pictures import claimed_png
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
    assert chat.sampling == ChatSampling(max_new_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=("\n",),
                                         presence_penalty=1.0, frequency_penalty=-1.0)
    assert chat.sampling.node_params() == {"max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3,
                                           "stop": ["\n"], "presence_penalty": 1.0, "frequency_penalty": -1.0}
    assert parse_chat_request(request()).sampling.node_params() == {}  # the llm node's own params hold
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


def test_a_picture_whose_header_claims_more_pixels_than_the_limit_is_refused_before_decoding() -> None:
    with pytest.raises(OpenAIError, match="4097x4097 pixels, over the limit") as caught:
        parse_chat_request(request(messages=[{"role": "user", "content": [image_part(claimed_png(4097, 4097))]}]))
    assert caught.value.param == "messages[0].content[0]"
    parse_chat_request(request(messages=[{"role": "user", "content": [image_part(png_bytes((64, 64)))]}]))


def test_simple_template_and_session_turns() -> None:
    t = ChatTemplates().get("tiny-llama")
    assert t.name == "simple" and t.eos_token_ids == {257}
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
    # a reply that ended on the EOS token: the LLM holds it, and the template's own end follows it
    ended = [*history[:-1], {"role": "assistant", "content": " r1", "eos": t.eos_text(257)}]
    assert t.eos_text(257) == "<|eos|>" and t.eos_text(65) is None and t.eos_text(None) is None
    assert t.held(ended) == first + " r1<|eos|>" and t.turn(ended, new) == increment


def test_a_checkpoint_template_is_rendered_like_transformers(tmp_path: Path) -> None:
    source = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
              "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = source
    tokenizer.save_pretrained(tmp_path)
    t = ChatTemplates().get(str(tmp_path))
    assert t.name == "model"
    assert t.render(USER) == "<|bos|><|user|>hi<|eos|><|assistant|>"
    turn = t.turn([*USER, {"role": "assistant", "content": "yo"}], [{"role": "user", "content": "more"}])
    assert turn == "<|eos|><|user|>more<|eos|><|assistant|>"
    eos = t.turn([*USER, {"role": "assistant", "content": "yo", "eos": "<|eos|>"}], [{"role": "user", "content": "m"}])
    assert eos == "<|user|>m<|eos|><|assistant|>"
    for bad in ("{{ raise_exception('no system messages') }}", "{{ messages.__class__.__mro__ }}"):
        tokenizer.chat_template = bad
        tokenizer.save_pretrained(tmp_path / "bad")
        with pytest.raises(TemplateError):
            ChatTemplates().get(str(tmp_path / "bad")).render(USER)


def test_smollm2_renders_with_its_own_template_and_session_turns_add_what_the_whole_conversation_adds(
        smollm2_cache: ModelCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference is the checkpoint's tokenizer itself (`apply_chat_template`), loaded here."""
    monkeypatch.setenv("OMNIFLOW_CACHE_DIR", str(smollm2_cache.config.root))
    reference = AutoTokenizer.from_pretrained(smollm2_cache.directory(PACKAGED_MODELS["smollm2-135m"]),
                                              local_files_only=True)
    t = ChatTemplates().get("smollm2-135m")
    assert t.name == "model" and t.eos_token_ids == {2} and t.eos_text(2) == "<|im_end|>"

    def whole(messages: list[dict[str, str]]) -> str:
        return reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    first = [{"role": "user", "content": "What is the capital of France?"}]
    system = [{"role": "system", "content": "Answer in one word."}, *first]
    developer = [{"role": "developer", "content": "Answer in one word."}, *first]
    assert t.render(first) == whole(first) and t.render(system) == whole(system) == t.render(developer)
    assert t.render(first).startswith("<|im_start|>system\n")  # the template's default system prompt
    reply = "The capital of France is Paris."
    new = [{"role": "user", "content": "And of Italy?"}]
    conversation = whole([*first, {"role": "assistant", "content": reply}, *new])
    encode = t.codec.encode
    # The reply ended on EOS: the LLM holds prompt + reply + <|im_end|>; the next turn adds the rest.
    ended = [*first, {"role": "assistant", "content": reply, "eos": "<|im_end|>"}]
    turn = t.turn(ended, new)
    assert t.turn([], first) + reply + "<|im_end|>" + turn == conversation
    assert turn.startswith("\n<|im_start|>user\nAnd of Italy?")
    # ... and as tokens: each part encoded on its own (as the engine does) is the whole conversation's
    assert encode(whole(first)) + encode(reply) + [2] + encode(turn) == encode(conversation)
    assert t.held(ended) == whole(first) + reply + "<|im_end|>"
    # A reply cut short by max_tokens (no EOS held): the turn closes it first.
    cut = [*first, {"role": "assistant", "content": reply}]
    assert whole(first) + reply + t.turn(cut, new) == conversation
    assert t.turn(cut, new).startswith("<|im_end|>\n<|im_start|>user")


def test_chat_shapes() -> None:
    shape = chat_shape(example_spec("chat"))
    assert (shape.prompt_input, shape.llm_node, shape.reply_output, shape.usage_output, shape.streams) == (
        "prompt", "reply", "text", "usage", True)
    assert shape.model == "smollm2-135m" and shape.image_inputs == () and shape.max_new_tokens == 256
    vision = chat_shape(example_spec("vision_chat"))
    assert (vision.prompt_input, vision.image_inputs, vision.llm_node, vision.reply_output) == (
        "prompt", ("image",), "reply", "text")
    with pytest.raises(NotAChatWorkflow) as caught:
        chat_shape(spec_doc())
    assert caught.value.problems == ["it needs exactly one node of kind 'llm' or one llm.prefill -> llm.decode pair"
                                     " (it has 0)"]
    dialogue = chat_shape(example_spec("omni_dialogue"))
    assert (dialogue.prompt_input, dialogue.llm_node, dialogue.reply_output) == ("message", "think", "reply_text")


def test_a_workflow_whose_llm_only_feeds_a_picture_is_no_chat_model() -> None:
    """image_generation has one llm, one text input and a text output (the rewritten prompt), but its
    result is an image: a chat reply would drop it."""
    with pytest.raises(NotAChatWorkflow) as caught:
        chat_shape(example_spec("image_generation"))
    assert caught.value.problems == ["its reply would drop its image or audio outputs (image): a chat reply is text"]


def test_the_reply_is_the_text_output_the_llm_text_reaches() -> None:
    """The reply output is the one fed by the llm node's text, through python nodes passing text;
    a text output fed by anything else (the prompt itself, the llm's kv) is no reply."""
    spec = copy.deepcopy(example_spec("chat"))
    echo = {"id": "echo", "kind": "output", "inputs": {"value": {"type": "text"}}}
    spec["nodes"].insert(0, echo)
    spec["edges"].append({"source": "prompt", "source_port": "value", "target": "echo", "target_port": "value"})
    assert chat_shape(spec).reply_output == "text"
    spec["edges"] = [e for e in spec["edges"] if e["target"] != "text"]
    with pytest.raises(NotAChatWorkflow) as caught:
        chat_shape(spec)
    assert caught.value.problems == ["it needs an output of type text fed by the text of its llm node 'reply'"]


def test_a_prefill_decode_pair_is_a_chat_model_without_sessions() -> None:
    """pd_chat generates with an llm.prefill -> llm.decode pair: the turn's sampling params go to
    the prefill node (the decode node continues with them), the reply is the decode node's text,
    the prompt is rendered for the prefill role's model, and the pair keeps no sessions."""
    shape = chat_shape(example_spec("pd_chat"))
    assert (shape.prompt_input, shape.llm_node, shape.sampled_node, shape.reply_output) == (
        "prompt", "decode", "prefill", "text")
    assert (shape.model, shape.max_new_tokens, shape.llm_usage, shape.sessions) == ("smollm2-135m", 32, True, False)
    assert chat_shape(example_spec("chat")).sampled_node == "reply" and chat_shape(example_spec("chat")).sessions


def test_a_prefill_or_decode_node_without_its_other_half_is_named() -> None:
    """A decode node fed by no prefill node, and a prefill node feeding no decode node, are each
    named; a pair beside an llm node is two generators."""
    spec = copy.deepcopy(example_spec("pd_chat"))
    spec["edges"] = [e for e in spec["edges"] if e["target"] != "decode"]
    with pytest.raises(NotAChatWorkflow) as caught:
        chat_shape(spec)
    assert caught.value.problems[:2] == ["its llm.decode node 'decode' needs the kv of one llm.prefill node",
                                         "its llm.prefill node 'prefill' feeds no llm.decode node"]
    both = copy.deepcopy(example_spec("pd_chat"))
    chat = example_spec("chat")
    both["roles"] += chat["roles"]
    both["nodes"].append(next(n for n in chat["nodes"] if n["kind"] == "llm"))
    with pytest.raises(NotAChatWorkflow) as caught:
        chat_shape(both)
    assert "(it has 2)" in caught.value.problems[0]


def test_a_turn_makes_the_llm_nodes_params_from_the_checked_request() -> None:
    """What the run stores for the llm node comes from the typed request, and the turn's token
    limit is the request's, else the node's own, else the llm kind's default."""
    sampling = parse_chat_request(request(max_tokens=5, temperature=0, stop=["x", "y"])).sampling
    assert LLMTurn(sampling).node_params() == {"max_new_tokens": 5, "temperature": 0.0, "stop": ["x", "y"]}
    assert LLMTurn(sampling, "studio-1", "S: hi", 1).node_params() == {
        "max_new_tokens": 5, "temperature": 0.0, "stop": ["x", "y"], "session": "studio-1",
        "session_history": "S: hi", "session_turns": 1}
    assert LLMTurn(ChatSampling(), "studio-1").node_params() == {"session": "studio-1"}
    shape = chat_shape(example_spec("chat"))
    assert LLMTurn(sampling).max_new_tokens(shape) == 5
    assert LLMTurn(ChatSampling()).max_new_tokens(shape) == 256
    assert LLMTurn(ChatSampling()).max_new_tokens(dataclasses.replace(shape, max_new_tokens=None)) == 16
