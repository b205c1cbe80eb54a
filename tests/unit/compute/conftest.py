"""Factories for the compute tests: the tiny models (built once per run), engines that close."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from engine.compute.llm import EngineConfig, LLMEngine
from engine.compute.models import LoadedModel, load_builtin


@pytest.fixture(scope="session")
def tiny_llama() -> LoadedModel:
    return load_builtin("tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen2() -> LoadedModel:
    return load_builtin("tiny-qwen2")


@pytest.fixture
def make_engine(tiny_llama: LoadedModel) -> Iterator[Callable[..., LLMEngine]]:
    """`make_engine(model=None, store=None, peers=(), clock=None, **config)`: an engine closed after the test."""
    engines: list[LLMEngine] = []

    def factory(model: LoadedModel | None = None, *, store=None, peers=(), clock=None, **config) -> LLMEngine:
        config.setdefault("page_size", 4)
        kwargs = {"store": store, "peers": peers}
        if clock is not None:
            kwargs["clock"] = clock
        engine = LLMEngine(model or tiny_llama, EngineConfig(**config), **kwargs)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.close()


def prompt_ids(seed: int, length: int) -> list[int]:
    """Printable-byte token ids, reproducible from `seed`."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(length)]
