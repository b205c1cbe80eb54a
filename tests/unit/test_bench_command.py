"""`omniflow bench NAME`: every benchmark is a module of `engine.bench`, listed and run the same way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from engine.cli import available_benchmarks

ROOT = Path(__file__).resolve().parents[2]


def test_every_benchmark_is_one_module_of_engine_bench():
    names = available_benchmarks()
    for name in ("batching", "control", "cuda_transfer", "decode", "hosts", "sglang", "studio", "transfer"):
        assert name in names
    assert not (ROOT / "bench").exists()  # one place for benchmarks


def test_a_gpu_benchmark_on_a_cpu_machine_stops_at_once_saying_why():
    out = subprocess.run([sys.executable, "-m", "engine.cli", "bench", "sglang", "--prompts", "2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 1 and "omniflow bench sglang" in out.stderr and "needs a GPU" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
