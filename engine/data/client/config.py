"""`ClientConfig`: how a `ZmqClient` sizes its pulls and what it accepts from owners."""

from __future__ import annotations

from dataclasses import dataclass

from engine.data.codec import Limits, MiB


@dataclass(frozen=True, slots=True)
class ClientConfig:
    chunk_bytes: int = 8 * MiB
    window: int = 4  # chunks requested ahead per transfer: the credit the owner may use
    max_mapped_bytes: int = 1 << 30  # cached read-only mappings of other processes' segments
    limits: Limits = Limits()
