"""Model weights held once per worker process (`WeightStore`) and once per host (`HostWeights`)."""

from __future__ import annotations

from engine.compute.weights.seeding import build_seeded
from engine.compute.weights.shared import HostWeights, SharedWeightsError, WeightsManifest
from engine.compute.weights.store import WeightKey, WeightStore

__all__ = ["HostWeights", "SharedWeightsError", "WeightKey", "WeightStore", "WeightsManifest", "build_seeded"]
