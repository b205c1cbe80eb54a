"""Model weights held once per worker process (`WeightStore`) and once per host (`HostWeights` in
host memory, `DeviceWeights` on a GPU)."""

from __future__ import annotations

from engine.compute.weights.cuda import DeviceWeights, DeviceWeightsManifest
from engine.compute.weights.seeding import build_seeded
from engine.compute.weights.shared import HostWeights, SharedWeightsError, WeightsManifest
from engine.compute.weights.store import WeightKey, WeightStore

__all__ = [
    "DeviceWeights",
    "DeviceWeightsManifest",
    "HostWeights",
    "SharedWeightsError",
    "WeightKey",
    "WeightStore",
    "WeightsManifest",
    "build_seeded",
]
