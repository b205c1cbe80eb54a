"""The multimodal example pipelines end to end: files written, KV reused across turns. The command
line runs the examples as shipped (the real `smollm2-135m`, from the test run's model cache); the
in-process checks of the machinery run them on the tiny seeded LLM (`tests.examples`)."""

from __future__ import annotations

import asyncio
import io
import json
import wave
from pathlib import Path

import pytest
from PIL import Image

from engine.cli import main, trusted_ops
from engine.compute.models.cache import ModelCache
from engine.flow.dispatch import InProcessDispatcher
from engine.flow.executor import Executor
from engine.spec.kinds import default_kinds
from tests.examples import example

ROOT = Path(__file__).parents[2]


@pytest.fixture
def real_model(smollm2_cache: ModelCache, monkeypatch) -> None:
    """The examples' real LLM, from the test run's cache (the workers inherit the environment)."""
    monkeypatch.setenv("OMNIFLOW_CACHE_DIR", str(smollm2_cache.config.root))


def _run_cli(path: str, capsys, tmp_path, monkeypatch, *extra: str) -> dict:
    monkeypatch.chdir(tmp_path)
    code = main(["run", str(ROOT / path), "--json", "-q", *extra])
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 0, out
    return json.loads(out)


def test_image_generation_writes_a_png(real_model, capsys, tmp_path, monkeypatch):
    """As shipped: the rewrite and the diffusion on smollm2-135m in two worker processes (one copy of
    the weights, the diffusion pulling the rewrite's prompt pages)."""
    result = _run_cli("workflows/image_generation.py", capsys, tmp_path, monkeypatch)
    rewrite = result["outputs"]["prompt_rewrite"]
    assert rewrite.strip() and rewrite == rewrite.strip()  # a text of its own: no joint to the instruction
    saved = result["outputs"]["saved"]
    with Image.open(saved["files"]["image"]) as img:
        assert img.format == "PNG" and img.size == (256, 256)
    assert result["outputs"]["image"]["bytes"] > 0  # the decoded PNG, pulled from the vae worker as bytes


def test_pd_chat_runs(real_model, capsys, tmp_path, monkeypatch):
    result = _run_cli("workflows/pd_chat.py", capsys, tmp_path, monkeypatch)
    assert result["outputs"]["tokens"]


def test_omni_dialogue_three_turns_reuse_the_picture(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = example("omni_dialogue", tiny=True)
    kinds = default_kinds()

    async def turns():
        executor = Executor(InProcessDispatcher(kinds), kinds)
        try:
            results = []
            for inputs in ({}, {"image": None, "message": "And now?"}, {"message": "Once more, in words."}):
                run = await executor.submit(spec, inputs)
                results.append(await run.wait())
            return results
        finally:
            await executor.aclose()

    first, _, third = asyncio.run(turns())
    assert first.status == "done" and third.status == "done", (first.error, third.error)
    files = first.outputs["saved"]["files"]
    with Image.open(files["image"]) as img:
        assert img.format == "PNG"
    with wave.open(io.BytesIO(Path(files["audio"]).read_bytes())) as wav:
        assert wav.getnframes() > 0
    # Turn 3's history (turn 1's picture included) comes from the session's cached pages.
    assert third.outputs["kv"].cached_tokens >= first.outputs["kv"].prompt_tokens


def test_image_generation_in_process_shares_the_model_between_llm_and_diffusion(tmp_path, monkeypatch):
    """`--workers inproc`: the llm and diffusion roles run on one copy of the model's weights,
    and the image is the one units with their own copies make."""
    from engine.compute.weights import WeightStore
    from engine.worker.units import SharedUnits

    monkeypatch.chdir(tmp_path)
    spec = example("image_generation", tiny=True)
    kinds = default_kinds()

    async def image(dispatcher: InProcessDispatcher, probe=None) -> bytes:
        executor = Executor(dispatcher, kinds)
        try:
            result = await (await executor.submit(spec)).wait()
            assert result.status == "done", result.error
            if probe is not None:
                probe()
            return bytes(result.outputs["image"])
        finally:
            await executor.aclose()

    shared = SharedUnits(kinds, ops=trusted_ops())
    users: list[int] = []
    one_copy = asyncio.run(image(InProcessDispatcher(kinds, build=shared),
                                 lambda: users.append(shared.weights.users(WeightStore.llm_key("tiny-llama")))))
    assert users == [2]  # the llm unit and the diffusion unit
    assert shared.weights.users(WeightStore.llm_key("tiny-llama")) == 0  # released as they closed
    assert one_copy == asyncio.run(image(InProcessDispatcher(kinds)))
