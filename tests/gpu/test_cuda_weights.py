"""GPU weights shared across processes by CUDA IPC, on a real GPU (skipped where there is none:
CI has no GPU; `scripts/gpu_check.sh` runs these on a machine that has one).

A publisher process (`tests.gpu.weights_publisher`) loads a 52 MB causal LM on cuda:0 through
a `WeightStore` with `DeviceWeights`, which publishes it; this process attaches through a
`WeightStore` of its own. The attached model must be the publisher's memory (one copy on the
GPU, not two) and hold the checkpoint's weights.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine.compute.models.catalog import ModelConfig  # noqa: E402
from engine.compute.models.loader import LoadedModel, build_model, load_model  # noqa: E402
from engine.compute.models.tokenizer import build_byte_tokenizer  # noqa: E402
from engine.compute.weights import DeviceWeights, HostWeights, WeightStore  # noqa: E402
from engine.data.peer import Peer  # noqa: E402
from tests.gpu.child import Child  # noqa: E402

DEVICE = "cuda:0"
PROMPT = [256, 72, 105, 33, 10]  # as `tests.gpu.weights_publisher` runs it
CONFIG = ModelConfig(name="ipc-llama", family="llama", hidden_size=512, num_layers=4, num_heads=8,
                     num_kv_heads=8, intermediate_size=1408, seed=1)
BUMPED = "model.layers.1.self_attn.q_proj.weight"


class Publisher(Child):
    def __init__(self, checkpoint: Path, root: Path) -> None:
        super().__init__("tests.gpu.weights_publisher", str(checkpoint), str(root),
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
        self.published: dict[str, Any] = {}

    def wait_published(self) -> None:
        self.published = json.loads(self.line())


@dataclass(slots=True)
class Attached:
    checkpoint: str
    publisher: Publisher
    store: WeightStore
    loaded: LoadedModel | None
    grew: int  # bytes torch.cuda.memory_allocated grew by while attaching
    reference: dict[str, torch.Tensor]  # the checkpoint loaded on the CPU, by parameter name

    @property
    def params(self) -> dict[str, torch.Tensor]:
        assert self.loaded is not None
        return dict(self.loaded.model.named_parameters(remove_duplicate=False))


@pytest.fixture(scope="module")
def attached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Attached]:
    checkpoint, root = tmp_path_factory.mktemp("checkpoint"), tmp_path_factory.mktemp("index")
    build_model(CONFIG).save_pretrained(checkpoint)
    build_byte_tokenizer().save_pretrained(checkpoint)
    reference = load_model(path=checkpoint)
    params = dict(reference.model.named_parameters(remove_duplicate=False))
    publisher = Publisher(checkpoint, root)
    try:
        publisher.wait_published()
        with Peer.start() as peer:
            store = WeightStore(HostWeights(root=str(root)), DeviceWeights(peer, root=str(root)))
            torch.cuda.init()
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(DEVICE)
            loaded = store.llm(str(checkpoint), DEVICE)
            torch.cuda.synchronize()
            state = Attached(str(checkpoint), publisher, store, loaded, torch.cuda.memory_allocated(DEVICE) - before, params)
            del loaded
            yield state
            # Let go of the publisher's memory before it exits (it must outlive its attachers).
            state.loaded = None
            store.close()
            gc.collect()
            torch.cuda.synchronize()
    finally:
        publisher.close()


def test_the_second_process_attaches_instead_of_loading(attached: Attached) -> None:
    key = WeightStore.llm_key(attached.checkpoint, DEVICE)
    assert attached.publisher.published["origin"] == "published"
    assert attached.store.origin(key) == "attached"
    params = attached.params
    assert all(p.device == torch.device(DEVICE) and not p.requires_grad for p in params.values())
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    assert nbytes > 40 * 2**20
    # Mapped memory is the publisher's allocation: nothing of the model is allocated here.
    assert attached.grew < 0.05 * nbytes, f"attaching allocated {attached.grew} bytes of a {nbytes}-byte model"
    assert attached.store.device is not None and attached.store.device.reclaim() == []  # the publisher lives


def test_the_attached_weights_are_the_checkpoints(attached: Attached) -> None:
    params = attached.params
    assert set(params) == set(attached.reference)
    for name, reference in attached.reference.items():
        assert torch.equal(params[name].cpu(), reference), name
    sums = attached.publisher.published["sums"]
    with torch.inference_mode():
        assert {name: float(p.double().sum()) for name, p in params.items()} == pytest.approx(sums, rel=1e-12)
        assert attached.loaded is not None
        logits = attached.loaded.model(torch.tensor([PROMPT], device=DEVICE)).logits[0, -1]
    expected = torch.tensor(attached.publisher.published["logits"], dtype=logits.dtype)
    torch.testing.assert_close(logits.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_the_attached_weights_are_the_publishers_memory(attached: Attached) -> None:
    """Runs last: it changes the shared weights."""
    tensor = attached.params[BUMPED]
    assert torch.equal(tensor.cpu(), attached.reference[BUMPED])
    assert attached.publisher.ask(f"bump {BUMPED}") == "ok"
    torch.cuda.synchronize()
    assert torch.equal(tensor.cpu(), attached.reference[BUMPED] + 1.0)
