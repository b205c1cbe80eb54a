"""Role workers report the memory of their own GPU, on a real GPU (skipped where there is none:
CI has no GPU; `scripts/gpu_check.sh` runs these on a machine that has one).

A deployment of an llm role on `cuda:0` and a python role on the CPU: the llm worker's heartbeats
carry its device's memory (what torch's allocator holds for the model and its KV tier, the device's
total and free), which the studio charts per device and exports as `omniflow_gpu_memory_bytes`;
the python worker's carry its RSS and nothing of the GPU (it never asks CUDA, which would give it
a CUDA context of its own).
"""

from __future__ import annotations

import asyncio
import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine.flow.dsl import Workflow  # noqa: E402
from engine.worker.launcher import LocalCluster  # noqa: E402
from workflows.ops.chat import join_text  # noqa: E402

DEVICE_PAGES = 256


def gpu_spec():
    wf = Workflow("gpu-metrics")
    llm = wf.role("llm", kind="llm", model="tiny-llama", device="cuda:0",
                  params={"page_size": 16, "device_pages": DEVICE_PAGES})
    py = wf.role("py", kind="python")
    prompt = wf.input("prompt", "text")
    reply = wf.node("reply", "llm", role=llm, params={"max_new_tokens": 4})
    wf.edge(prompt, reply.inp("prompt"))
    text = wf.python(join_text, role=py, id="join")
    wf.edge(reply.out("text"), text.inp("parts"))
    wf.output("text", text, "text")
    return wf.to_spec()


async def test_a_gpu_worker_reports_its_devices_memory_and_a_cpu_worker_none() -> None:
    cluster = LocalCluster(gpu_spec(), allow_module_ops=False, heartbeat_s=0.2, ready_timeout_s=120.0)
    await cluster.start()
    try:
        deadline = time.monotonic() + 30
        while True:  # the launcher polls each worker's load into the in-process registry
            (llm,) = await cluster.registry.workers("llm")
            (py,) = await cluster.registry.workers("py")
            if "gpu_memory_allocated_bytes" in llm.load.metrics and py.load.metrics.get("rss_bytes"):
                break
            assert time.monotonic() < deadline, (llm.load.metrics, py.load.metrics)
            await asyncio.sleep(0.1)
        m = llm.load.metrics
        kv_bytes = m["kv.device.capacity_bytes"]
        assert llm.info.device == "cuda:0"
        # the model's weights and the preallocated device tier live in torch's allocator on cuda:0
        assert m["gpu_memory_allocated_bytes"] >= kv_bytes > 0, m
        assert m["gpu_memory_reserved_bytes"] >= m["gpu_memory_allocated_bytes"]
        assert m["gpu_memory_total_bytes"] == torch.cuda.get_device_properties(0).total_memory
        assert 0 < m["gpu_memory_free_bytes"] < m["gpu_memory_total_bytes"]
        assert m["rss_bytes"] > 0
        assert not [k for k in py.load.metrics if k.startswith("gpu_")], py.load.metrics
    finally:
        await cluster.stop()
