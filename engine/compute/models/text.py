"""A model's text side: encode, decode, stream-decode, and render chat messages as a prompt.

`ModelTokenizer` wraps a model's `transformers` tokenizer. `chat_prompt` renders with
the model's own chat template (`apply_chat_template`) where the tokenizer has one (the
packaged real models), else with the hand-written template of the tiny built-in models:

    ### System:\\n{content}\\n\\n      (role system or developer)
    ### User:\\n{content}\\n\\n
    ### Assistant:\\n{content}\\n\\n

and the generation prompt `### Assistant:\\n` (the studio's simple template, the same text).

`IncrementalDetokenizer` turns a growing list of token ids into text deltas that hold
only complete characters: a byte-level token may end in the middle of a UTF-8
character, and decoding such a prefix gives U+FFFD where the character will be.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jinja2

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = Mapping[str, str]
"""`{"role": ..., "content": <text>}`"""

_SIMPLE_HEADERS = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
SIMPLE_GENERATION_PROMPT = "### Assistant:\n"
_REPLACEMENT = "\ufffd"


class ChatPromptError(ValueError):
    """Messages the template cannot render (a bad role, a non-text content, a failing template)."""


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Text deltas of a growing token list, complete characters only (vLLM's prefix-offset technique).

    Each `step` decodes only the window `ids[prefix_offset:]` and compares it with the
    window's already-emitted part `ids[prefix_offset:read_offset]`; the difference is new
    text unless it ends in U+FFFD (an incomplete character: wait for the next token).
    Decoding a window, not a single token, keeps what a tokenizer does at token
    boundaries (merged bytes, SentencePiece's leading space) right; starting at offset 0
    makes the deltas add up to `decode(ids)`. The caller owns `ids`; they only grow.
    """

    decode: Callable[[list[int]], str]
    prefix_offset: int = 0
    read_offset: int = 0

    def step(self, ids: Sequence[int]) -> str:
        """The new complete text after `ids` grew; "" while the last character is incomplete."""
        return self._advance(ids, final=False)

    def flush(self, ids: Sequence[int]) -> str:
        """All text not yet returned, an incomplete last character included (as U+FFFD): at the end."""
        return self._advance(ids, final=True)

    def _advance(self, ids: Sequence[int], *, final: bool) -> str:
        if len(ids) <= self.read_offset:
            return ""
        emitted = self.decode(list(ids[self.prefix_offset : self.read_offset]))
        window = self.decode(list(ids[self.prefix_offset :]))
        if len(window) <= len(emitted) or (not final and window.endswith(_REPLACEMENT)):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return window[len(emitted) :]


@dataclass(frozen=True, slots=True)
class ModelTokenizer:
    """The text side of one model; does not modify the wrapped tokenizer."""

    tokenizer: PreTrainedTokenizerBase

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.decode)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def chat_prompt(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        """`messages` as prompt text: the model's own chat template, else the simple one."""
        checked = [_check_message(index, m) for index, m in enumerate(messages)]
        if not self.has_chat_template:
            text = "".join(f"### {_SIMPLE_HEADERS[m['role']]}:\n{m['content']}\n\n" for m in checked)
            return text + (SIMPLE_GENERATION_PROMPT if add_generation_prompt else "")
        try:
            rendered = self.tokenizer.apply_chat_template(checked, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt)
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise ChatPromptError(f"the model's chat template failed: {exc}") from None
        if not isinstance(rendered, str):
            raise ChatPromptError(f"the model's chat template gave {type(rendered).__name__}, not text")
        return rendered


def _check_message(index: int, message: Message) -> dict[str, str]:
    role, content = message.get("role"), message.get("content")
    if role not in _SIMPLE_HEADERS:
        raise ChatPromptError(f"message {index}: role {role!r} is not one of {', '.join(_SIMPLE_HEADERS)}")
    if not isinstance(content, str):
        raise ChatPromptError(f"message {index}: content must be text, not {type(content).__name__}")
    return {"role": role, "content": content}
