"""Prompt tokenization for the KV-aware router, without loading a model.

`engine.flow.kvroute` hashes a prompt's pages the way the engine does, which needs the prompt
as token ids; for a text prompt the router may be given a `PromptTokenizer`. `RoleTokenizers`
is that callable for `llm` roles: it tokenizes exactly as `LLMEngine.encode` does, loading
only the tokenizer of the role's model (the byte tokenizer of the tiny built-in models,
`AutoTokenizer` from a checkpoint directory, local files only, or from the model cache for a
packaged model, built there first if need be: `engine.compute.models.load_tokenizer`), once per
model.

The composition root (the CLI, the studio) builds one and hands it to `WorkerDispatcher`
through `KVRouter.for_registry(registry, tokenizer=RoleTokenizers())`; the flow layer itself
never imports this module.
"""

from __future__ import annotations

import threading

from transformers import PreTrainedTokenizerBase

from engine.compute.models.loader import ModelLoadError, load_tokenizer
from engine.spec.graph import RoleSpec


class RoleTokenizers:
    """`(role, text) -> token ids` for llm roles; thread-safe (the router calls it off its event loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokenizers: dict[str, PreTrainedTokenizerBase] = {}

    def tokenizer(self, model: str) -> PreTrainedTokenizerBase:
        with self._lock:
            tokenizer = self._tokenizers.get(model)
            if tokenizer is None:
                tokenizer = self._tokenizers[model] = self._load(model)
            return tokenizer

    @staticmethod
    def _load(model: str) -> PreTrainedTokenizerBase:
        return load_tokenizer(model)

    def __call__(self, role: RoleSpec, text: str) -> list[int]:
        if not role.model:
            raise ModelLoadError(f"role {role.name!r} names no model")
        return list(self.tokenizer(role.model)(text).input_ids)
