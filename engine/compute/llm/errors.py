"""Typed errors of the LLM runner."""

from __future__ import annotations


class LLMError(Exception):
    """Base class of the runner's errors."""


class RequestError(LLMError, ValueError):
    """A request is malformed: empty prompt, unknown token ids, too long for the model."""


class UnknownRequestError(LLMError, KeyError):
    """No request with this id is waiting or running."""


class SessionError(LLMError):
    """Base of session errors."""


class SessionNotFoundError(SessionError, KeyError):
    """No open session has this id."""


class SessionBusyError(SessionError):
    """The session already has a turn in flight; a session runs one turn at a time."""


class HandoffError(LLMError):
    """A prefill handoff does not fit this engine (other model or KV layout) or its pages could not be pulled."""


class LLMUnitError(LLMError):
    """A node call the llm unit cannot run (bad inputs, a failed generation or KV pull)."""
