"""Weight sharing: one module per worker process (`WeightStore`), one copy per host (`HostWeights`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import msgspec
import pytest
import torch

from engine.compute.llm.layers import DecoderWeights
from engine.compute.models.catalog import ModelConfig
from engine.compute.models.loader import build_model
from engine.compute.models.tokenizer import build_byte_tokenizer
from engine.compute.sampling import SamplingParams
from engine.compute.weights import HostWeights, SharedWeightsError, WeightKey, WeightStore
from engine.data.shm import list_segments


@pytest.fixture
def prefix(request) -> str:
    """A segment prefix of this test alone; asserts it leaves nothing behind."""
    name = f"omniflowweightstest{os.getpid()}{abs(hash(request.node.name)) % 10**6}"
    yield name
    leftovers = [f for f in os.listdir("/dev/shm") if f.startswith(f"{name}-")]
    assert not leftovers, leftovers


def test_acquire_loads_once_and_the_last_release_drops():
    store = WeightStore()
    key = WeightKey("test", "a")
    loads: list[int] = []
    started = threading.Barrier(4)
    got: list[object] = []

    def load() -> object:
        loads.append(1)
        return object()

    def user() -> None:
        started.wait()
        got.append(store.acquire(key, load))

    threads = [threading.Thread(target=user) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(loads) == 1 and len({id(value) for value in got}) == 1
    assert store.users(key) == 4
    for _ in range(4):
        store.release(key)
    assert store.users(key) == 0
    assert store.acquire(key, load) is not got[0]  # dropped, so loaded anew
    with pytest.raises(ValueError):
        store.acquire(WeightKey("test", "b"), lambda: (_ for _ in ()).throw(ValueError("bad")))
    assert store.users(WeightKey("test", "b")) == 0


def test_host_weights_publish_and_attach_in_place(prefix: str, tiny_llama):
    first, second = WeightStore(HostWeights(prefix=prefix)), WeightStore(HostWeights(prefix=prefix))
    try:
        owner = first.llm("tiny-llama")
        attached = second.llm("tiny-llama")
        key = WeightStore.llm_key("tiny-llama")
        assert (first.origin(key), second.origin(key)) == ("published", "attached")
        assert attached.model_id == tiny_llama.model_id and attached.eos_token_ids == tiny_llama.eos_token_ids
        ids = torch.tensor([[256, 72, 105, 33, 10]])
        with torch.inference_mode():
            expected = tiny_llama.model(ids).logits
            assert torch.equal(owner.model(ids).logits, expected)
            assert torch.equal(attached.model(ids).logits, expected)
        params = dict(attached.model.named_parameters())
        assert not any(p.is_meta for p in params.values())
        assert len(list_segments(prefix=prefix)) == 1  # one segment, mapped by both stores
    finally:
        first.close()
        second.close()
    assert list_segments(prefix=prefix) == []


def test_a_runner_over_attached_weights_fuses_them_in_place(prefix: str):
    """The host segment lays a layer's q/k/v (and gate/up) weights out side by side, so the model
    runner's fused projections over an attached model are views of the segment, not copies (the
    host holds one copy of the weights however many processes run them); a bfloat16 model is
    published under its own key."""
    first, second = WeightStore(HostWeights(prefix=prefix)), WeightStore(HostWeights(prefix=prefix))
    try:
        first.llm("tiny-llama", dtype="bfloat16")
        attached = second.llm("tiny-llama", dtype="bfloat16")
        assert second.origin(WeightStore.llm_key("tiny-llama", dtype="bfloat16")) == "attached"
        assert second.origin(WeightStore.llm_key("tiny-llama")) is None
        assert attached.dtype == torch.bfloat16
        layer = attached.model.model.layers[0]
        before = layer.self_attn.q_proj.weight.data_ptr(), layer.mlp.gate_proj.weight.data_ptr()
        bound = DecoderWeights.of(attached.model).layers[0]
        assert (bound.qkv_weight.data_ptr(), bound.gate_up_weight.data_ptr()) == before
        assert torch.equal(bound.qkv_weight, torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                                        layer.self_attn.v_proj.weight]))
    finally:
        first.close()
        second.close()


def _packed_copies(unit) -> int:
    weights = unit.engine.forward.weights
    return sum(p is not None for layer in weights.layers for _, p in layer.products()) + (weights.lm_packed is not None)


async def test_llm_roles_over_host_shared_weights_keep_no_private_packed_copy_unless_asked(prefix: str):
    """Two float32 llm roles of one model over a host's shared copy (one publishes, one attaches):
    neither keeps a packed copy of the weights, which could not be shared (two replicas would
    hold about three copies); a role that asks for one (`packed_float32: true`) gets it, and a
    role with its weights to itself packs them where the role leaves it unset."""
    from engine.compute.context import UnitContext
    from engine.compute.llm.unit import LLMUnit
    from engine.spec.graph import RoleSpec

    first, second = WeightStore(HostWeights(prefix=prefix)), WeightStore(HostWeights(prefix=prefix))
    units = []
    try:
        units.append(LLMUnit(RoleSpec(name="a", kind="llm", model="tiny-llama"), UnitContext(weights=first)))
        units.append(LLMUnit(RoleSpec(name="b", kind="llm", model="tiny-llama"), UnitContext(weights=second)))
        assert [store.origin(WeightStore.llm_key("tiny-llama")) for store in (first, second)] == ["published",
                                                                                                  "attached"]
        assert [_packed_copies(unit) for unit in units] == [0, 0]
        assert all(unit.engine.config.packed_float32 is False for unit in units)
        asked = LLMUnit(RoleSpec(name="c", kind="llm", model="tiny-llama", params={"packed_float32": True}),
                        UnitContext(weights=second))
        units.append(asked)
        alone = LLMUnit(RoleSpec(name="d", kind="llm", model="tiny-llama"))
        units.append(alone)
        if torch.backends.mkldnn.is_available():
            assert _packed_copies(asked) > 0 and _packed_copies(alone) > 0
        prompt = [[72, 101, 108, 108, 111]]
        texts = {tuple(unit.engine.generate(prompt, SamplingParams(max_new_tokens=6))[0].output_ids) for unit in units}
        assert len(texts) == 1  # the same tokens, packed or not
    finally:
        for unit in units:
            await unit.close()
        first.close()
        second.close()


def test_attach_refuses_a_mismatched_module_and_ignores_dead_owners(prefix: str):
    host = HostWeights(prefix=prefix)
    try:
        manifest = host.publish("k", torch.nn.Linear(4, 3))
        with pytest.raises(SharedWeightsError):
            host.attach(manifest, lambda: torch.nn.Linear(4, 5, bias=False))
        linear = host.attach(manifest, lambda: torch.nn.Linear(4, 3))
        assert linear(torch.ones(1, 4)).shape == (1, 3)
        assert host.lookup("k") == manifest and host.lookup("other") is None
        # An index left by a process that died names a segment nobody owns: not attached.
        dead = msgspec.structs.replace(manifest, segment=f"{prefix}-999999999-1-0")
        with open(host.index_path("k"), "wb") as f:
            f.write(msgspec.json.encode(dead))
        assert host.lookup("k") is None
        assert host.reclaim() == [os.path.basename(host.index_path("k"))]  # the live segment stays
        assert host.lookup("other") is None and os.path.exists(f"/dev/shm/{manifest.segment}")
    finally:
        host.close()


def test_reclaim_leaves_an_index_being_written_by_a_live_publisher(prefix: str):
    """Another worker's start-up reclaim must not take the staging file of an index this
    process is writing (it was read as a partial index and removed: a publish then failed)."""
    host = HostWeights(prefix=prefix)
    try:
        manifest = host.publish("k", torch.nn.Linear(4, 3))
        live = f"{host.index_path('w')}.{manifest.segment}"
        dead = f"{host.index_path('x')}.{prefix}-999999999-1-0"
        for staging in (live, dead):
            open(staging, "wb").close()  # created, nothing written yet
        assert host.reclaim() == [os.path.basename(dead)]
        assert os.path.exists(live)
        os.unlink(live)
    finally:
        host.close()


_CHILD = r"""
import gc, json, resource, sys
import psutil, torch
import engine.compute.models.loader  # the code `store.llm` runs (transformers) is in the baseline: only weights count
from engine.compute.weights import HostWeights, WeightStore
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
ref, prefix = sys.argv[1], sys.argv[2]
proc = psutil.Process()
def mem():
    gc.collect()
    m = proc.memory_full_info()
    shared = sum(mp.rss for mp in proc.memory_maps() if prefix in mp.path)
    return {"uss": m.uss, "pss": m.pss, "rss": m.rss, "segment": shared}
def say(obj):
    print(json.dumps(obj), flush=True)
store = WeightStore(HostWeights(prefix=prefix))
say({"stage": "imported"})
sys.stdin.readline()
before = mem()
loaded = store.llm(ref)
with torch.inference_mode():
    logits = loaded.model(torch.tensor([[256, 72, 105]])).logits
say({"before": before, "after": mem(), "origin": store.origin(WeightStore.llm_key(ref)),
     "logits": logits.flatten()[:8].tolist()})
for line in sys.stdin:
    command = line.strip()
    if command == "measure":
        say({"now": mem()})
    elif command == "write":
        with torch.no_grad():
            loaded.model.lm_head.weight.add_(1.0)  # read-only mapping: the process faults here
        say({"wrote": True})
    else:
        break
store.close()
"""


class _Child:
    def __init__(self, ref: str, prefix: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, ref, prefix], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=dict(os.environ, HF_HUB_OFFLINE="1"), cwd=os.getcwd(),
        )

    def ask(self, command: str | None = None) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"child exited with {self.proc.wait(timeout=30)}"
        return json.loads(line)

    def stop(self) -> int:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("exit\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                return self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(timeout=30)


def test_two_processes_hold_one_copy(tmp_path, prefix: str):
    """Two worker processes serving the same 52 MB model: the publisher's private copy moves into
    the segment, the attacher maps it. Together they hold about one copy: what each holds alone
    (USS) plus the segment, counted once. (PSS is noisier here: it also splits the pages of
    shared libraries that the first forward faults in with every other process on the machine.)
    The attached weights are read-only memory: a write kills the writer, not the weights."""
    config = ModelConfig(name="mem-llama", family="llama", hidden_size=512, num_layers=4, num_heads=8,
                         num_kv_heads=8, intermediate_size=1408, seed=1)
    model = build_model(config)
    model.save_pretrained(tmp_path)
    build_byte_tokenizer().save_pretrained(tmp_path)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    publisher, attacher = _Child(str(tmp_path), prefix), _Child(str(tmp_path), prefix)
    try:
        publisher.ask(), attacher.ask()
        published = publisher.ask("load")
        attached = attacher.ask("load")
        assert (published["origin"], attached["origin"]) == ("published", "attached")
        assert attached["logits"] == published["logits"]
        a_now, b_now = publisher.ask("measure")["now"], attacher.ask("measure")["now"]

        def grew(record: dict, key: str, now: dict | None = None) -> float:
            return ((now or record["after"])[key] - record["before"][key]) / nbytes

        assert grew(published, "uss") > 0.8  # a copy shows in the measure while one process maps it
        assert grew(attached, "uss") < 0.1  # attaching takes no private copy
        assert grew(attached, "rss") > 0.8  # yet the attacher reads every weight
        assert a_now["segment"] / nbytes > 0.95 and b_now["segment"] / nbytes > 0.95  # both map all of it
        together = grew(published, "uss", a_now) + grew(attached, "uss", b_now) + a_now["segment"] / nbytes
        assert together < 1.3, f"two processes hold {together:.2f} copies"
        assert grew(published, "pss", a_now) + grew(attached, "pss", b_now) < 1.7
        assert attacher.proc.stdin is not None
        attacher.proc.stdin.write("write\n")
        attacher.proc.stdin.flush()
        assert attacher.proc.wait(timeout=30) == -signal.SIGSEGV
        assert publisher.ask("measure")["now"]["rss"] > 0  # the publisher lives on
    finally:
        codes = [child.stop() for child in (publisher, attacher)]
    assert codes[0] == 0


def test_processes_loading_at_once_load_one_copy(tmp_path, prefix: str):
    """Workers of one model start together (a deployment's replicas, an llm and a diffusion role):
    the first to take the model's host lock loads and publishes it, the others wait and attach."""
    build_model(ModelConfig(name="race-llama", family="llama", hidden_size=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, intermediate_size=128, seed=2)).save_pretrained(tmp_path)
    build_byte_tokenizer().save_pretrained(tmp_path)
    children = [_Child(str(tmp_path), prefix) for _ in range(3)]
    try:
        for child in children:
            child.ask()
        for child in children:  # every one asks before any has answered
            assert child.proc.stdin is not None
            child.proc.stdin.write("load\n")
            child.proc.stdin.flush()
        loaded = [child.ask() for child in children]
        assert sorted(r["origin"] for r in loaded) == ["attached", "attached", "published"]
        assert all(r["logits"] == loaded[0]["logits"] for r in loaded)
        assert len(list_segments(prefix=prefix)) == 1
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"{prefix}-lock-")]  # the lock went
    finally:
        codes = [child.stop() for child in children]
    assert codes == [0, 0, 0]
