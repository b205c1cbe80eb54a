"""Fixtures every test directory may use: the packaged real model, built once per test run."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from engine.compute.models.cache import ModelCache, ModelCacheConfig
from engine.compute.models.packaged import PACKAGED_MODELS

THREADS_ENV = "OMP_NUM_THREADS"
"""Torch's intra-op threads in this process and every process a test starts (default 1, set it to change)."""


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op thread per process unless OMP_NUM_THREADS says otherwise. The tests run tiny
    models on a few shared cores, alongside the worker, Celery and server processes they start:
    with torch's default (a thread per core) each op of a 64-wide layer waits at OpenMP's barrier
    for a thread the busy machine has descheduled, and tiny-llama's decode took 20 times as long
    (13 ms a linear layer instead of 0.1 ms at load 9 on two cores). The processes the tests start
    inherit the variable."""
    threads = os.environ.setdefault(THREADS_ENV, "1")
    if not threads.isdigit() or int(threads) < 1:
        raise pytest.UsageError(f"{THREADS_ENV}={threads!r}: expected a positive whole number of threads")
    torch.set_num_threads(int(threads))


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
