"""Prompt tokenization for the KV-aware router, without loading a model.

`engine.flow.kvroute` hashes a prompt's pages the way the engine does, which needs the prompt
as token ids; for a text prompt the router may be given a `PromptTokenizer`. `RoleTokenizers`
is that callable for `llm` roles: it tokenizes exactly as `LLMEngine.encode` does, loading
only the tokenizer of the role's model (the byte tokenizer of the tiny built-in models,
`AutoTokenizer` from a checkpoint directory, local files only, or from the model cache for a
packaged model, built there first if need be: `engine.compute.models.load_tokenizer`), once per
model.

The composition root builds one per process and hands it to every `WorkerDispatcher` it makes
through `KVRouter.for_registry(registry, tokenizer=...)`: the studio does (`StudioEngine.prompt_tokenizer`,
for its embedded deployments and the executors reaching other processes' deployments); the
command line's runs have no KV index to route by. The flow layer itself never imports this module.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from engine.compute.models.errors import ModelLoadError
from engine.spec.graph import RoleSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


class RoleTokenizers:
    """`(role, text) -> token ids` for llm roles; thread-safe (the router calls it off its event loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokenizers: dict[str, PreTrainedTokenizerBase | None] = {}

    def tokenizer(self, model: str) -> PreTrainedTokenizerBase | None:
        """`model`'s tokenizer, loaded once; None where it cannot be loaded (said once, in the log:
        the router then balances that model's text prompts on load alone; the call itself goes on
        to the worker, which reports the model's problem as the node's error)."""
        with self._lock:
            if model not in self._tokenizers:
                try:
                    self._tokenizers[model] = self._load(model)
                except ModelLoadError as exc:
                    log.warning("KV-aware routing of %r's text prompts falls back to load: %s", model, exc)
                    self._tokenizers[model] = None
            return self._tokenizers[model]

    @staticmethod
    def _load(model: str) -> PreTrainedTokenizerBase:
        from engine.compute.models.loader import load_tokenizer  # torch and transformers: on first use only

        return load_tokenizer(model)

    def __call__(self, role: RoleSpec, text: str) -> list[int]:
        if not role.model:
            raise ModelLoadError(f"role {role.name!r} names no model")
        tokenizer = self.tokenizer(role.model)
        return [] if tokenizer is None else list(tokenizer(text).input_ids)
