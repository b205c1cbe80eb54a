"""What a node agent announces: the resources it detects, overridden by the operator's settings."""

from __future__ import annotations

import pytest

from engine.flow.discovery.nodes import GpuInfo
from engine.spec.resources import Amounts
from studio.config import NodeSettings
from studio.workflows.deployments.announce import machine

DETECTED = (GpuInfo(0, "H200", 141.0), GpuInfo(1, "H200", 141.0))


def test_detected_resources_stand_unless_overridden() -> None:
    total, gpus = machine(NodeSettings(cpus=4, memory_gb=16), detected=DETECTED)
    assert total == Amounts(2, 4.0, 16.0) and gpus == DETECTED
    total, gpus = machine(NodeSettings(gpus=1, gpu_model="pretend", gpu_memory_gb=16, cpus=2, memory_gb=8),
                          detected=())
    assert total == Amounts(1, 2.0, 8.0) and gpus == (GpuInfo(0, "pretend", 16.0),)
    # fewer GPUs than detected: the first ones, as they are
    total, gpus = machine(NodeSettings(gpus=1, cpus=1, memory_gb=1), detected=DETECTED)
    assert gpus == DETECTED[:1] and total.gpus == 1
    total, gpus = machine(NodeSettings(gpus=0, cpus=1, memory_gb=1), detected=DETECTED)
    assert gpus == () and total.gpus == 0
    # only the memory overridden (a MIG slice, say)
    _, gpus = machine(NodeSettings(gpu_memory_gb=20, cpus=1, memory_gb=1), detected=DETECTED)
    assert [g.memory_gb for g in gpus] == [20.0, 20.0]


@pytest.mark.parametrize("node", [NodeSettings(), NodeSettings(gpus=0)])
def test_without_overrides_the_machine_is_read(node: NodeSettings) -> None:
    total, _ = machine(node, detected=())
    assert total.cpus >= 1 and total.memory_gb > 0 and total.gpus == 0
