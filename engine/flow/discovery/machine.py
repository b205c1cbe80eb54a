"""This machine's GPUs, as `nvidia-smi` lists them: what a node agent announces and what a
local cluster seats its replicas on (`engine.flow.gpus`).

One place reads them, so the studio's node agents and `LocalCluster` number a machine's GPUs
alike (`nvidia-smi`'s index, PCI bus order). No `nvidia-smi` on `PATH`: no GPUs. One that
fails or prints what cannot be read is said in the log and counts as no GPUs (or skips the
line): a machine whose driver is broken cannot run GPU replicas either.
"""

from __future__ import annotations

import logging
import shutil
import subprocess

from engine.flow.discovery.nodes import GpuInfo

log = logging.getLogger(__name__)

NVIDIA_SMI_TIMEOUT_S = 10.0
_MIB_PER_GB = 1024.0


def detect_gpus(timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> tuple[GpuInfo, ...]:
    """The GPUs `nvidia-smi` lists, by index (none without it, or when it fails: said in the log)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ()
    try:
        out = subprocess.run([exe, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi failed (%s): taking this machine to have no GPUs", exc)
        return ()
    gpus = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            gpus.append(GpuInfo(int(parts[0]), parts[1], round(float(parts[2]) / _MIB_PER_GB, 2)))
        except ValueError:
            log.warning("nvidia-smi printed a line we cannot read: %r", line)
    return tuple(sorted(gpus, key=lambda g: g.index))
