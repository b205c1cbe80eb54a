"""OpenAI chat messages to one prompt text.

* A model given as a checkpoint directory with a chat template (`chat_template` in its
  `tokenizer_config.json`, or a `chat_template.jinja` file beside it) is rendered with
  that template, the way `transformers`' `apply_chat_template` does: Jinja in a sandbox,
  with `messages`, `add_generation_prompt`, `bos_token` and `eos_token`.
* Any other model (the built-in tiny models have no template) gets the simple template:

      ### System:\\n{content}\\n\\n      (role system or developer)
      ### User:\\n{content}\\n\\n
      ### Assistant:\\n{content}\\n\\n

  and the generation prompt `### Assistant:\\n`.

A session turn sends the LLM only what is new (`ChatTemplate.turn`): the engine already
holds the history as the previous prompt plus the tokens it generated.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger(__name__)

Message = dict[str, str]
"""`{"role": ..., "content": <text>}`"""

_SIMPLE_HEADERS = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
SIMPLE_GENERATION_PROMPT = "### Assistant:\n"


class TemplateError(ValueError):
    """The model's chat template failed on these messages."""


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    source: str | None
    """Jinja source of the model's template; None: the simple template."""
    bos_token: str = ""
    eos_token: str = ""

    @property
    def name(self) -> str:
        return "model" if self.source is not None else "simple"

    def render(self, messages: list[Message], *, add_generation_prompt: bool = True) -> str:
        if self.source is None:
            text = "".join(f"### {_SIMPLE_HEADERS[m['role']]}:\n{m['content']}\n\n" for m in messages)
            return text + (SIMPLE_GENERATION_PROMPT if add_generation_prompt else "")
        try:
            return _compiled(self.source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 bos_token=self.bos_token, eos_token=self.eos_token)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the model's chat template failed: {exc}") from None

    def held(self, history: list[Message]) -> str:
        """What the LLM holds of a session with `history`: the last turn's prompt and reply;
        nothing before the first reply."""
        if not history or history[-1]["role"] != "assistant":
            return ""
        return self.render(history[:-1]) + history[-1]["content"]

    def turn(self, history: list[Message], new: list[Message]) -> str:
        """The text a session turn sends: what rendering `history + new` adds to what the
        LLM holds (`held`). A template whose rendering is not prefix-stable there falls back
        to rendering `new` alone."""
        held = self.held(history)
        if not held:
            return self.render(history + new)  # the LLM holds nothing yet: a session's first turn
        full = self.render(history + new)
        if full.startswith(held):
            return full[len(held):]
        log.info("the chat template is not prefix-stable; the turn is rendered alone")
        return self.render(new)


@functools.lru_cache(maxsize=16)
def _compiled(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


@functools.lru_cache(maxsize=64)
def template_for(model: str | None) -> ChatTemplate:
    """The chat template of `model` (a role's model reference), or the simple one."""
    if not model:
        return ChatTemplate(None)
    folder = Path(model)
    if not folder.is_dir():
        return ChatTemplate(None)
    config: dict[str, Any] = {}
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("%s: unreadable (%s); using the simple chat template", config_path, exc)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    jinja_path = folder / "chat_template.jinja"
    if not isinstance(source, str) and jinja_path.is_file():
        source = jinja_path.read_text()
    if not isinstance(source, str) or not source.strip():
        return ChatTemplate(None)
    return ChatTemplate(source, bos_token=_token_text(config.get("bos_token")),
                        eos_token=_token_text(config.get("eos_token")))
