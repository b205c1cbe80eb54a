"""`/api/models/<model>/chat-template/` over REST: which template a model renders chat messages
with, and messages rendered with it (smollm2-135m's against its own tokenizer's
`apply_chat_template`, a checkpoint's by its name with a slash, the tiny models' simple one); bad
bodies are 400s naming their field, unknown or unreadable models 404s naming the model and no
server folder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient
from transformers import AutoTokenizer

from engine.compute.models.cache import ModelCache
from engine.compute.models.packaged import PACKAGED_MODELS
from engine.compute.models.tokenizer import build_byte_tokenizer
from studio.errors import BadRequest, Unavailable
from studio.workflows.api.chat_templates import MAX_CHARACTERS, MAX_MESSAGES
from studio.workflows.apps import StudioEngine
from studio.workflows.chat.shape import ChatShape
from studio.workflows.chat.turns import chat_template
from studio.workflows.models import Deployment
from tests.studio.limits import configured
from workflows.chat import wf as chat_workflow

pytestmark = pytest.mark.django_db

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def url(model: str) -> str:
    return f"/api/models/{model}/chat-template/"


def render(api: APIClient, model: str, body: Any) -> Any:
    return api.post(url(model), json.dumps(body), content_type="application/json")


@pytest.fixture
def model_root(tmp_path: Path) -> Path:
    """`org/chatty`: a checkpoint folder whose tokenizer has a chat template; `org/raises`: one whose
    template refuses every conversation; `org/no-tokenizer`: a config and nothing else."""
    root = tmp_path / "models"
    for name, source in (("org/chatty", TEMPLATE), ("org/raises", "{{ raise_exception('no conversations') }}")):
        tokenizer = build_byte_tokenizer()
        tokenizer.chat_template = source
        tokenizer.save_pretrained(root / name)
    for name in ("org/chatty", "org/raises", "org/no-tokenizer"):
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return root


@pytest.fixture
def rooted_engine(studio_engine: StudioEngine, model_root: Path) -> Iterator[StudioEngine]:
    """The studio's engine with `model_root` as its OMNIFLOW_MODEL_DIRS."""
    with configured(model_dirs=(model_root,)) as studio:
        yield studio


def test_smollm2_renders_a_plain_question_as_its_own_tokenizer_does(
        api, smollm2_cache: ModelCache, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNIFLOW_CACHE_DIR", str(smollm2_cache.config.root))
    reference = AutoTokenizer.from_pretrained(smollm2_cache.directory(PACKAGED_MODELS["smollm2-135m"]),
                                              local_files_only=True)

    def expected(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    info = api.get(url("smollm2-135m"))
    assert info.status_code == 200, info.content
    assert info.json() == {"model": "smollm2-135m", "template": "model", "generation_prompt": "<|im_start|>assistant\n"}
    rendered = render(api, "smollm2-135m", {"messages": QUESTION})
    assert rendered.status_code == 200, rendered.content
    assert rendered.json() == {"model": "smollm2-135m", "template": "model", "prompt": expected(QUESTION)}
    assert rendered.json()["prompt"].endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                                              "<|im_start|>assistant\n")
    system = [{"role": "system", "content": "Answer in one word."}, *QUESTION]
    developer = [{"role": "developer", "content": "Answer in one word."}, *QUESTION]
    assert render(api, "smollm2-135m", {"messages": developer}).json()["prompt"] == expected(system)
    conversation = [*QUESTION, {"role": "assistant", "content": "Paris."}]
    bare = render(api, "smollm2-135m", {"messages": conversation, "add_generation_prompt": False})
    assert bare.json()["prompt"] == expected(conversation, add_generation_prompt=False)


def test_the_tiny_models_render_with_the_simple_template(api) -> None:
    info = api.get(url("tiny-llama")).json()
    assert info == {"model": "tiny-llama", "template": "simple", "generation_prompt": "### Assistant:\n"}
    rendered = render(api, "tiny-llama", {"messages": [{"role": "system", "content": "S"}, *QUESTION]})
    assert rendered.json()["prompt"] == "### System:\nS\n\n### User:\nWhat is the capital of France?\n\n### Assistant:\n"


def test_a_checkpoint_is_named_as_a_role_names_it_with_its_slash(api, rooted_engine) -> None:
    info = api.get(url("org/chatty"))
    assert info.status_code == 200, info.content
    assert info.json() == {"model": "org/chatty", "template": "model", "generation_prompt": "<|assistant|>"}
    rendered = render(api, "org/chatty", {"messages": [{"role": "user", "content": "hi"}]})
    assert rendered.json()["prompt"] == "<|bos|><|user|>hi<|eos|><|assistant|>"
    refused = render(api, "org/raises", {"messages": QUESTION})
    assert refused.status_code == 400 and refused.json()["error"] == "model 'org/raises' cannot render these messages"
    [detail] = refused.json()["details"]
    assert detail["field"] == "messages" and "no conversations" in detail["message"]
    assert api.get(url("org/raises")).json()["generation_prompt"] == ""  # it renders nothing to compare


@pytest.mark.parametrize(("body", "field"), [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "What is the capital of France?"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [*QUESTION, {"role": "user"}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": QUESTION, "add_generation_prompt": "perhaps"}, "add_generation_prompt"),
    ({"messages": QUESTION * (MAX_MESSAGES + 1)}, "messages"),
    ({"messages": [{"role": "user", "content": "x" * (MAX_CHARACTERS + 1)}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x" * (MAX_CHARACTERS // 2)}] * 2
      + [{"role": "user", "content": "x"}]}, "messages"),
])
def test_a_bad_body_is_a_400_naming_its_field(api, body: Any, field: str) -> None:
    response = render(api, "tiny-llama", body)
    assert response.status_code == 400, response.content
    assert [d["field"] for d in response.json()["details"]] == [field], response.json()


def test_a_model_that_is_not_here_is_a_404_naming_it_and_no_server_folder(api, rooted_engine, model_root) -> None:
    for model, says in (("no-such-model", "neither a built-in model nor a checkpoint"),
                        ("org/not-there", "neither a built-in model nor a checkpoint"),
                        ("/etc", "absolute path"),
                        ("org/../../etc", "climbs out"),
                        ("tiny-vit", "neither a built-in model"),  # an encoder's: no LLM's
                        ("org/no-tokenizer", "cannot load its tokenizer"),
                        ("m" * 600, "at most 512 characters")):
        for response in (api.get(url(model)), render(api, model, {"messages": QUESTION})):
            assert response.status_code == 404, (model, response.content)
            body = response.json()
            assert body["error"].startswith("no chat template for model '"), body
            [detail] = body["details"]
            assert detail["field"] == "model" and says in detail["message"], (model, body)
            assert str(model_root) not in response.content.decode()


def test_it_needs_credentials(api) -> None:
    assert APIClient().get(url("tiny-llama")).status_code in (401, 403)
    assert APIClient().post(url("tiny-llama"), {"messages": QUESTION}, format="json").status_code in (401, 403)


def test_a_v1_turn_on_a_model_whose_tokenizer_cannot_load_names_no_server_folder(rooted_engine, model_root) -> None:
    """`/v1/chat/completions` loads the deployment's template the same way: its 503 (and a bad
    reference's 400) say what failed, without the model root."""
    deployment = Deployment(name="d")
    for model, error, says in (("org/no-tokenizer", Unavailable, "cannot be loaded"),
                               ("org/../../etc", BadRequest, "climbs out")):
        shape = ChatShape(prompt_input="prompt", image_inputs=(), llm_node="llm", model=model, streams=False,
                          reply_output="text", usage_output=None, llm_usage=True)
        with pytest.raises(error) as refused:
            chat_template(deployment, shape)
        assert says in str(refused.value.detail) and str(model_root) not in str(refused.value.detail), refused.value


def test_the_chat_workflows_default_is_its_example_in_smollm2s_template(
        api, smollm2_cache: ModelCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """The New run form starts from the input's plain example and sends it rendered; the command line
    sends the default: both are the same conversation, as the model's own tokenizer renders it."""
    monkeypatch.setenv("OMNIFLOW_CACHE_DIR", str(smollm2_cache.config.root))
    reference = AutoTokenizer.from_pretrained(smollm2_cache.directory(PACKAGED_MODELS["smollm2-135m"]),
                                              local_files_only=True)
    prompt = next(n for n in chat_workflow.to_spec().nodes if n.id == "prompt")
    example = prompt.params["example"]
    assert example == "What is the capital of France?"
    messages = [{"role": "user", "content": example}]
    assert prompt.params["default"] == reference.apply_chat_template(messages, tokenize=False,
                                                                     add_generation_prompt=True)
    assert render(api, "smollm2-135m", {"messages": messages}).json()["prompt"] == prompt.params["default"]
