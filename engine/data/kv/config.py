"""`KVStoreConfig`: what a `KVStore` is built from, built once by the worker and passed down."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from engine.data.kv.disk import Checksum
from engine.data.kv.layout import KVLayout
from engine.data.kv.policy import EvictionPolicy
from engine.data.kv.tier import Capacity


class WritePolicy(StrEnum):
    WRITE_THROUGH = "write_through"
    WRITE_BACK = "write_back"


@dataclass(frozen=True, slots=True)
class DiskTierConfig:
    path: Path | str
    capacity: Capacity
    fsync: bool = False
    checksum: Checksum = Checksum.BLOCKSUM64


@dataclass(frozen=True, slots=True)
class KVStoreConfig:
    """Everything a store needs; built once by the worker and passed down.

    `device` is the torch device of the device tier (default: CUDA when present, else
    CPU). `pin_host` page-locks the host segment (default: when CUDA is present).
    """

    layout: KVLayout
    device_capacity: Capacity
    host_capacity: Capacity | None = None
    disk: DiskTierConfig | None = None
    eviction: EvictionPolicy = EvictionPolicy.LRU
    write: WritePolicy = WritePolicy.WRITE_BACK
    device: str | None = None
    host_segment_name: str | None = None
    pin_host: bool | None = None
