"""What travels between a `TPRole` driver and its ranks: msgspec frames, raw tensors, no pickle."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import msgspec
import pytest
import torch

from engine.compute.llm.config import EngineConfig
from engine.compute.llm.transfer import KVHandoff
from engine.compute.models.catalog import BUILTIN_MODELS
from engine.compute.tp import role as tp_role
from engine.compute.tp.messages import TPRoleCall, TPRoleReply, TPRoleRequest, TPRoleResult

TP_DIR = Path(tp_role.__file__).parent
DRIVER_PATH_MODULES = ["role.py", "worker.py", "group.py", "messages.py"]
FORBIDDEN_MODULES = {"pickle", "_pickle", "cloudpickle", "dill", "copyreg", "marshal", "shelve", "multiprocessing"}
FORBIDDEN_CALLS = {"gather_object", "broadcast_object_list", "all_gather_object", "scatter_object_list",
                   "send_object_list", "recv_object_list", "send_pyobj", "recv_pyobj"}


@pytest.mark.parametrize("module", DRIVER_PATH_MODULES)
def test_no_tp_role_module_pickles(module: str) -> None:
    tree = ast.parse((TP_DIR / module).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {alias.name.split(".")[0] for alias in node.names}
            assert not names & FORBIDDEN_MODULES, f"{module}:{node.lineno} imports {names & FORBIDDEN_MODULES}"
        elif isinstance(node, ast.ImportFrom):
            root = (node.module or "").split(".")[0]
            assert root not in FORBIDDEN_MODULES, f"{module}:{node.lineno} imports {root}"
            assert not node.module or not node.module.startswith("torch.multiprocessing")
        elif isinstance(node, ast.Attribute):
            assert node.attr not in FORBIDDEN_CALLS, f"{module}:{node.lineno} calls {node.attr}"


def test_rank_spec_travels_as_json_with_its_configs() -> None:
    spec = tp_role.RankSpec(model=BUILTIN_MODELS["tiny-qwen2"], engine=EngineConfig(page_size=4), threads=2)
    assert msgspec.json.decode(msgspec.json.encode(spec), type=tp_role.RankSpec) == spec
    by_name = tp_role.RankSpec(model="tiny-llama")
    assert msgspec.json.decode(msgspec.json.encode(by_name), type=tp_role.RankSpec) == by_name


def _through_the_pipe(value: object, name: str) -> object:
    """`value` as rank 0 sends `cmd_<name>`'s result and the driver reads it back, over a real pipe."""
    read_fd, write_fd = os.pipe()
    try:
        raw = msgspec.msgpack.encode(value, enc_hook=tp_role._enc_hook)
        tp_role._write_frame(write_fd, msgspec.msgpack.encode(TPRoleResult(msgspec.Raw(raw))))
        reader = tp_role._FrameReader(read_fd)
        reader.fill()
        frame = reader.next_frame()
        assert frame is not None and reader.next_frame() is None
    finally:
        os.close(read_fd)
        os.close(write_fd)
    reply = msgspec.msgpack.decode(frame, type=TPRoleReply)
    assert isinstance(reply, TPRoleResult)
    return msgspec.msgpack.decode(reply.value, type=tp_role._result_type(name), dec_hook=tp_role._dec_hook)


def test_tensors_and_a_handoff_come_back_bit_exactly() -> None:
    pages = [torch.randn(2, 4, 3, 1, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    tails = [torch.arange(96, dtype=torch.float32).view(4, 3, 1, 8) + r for r in range(2)]
    handoff = KVHandoff(handoff_id="h", model_id="m", layout={"num_kv_heads": 1}, tenant_salt=None,
                        prompt_ids=(1, 2, 3), key_ids=(1, 2, 3), page_hashes=("a", "b"), tail_len=1,
                        tail=tails[0], first_token=9)
    got = _through_the_pipe({"handoff": handoff, "pages": pages, "tails": tails}, "prefill")
    assert isinstance(got, dict) and isinstance(got["handoff"], KVHandoff)
    assert got["handoff"].page_hashes == ("a", "b") and torch.equal(got["handoff"].tail, tails[0])
    assert all(torch.equal(a, b) for a, b in zip(got["pages"], pages, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got["tails"], tails, strict=True))
    image = torch.randn(1, 4, 8, 8).transpose(2, 3)  # not contiguous: sent as its values
    back = _through_the_pipe(image, "diffuse")
    assert isinstance(back, torch.Tensor) and torch.equal(back, image)
    back.add_(1)  # the driver owns a writable copy
    bf16 = torch.randn(3, 5).to(torch.bfloat16)
    assert torch.equal(_through_the_pipe(bf16, "diffuse"), bf16)


def test_what_cannot_travel_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="cannot travel"):
        msgspec.msgpack.encode({"x": object()}, enc_hook=tp_role._enc_hook)
    call = msgspec.msgpack.encode(TPRoleCall("generate", [["hi"], 4]))
    assert msgspec.msgpack.decode(call, type=TPRoleRequest) == TPRoleCall("generate", [["hi"], 4])
