"""Settings and errors of the omniflow transfer backend."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

BACKEND_NAME = "omniflow"


class KVTransferError(Exception):
    """A transfer of the omniflow backend failed; the message says in which phase and why."""


class KVTransferConfigError(KVTransferError):
    """The backend cannot serve this configuration (bad setting, unsupported layout)."""


# --- configuration ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Deadlines and addresses of the backend, read once per manager.

    `timeout_s` bounds every phase that waits on the other side (bootstrap lookup, the
    pull, the decode's acknowledgement) and the silence of a prefill the decode probes;
    `waiting_timeout_s` bounds waiting for the prefill to compute (decode) or for the
    decode to show up and the scheduler to send (prefill). `host` is the address the
    control and data endpoints bind and advertise."""

    timeout_s: float = 30.0
    waiting_timeout_s: float = 300.0
    host: str = "127.0.0.1"

    ENV_TIMEOUT = "OMNIFLOW_SGLANG_KV_TIMEOUT_S"
    ENV_WAITING = "OMNIFLOW_SGLANG_KV_WAITING_TIMEOUT_S"
    ENV_HOST = "OMNIFLOW_SGLANG_KV_HOST"

    def __post_init__(self) -> None:
        if not self.timeout_s > 0 or not self.waiting_timeout_s > 0:
            raise KVTransferConfigError(
                f"timeouts must be positive (timeout_s={self.timeout_s}, waiting_timeout_s={self.waiting_timeout_s})"
            )
        if not self.host:
            raise KVTransferConfigError("an empty host for the KV transfer endpoints")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> TransferConfig:
        """The config SGLang's processes get (they build managers with a fixed signature)."""
        default = cls()
        return cls(
            timeout_s=_seconds(environ, cls.ENV_TIMEOUT, default.timeout_s),
            waiting_timeout_s=_seconds(environ, cls.ENV_WAITING, default.waiting_timeout_s),
            host=environ.get(cls.ENV_HOST, default.host),
        )


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise KVTransferConfigError(f"{name}={raw!r} is not a number of seconds") from exc
    if not value > 0:
        raise KVTransferConfigError(f"{name}={raw!r} must be positive")
    return value


def split_bootstrap_addr(bootstrap_addr: str) -> str:
    """SGLang's `host:port` (IPv6 in brackets) as a ZeroMQ endpoint."""
    host, sep, port = bootstrap_addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise KVTransferConfigError(f"bootstrap address {bootstrap_addr!r} is not host:port")
    return f"tcp://{host}:{port}"
