"""The LLM runner: continuous batching over paged KV, sessions, prefill/decode handoff, the `llm` unit."""

from __future__ import annotations

from engine.compute.llm.config import EngineConfig, EngineConfigError
from engine.compute.llm.engine import LLMEngine
from engine.compute.llm.errors import (
    HandoffError,
    LLMError,
    RequestError,
    SessionBusyError,
    SessionError,
    SessionNotFoundError,
    UnknownRequestError,
)
from engine.compute.llm.sequence import FinishReason, RequestOutput, RequestTimings
from engine.compute.llm.sessions import SessionInfo
from engine.compute.llm.transfer import KVHandoff

__all__ = [
    "EngineConfig",
    "EngineConfigError",
    "FinishReason",
    "HandoffError",
    "KVHandoff",
    "LLMEngine",
    "LLMError",
    "RequestError",
    "RequestOutput",
    "RequestTimings",
    "SessionBusyError",
    "SessionError",
    "SessionInfo",
    "SessionNotFoundError",
    "UnknownRequestError",
]
