"""OpenAI chat messages to one prompt text: the model's own chat template, or the simple one.

A `ChatTemplate` is the text side of the model a chat deployment's llm role runs
(`engine.client.models.ModelTokenizer`, loaded without the weights): where the model's tokenizer
carries a chat template (the packaged `smollm2-135m`; a checkpoint whose `tokenizer_config.json` or
`chat_template.jinja` has one) the messages are rendered by `transformers`' `apply_chat_template`
(Jinja in its sandbox), exactly as `tokenizer.apply_chat_template(messages, tokenize=False,
add_generation_prompt=True)` renders them; any other model (the tiny built-in ones) gets the
simple template:

    ### System:\\n{content}\\n\\n      (role system or developer)
    ### User:\\n{content}\\n\\n
    ### Assistant:\\n{content}\\n\\n

and the generation prompt `### Assistant:\\n`.

A session turn sends the LLM only what is new (`ChatTemplate.turn`): the LLM holds the history as
the previous prompt plus the tokens it generated, the EOS token included when the reply ended on it
(the studio keeps that token's text on the stored assistant message as `eos`, see `held`). So the
turn is what rendering the whole conversation adds after that: with SmolLM2's template, after
`...reply<|im_end|>` (held) the turn is `\\n<|im_start|>user\\n...`; after a reply cut by
`max_tokens` (no EOS held) it starts with the `<|im_end|>` the template closes the reply with.
A template that does not close a reply with the EOS token (the simple one) has the rest of its
text follow the EOS the LLM holds. A template whose rendering is not prefix-stable at all (one that
rewrites earlier turns) gets the new messages rendered alone, and says so in the log.

`ChatTemplates` holds one template per model reference for the process (on `StudioEngine`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.client.models import ChatPromptError, ModelTokenizer, load_model_text

log = logging.getLogger(__name__)

Message = dict[str, Any]
"""`{"role": ..., "content": <text>}`; a stored assistant message may carry `eos` (see `held`)."""


class TemplateError(ValueError):
    """The model's chat template failed on these messages."""


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A model's chat rendering and end-of-sequence tokens; does not modify the tokenizer."""

    codec: ModelTokenizer
    eos_token_ids: frozenset[int]

    @property
    def name(self) -> str:
        return "model" if self.codec.has_chat_template else "simple"

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        # OpenAI's `developer` role is its newer name for `system`, which chat templates know.
        plain = [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
                 for m in messages]
        try:
            return self.codec.chat_prompt(plain, add_generation_prompt=add_generation_prompt)
        except ChatPromptError as exc:
            raise TemplateError(str(exc)) from None

    def generation_prompt(self) -> str:
        """The text `add_generation_prompt` adds after a conversation (SmolLM2's
        `<|im_start|>assistant\\n`): what a rendered prompt ends with; "" when the template adds
        nothing, changes more than the end with it, or refuses a lone user message."""
        probe = [{"role": "user", "content": "?"}]
        try:
            bare, prompted = self.render(probe, add_generation_prompt=False), self.render(probe)
        except TemplateError:
            return ""
        return prompted[len(bare):] if prompted.startswith(bare) else ""

    def count(self, text: str) -> int:
        """How many tokens the LLM reads `text` as."""
        return len(self.codec.encode(text))

    def eos_text(self, token: int | None) -> str | None:
        """The text of `token` when it is one of the model's EOS tokens (a reply that ended on it),
        else None."""
        if token is None or token not in self.eos_token_ids:
            return None
        return str(self.codec.tokenizer.decode([token], skip_special_tokens=False))

    def held(self, history: Sequence[Message]) -> str:
        """What the LLM holds of a session with `history`: the last turn's prompt, its reply and the
        EOS token the reply ended on (`eos` on the assistant message); nothing before the first reply."""
        if not history or history[-1]["role"] != "assistant":
            return ""
        return self.render(history[:-1]) + history[-1]["content"] + (history[-1].get("eos") or "")

    def turn(self, history: Sequence[Message], new: Sequence[Message]) -> str:
        """The text a session turn sends: what rendering `history + new` adds to what the LLM holds."""
        held = self.held(history)
        full = self.render([*history, *new])
        if not held:
            return full  # the LLM holds nothing yet: a session's first turn
        if full.startswith(held):
            return full[len(held):]
        reply = self.render(history[:-1]) + history[-1]["content"]
        if history[-1].get("eos") and full.startswith(reply):
            return full[len(reply):]  # the template's own end of a reply follows the EOS the LLM holds
        log.info("the chat template is not prefix-stable; the turn is rendered alone")
        return self.render(new)


class ChatTemplates:
    """`model reference -> ChatTemplate`, loaded once per reference (tokenizer files only: a packaged
    model's from the model cache, built there first if need be). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._templates: dict[str, ChatTemplate] = {}

    def get(self, model: str) -> ChatTemplate:
        """The template of `model` (a built-in name or a checkpoint directory); `ModelLoadError` for
        an unknown name or an unreadable checkpoint."""
        with self._lock:
            template = self._templates.get(model)
            if template is None:
                text = load_model_text(model)
                template = ChatTemplate(text.tokenizer, text.eos_token_ids)
                self._templates[model] = template
            return template
