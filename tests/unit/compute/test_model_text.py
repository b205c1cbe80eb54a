"""`ModelTokenizer` and `IncrementalDetokenizer` on the byte tokenizer: one token per byte, so every
multi-byte character is split across tokens (the hardest case for a stream)."""

from __future__ import annotations

import pytest

from engine.compute.models import IncrementalDetokenizer, ModelTokenizer
from engine.compute.models.text import ChatPromptError
from engine.compute.models.tokenizer import EOS_ID, build_byte_tokenizer

MIXED = "Crème brûlée 🍮 — naïve 日本語 ok 👩‍💻!"


@pytest.fixture(scope="module")
def codec() -> ModelTokenizer:
    return ModelTokenizer(build_byte_tokenizer())


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.step(ids[: n + 1]) for n in range(len(ids))]
    return [*deltas, detok.flush(ids)]


def test_deltas_hold_only_complete_characters_and_add_up_to_the_text(codec: ModelTokenizer):
    ids = codec.encode(MIXED)
    assert len(ids) == len(MIXED.encode())  # one token per byte: characters are split mid-way
    deltas = stream(codec.detokenizer(), ids)
    assert "".join(deltas) == MIXED == codec.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    # One delta per character, each on the token that completes it.
    assert [d for d in deltas if d] == list(MIXED)
    emoji_bytes = "🍮".encode()
    start = MIXED.encode().index(emoji_bytes)
    assert deltas[start : start + 3] == ["", "", ""] and deltas[start + 3] == "🍮"


def test_flush_gives_an_incomplete_last_character_as_replacement(codec: ModelTokenizer):
    ids = codec.encode("é🍮")[:-1]  # the emoji's last byte is missing
    detok = codec.detokenizer()
    assert [detok.step(ids[: n + 1]) for n in range(len(ids))] == ["", "é", "", "", ""]
    tail = detok.flush(ids)
    assert tail and set(tail) == {"\ufffd"} and codec.decode(ids) == "é" + tail
    assert detok.flush(ids) == ""


def test_special_tokens_are_skipped_in_a_stream(codec: ModelTokenizer):
    ids = [*codec.encode("ab"), EOS_ID, *codec.encode("ç")]
    assert "".join(stream(codec.detokenizer(), ids)) == "abç" == codec.decode(ids)


def test_tiny_models_keep_the_simple_chat_template(codec: ModelTokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert not codec.has_chat_template
    assert codec.chat_prompt(messages) == "### System:\nBe brief.\n\n### User:\nHi\n\n### Assistant:\n"
    assert codec.chat_prompt(messages, add_generation_prompt=False).endswith("### User:\nHi\n\n")


@pytest.mark.parametrize(("message", "problem"), [
    ({"role": "robot", "content": "x"}, "message 0: role 'robot'"),
    ({"role": "user", "content": ["x"]}, "message 0: content must be text, not list"),
])
def test_bad_messages_are_named(codec: ModelTokenizer, message: dict, problem: str):
    with pytest.raises(ChatPromptError, match=problem):
        codec.chat_prompt([message])
