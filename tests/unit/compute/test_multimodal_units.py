"""The encoder, diffusion and decoder kinds and units, driven by the flow executor in process."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest
import torch
from PIL import Image

from engine.compute.context import UnitContext
from engine.compute.diffusion import DiffusionConfig, DiffusionRunner, Prompt
from engine.compute.diffusion.unit import DiffusionUnit
from engine.compute.encoders.unit import VisionEncoderUnit
from engine.compute.kinds import register
from engine.compute.media import png_bytes, sample_picture, sample_sound, wav_bytes
from engine.compute.models.tokenizer import BOS_ID
from engine.compute.threaded import UnitInputError
from engine.compute.weights import WeightKey, WeightStore
from engine.data.kv.ref import KVRef
from engine.flow.dispatch import InProcessDispatcher
from engine.flow.dsl import Workflow
from engine.flow.events import NodeProgressEvent, NodeStateEvent
from engine.flow.executor import Executor
from engine.flow.plan import build_plan
from engine.flow.validate import GraphValidationError
from engine.spec.calls import NodeCall, NodeContext
from engine.spec.graph import RoleSpec
from engine.spec.kinds import default_kinds

ENCODE_OUT = {"embeds": "tensor", "item": "json"}
DIFFUSION_IN = {"prompt": {"type": "text", "optional": True}, "tokens": {"type": "tokens", "optional": True},
                "negative_prompt": {"type": "text", "optional": True}, "kv": {"type": "kv", "optional": True}}


@pytest.fixture
def kinds():
    registry = default_kinds(load_entry_points=False)
    register(registry)
    return registry


@pytest.fixture
async def executor(kinds):
    ex = Executor(InProcessDispatcher(kinds), kinds)
    yield ex
    await ex.aclose()


def image_generation(params: dict | None = None) -> Workflow:
    wf = Workflow("image_generation")
    dit = wf.role("dit", kind="diffusion", model="tiny-llama", params={"page_size": 4, "steps": 4})
    vae = wf.role("vae", kind="vae_decoder", model="tiny-vae")
    prompt = wf.input("prompt", "text")
    gen = wf.node("gen", "diffusion", role=dit, inputs=DIFFUSION_IN, outputs={"latents": "tensor"},
                  params={"seed": 1, **(params or {})})
    dec = wf.node("decode", "vae_decode", role=vae, inputs={"latents": "tensor"}, outputs={"image": "image"})
    wf.edge(prompt, gen.inp("prompt"))
    wf.edge(gen.out("latents"), dec.inp("latents"))
    wf.output("image", dec.out("image"), "image")
    wf.output("latents", gen.out("latents"), "tensor")
    return wf


def llm_then_diffusion() -> Workflow:
    """An llm node's `kv` as the diffusion node's only prompt input (`workflows/image_generation.py`)."""
    wf = Workflow("llm_then_diffusion")
    llm = wf.role("llm", kind="llm", model="tiny-llama", params={"page_size": 4})
    dit = wf.role("dit", kind="diffusion", model="tiny-llama", params={"page_size": 4, "steps": 4})
    gen = wf.node("gen", "llm", role=llm, params={"max_new_tokens": 5})
    paint = wf.node("paint", "diffusion", role=dit, inputs=DIFFUSION_IN, outputs={"latents": "tensor"},
                    params={"seed": 1})
    wf.edge(wf.input("prompt", "text"), gen.inp("prompt"))
    wf.edge(gen.out("kv"), paint.inp("kv"))
    wf.output("tokens", gen.out("tokens"), "tokens")
    wf.output("latents", paint.out("latents"), "tensor")
    return wf


def media_roundtrip() -> Workflow:
    wf = Workflow("media")
    vit = wf.role("vit", kind="vision_encoder", model="tiny-vit", params={"llm": "tiny-llama"})
    ear = wf.role("ear", kind="audio_encoder", model="tiny-audio-encoder", params={"hidden_size": 64})
    voice = wf.role("voice", kind="audio_decoder", model="tiny-audio-decoder")
    image, sound, codes = wf.input("image", "image"), wf.input("sound", "audio"), wf.input("codes", "tokens")
    see = wf.node("see", "vision_encode", role=vit, inputs={"image": "image"}, outputs=ENCODE_OUT)
    hear = wf.node("hear", "audio_encode", role=ear, inputs={"audio": "audio"}, outputs=ENCODE_OUT)
    speak = wf.node("speak", "audio_decode", role=voice, inputs={"codes": "tokens"}, outputs={"audio": "audio"},
                    params={"code_offset": 10})
    wf.edge(image, see.inp("image"))
    wf.edge(sound, hear.inp("audio"))
    wf.edge(codes, speak.inp("codes"))
    for name, port in (("image_item", see.out("item")), ("image_embeds", see.out("embeds")),
                       ("audio_item", hear.out("item")), ("wav", speak.out("audio"))):
        wf.output(name, port, "any")
    return wf


def test_kinds_register_roles_and_typed_ports(kinds):
    for role, runner in (("vision_encoder", "encoders.unit:VisionEncoderUnit"),
                         ("audio_encoder", "encoders.unit:AudioEncoderUnit"),
                         ("diffusion", "diffusion.unit:DiffusionUnit"),
                         ("vae_decoder", "decoders.unit:VAEDecoderUnit"),
                         ("audio_decoder", "decoders.unit:AudioDecoderUnit")):
        assert kinds.role_kind(role).runner == f"engine.compute.{runner}"
    assert kinds.node_kind("vision_encode").inputs["image"].type == "image"
    assert kinds.node_kind("diffusion").outputs["latents"].type == "tensor"
    assert kinds.node_kind("vae_decode").outputs["image"].type == "image"
    assert kinds.node_kind("audio_decode").outputs["audio"].type == "audio"
    assert kinds.has_node_kind("llm")  # the llm kinds are still there
    build_plan(image_generation().to_spec(), kinds)
    build_plan(media_roundtrip().to_spec(), kinds)
    with pytest.raises(GraphValidationError) as err:
        build_plan(image_generation({"guidance_scale": -1, "bogus": 1}).to_spec(), kinds)
    assert {issue.code for issue in err.value.issues} == {"bad_param"}


async def test_image_generation_workflow_returns_a_png(executor, tiny_llama):
    result = await (await executor.submit(image_generation().to_spec(), {"prompt": "a red disc"})).wait()
    assert result.status == "done", result.error
    with Image.open(io.BytesIO(result.outputs["image"])) as img:
        assert (img.format, img.size, img.mode) == ("PNG", (64, 64), "RGB")
    # What the runner gives for the same prompt, negative prompt (empty: BOS) and seed.
    runner = DiffusionRunner(tiny_llama, DiffusionConfig(page_size=4, steps=4))
    expected = runner.generate(Prompt.of(list(tiny_llama.tokenizer("a red disc").input_ids)), Prompt.of([BOS_ID]),
                               seed=1)
    assert torch.allclose(result.outputs["latents"], expected[0], atol=1e-5)


async def test_diffusion_attends_to_the_context_an_llm_nodes_kv_carries(executor, tiny_llama):
    """No prompt is tokenized again: the diffusion node takes the llm node's prompt and output ids
    from its `kv`, and its image is the one the runner makes for that context tokenized here."""
    prompt = "a red disc"
    result = await (await executor.submit(llm_then_diffusion().to_spec(), {"prompt": prompt})).wait()
    assert result.status == "done", result.error
    context = list(tiny_llama.tokenizer(prompt).input_ids) + result.outputs["tokens"]
    runner = DiffusionRunner(tiny_llama, DiffusionConfig(page_size=4, steps=4))
    expected = runner.generate(Prompt.of(context), Prompt.of([BOS_ID]), seed=1)
    assert torch.allclose(result.outputs["latents"], expected[0], atol=1e-5)


async def test_a_diffusion_node_without_a_prompt_needs_a_kv_with_token_ids(tiny_llama):
    role = RoleSpec(name="dit", kind="diffusion", model="tiny-llama", params={"page_size": 4, "steps": 1})
    unit = DiffusionUnit(role)
    try:
        bare = KVRef(model_id=unit.runner.model_id, page_size=4, layout=unit.runner.layout.to_dict())
        for inputs in ({}, {"kv": bare}):
            call = NodeCall("r", "paint", None, {}, inputs, ("latents",), False, False, 1, 1)
            with pytest.raises(UnitInputError, match="or a 'kv' carrying its context's token ids"):
                await unit.execute(call, NodeContext("r", "paint", 1, 1, lambda f, m: None))
    finally:
        await unit.close()


async def test_diffusion_reports_its_steps_and_decoders_and_encoders_their_items(executor, tiny_llama):
    run = await executor.submit(image_generation().to_spec(), {"prompt": "a red disc"})
    assert (await run.wait()).status == "done"
    media = await executor.submit(media_roundtrip().to_spec(), {"image": png_bytes(sample_picture()),
                                                                "sound": wav_bytes(sample_sound(0.5)),
                                                                "codes": [11, 12, 13]})
    assert (await media.wait()).status == "done"
    progress: dict[str, list[tuple[float | None, str]]] = {}  # the units' reports, once their nodes run
    waiting: dict[str, list[tuple[float | None, str]]] = {}  # reports while queued: the model loading
    running: set[str] = set()
    for event in [*run.log.snapshot(), *media.log.snapshot()]:
        if isinstance(event, NodeStateEvent) and event.state == "running":
            running.add(event.node)
        elif isinstance(event, NodeProgressEvent):
            (progress if event.node in running else waiting).setdefault(event.node, []).append(
                (event.progress, event.message))
    # Whatever the pace of the steps, the first report and the last are sent.
    assert progress["gen"][0] == (0.0, "0/4 steps") and progress["gen"][-1] == (1.0, "4/4 steps")
    for node in ("decode", "see", "hear", "speak"):
        assert progress[node] == [(0.0, "0/1 items"), (1.0, "1/1 items")], node
    assert waiting == {node: [(None, f"loading {model} (role {role})")] for node, role, model in (
        ("gen", "dit", "tiny-llama"), ("decode", "vae", "tiny-vae"), ("see", "vit", "tiny-vit"),
        ("hear", "ear", "tiny-audio-encoder"), ("speak", "voice", "tiny-audio-decoder"))}


async def test_diffusion_prompt_pages_are_kept_per_tenant(kinds, tiny_llama):
    """The diffusion unit's prompt pages are keyed with the run's tenant: a tenant's repeat
    reuses them, another tenant's identical prompt reuses none."""
    units: list = []

    def build(role: RoleSpec):
        units.append(kinds.role_kind(role.kind).load_runner()(role))
        return units[-1]

    ex = Executor(InProcessDispatcher(kinds, build=build), kinds)
    prompt = "a red disc on a blue square"
    try:
        reused = []
        for tenant in ("user:1", "user:1", "user:2"):
            result = await (await ex.submit(image_generation().to_spec(), {"prompt": prompt}, tenant=tenant)).wait()
            assert result.status == "done", result.error
            (dit,) = [u for u in units if isinstance(u, DiffusionUnit)]
            reused.append(dit.runner.stats.prompt_tokens_reused)
        assert reused[0] == 0 and reused[1] > 0 and reused[2] == reused[1]  # user:2 reused nothing of user:1's
        ids = Prompt.of(list(tiny_llama.tokenizer(prompt).input_ids))
        mine, theirs = (dit.runner.page_keys(ids, t) for t in ("user:1", "user:2"))
        assert mine and not set(mine) & set(theirs)
        assert all(dit.kv_store.contains(k) for k in [*mine, *theirs])
    finally:
        await ex.aclose()


async def test_media_workflow_encodes_and_decodes(executor):
    inputs = {"image": png_bytes(sample_picture()), "sound": wav_bytes(sample_sound(0.5)),
              "codes": [10 + (i * 7) % 1024 for i in range(20)]}
    result = await (await executor.submit(media_roundtrip().to_spec(), inputs)).wait()
    assert result.status == "done", result.error
    assert result.outputs["image_item"]["kind"] == "image" and result.outputs["image_item"]["length"] == 16
    assert result.outputs["image_embeds"].shape == (16, 64)
    assert result.outputs["audio_item"]["length"] == 13 and result.outputs["audio_item"]["hidden"] == 64
    with wave.open(io.BytesIO(result.outputs["wav"])) as w:
        assert (w.getframerate(), w.getsampwidth(), w.getnframes()) == (16000, 2, 20 * 160)


async def test_bad_media_fails_the_node_with_its_name(executor):
    inputs = {"image": b"not a png", "sound": wav_bytes(sample_sound(0.1)), "codes": [10]}
    result = await (await executor.submit(media_roundtrip().to_spec(), inputs)).wait()
    assert result.status == "failed" and "see" in result.error


async def test_roles_of_one_model_in_one_worker_share_the_module(tiny_llama):
    """Two diffusion roles and the LLM role's model come from one WeightStore: one module."""
    shared = WeightStore()
    roles = [RoleSpec(name=f"dit{i}", kind="diffusion", model="tiny-llama", params={"page_size": 4}) for i in (1, 2)]
    units = [DiffusionUnit(role, UnitContext(weights=shared)) for role in roles]
    vision = [VisionEncoderUnit(RoleSpec(name=f"vit{i}", kind="vision_encoder", model="tiny-vit"), UnitContext(weights=shared))
              for i in (1, 2)]
    try:
        llm = shared.llm("tiny-llama")  # what an llm role of this worker gets
        assert units[0].runner.model is units[1].runner.model is llm
        layer = llm.model.model.layers[0]
        bound = units[0].runner.transformer.weights.layers[0]
        assert bound.qkv_weight.data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
        assert bound.o_weight is layer.self_attn.o_proj.weight
        assert units[0].runner.head is units[1].runner.head
        assert vision[0].encoder is vision[1].encoder
        assert shared.users(WeightStore.llm_key("tiny-llama")) == 3
        shared.release(WeightStore.llm_key("tiny-llama"))
        pixels = sample_picture()
        assert np.array_equal(vision[0].encoder.encode(pixels).embeds, vision[1].encoder.encode(pixels).embeds)
    finally:
        for unit in (*units, *vision):
            await unit.close()
    assert shared.users(WeightStore.llm_key("tiny-llama")) == 0
    assert shared.users(WeightKey("vision_encoder", "tiny-vit->64")) == 0
