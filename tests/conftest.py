"""Fixtures every test directory may use: the packaged real model, built once per test run."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from engine.compute.models.cache import ModelCache, ModelCacheConfig
from engine.compute.models.packaged import PACKAGED_MODELS

KEEP_CACHE_ENV = "OMNIFLOW_TEST_MODEL_CACHE"
"""A directory to keep the built real model in between test runs (default: a temporary one per run)."""


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> ModelCache:
    """A model cache holding smollm2-135m, built from the installed package on first use
    (a few minutes on 2 busy cores; see the build time printed with -s)."""
    kept = os.environ.get(KEEP_CACHE_ENV)
    root = Path(kept) if kept else tmp_path_factory.mktemp("model-cache")
    cache = ModelCache(ModelCacheConfig(root=root), progress=None)
    started = time.perf_counter()
    cache.checkpoint(PACKAGED_MODELS["smollm2-135m"])
    print(f"\nsmollm2-135m ready in {root} after {time.perf_counter() - started:.1f} s")
    return cache
