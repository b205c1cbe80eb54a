"""`omniflow bench weights [--model smollm2-135m] [--replicas 2] [--json]`: the memory that role
workers of one model hold on one host, with the host's weight sharing (`HostWeights`) and without.

One `llm` role of `--replicas` replicas (round-robin) runs on `LocalCluster` workers, started
together (as a deployment starts them), twice: as the workers run by default, sharing CPU weights
through one shared-memory segment per model, and with `--no-host-weights`, each loading a copy of
its own (the anchor). Each replica first generates `--new-tokens` greedy tokens, so every weight
has been read. Then, per worker process (`psutil`'s `memory_full_info`, from `/proc/PID/smaps`):

* `uss`: memory only that process holds; `pss`: its share of everything it maps (pages mapped by
  k processes count 1/k each), so the workers' PSS add up to what they hold together;
* `shared_*_mib` / `private_*_mib`: the workers' summed PSS and USS in each mode, and
  `model_mib` the weights' bytes;
* `baseline_pss_mib`: the PSS of a worker that holds next to no model: the same role and
  generations on `--baseline-model` (`tiny-llama`, 1 MB of weights), measured in the same run;
* `copies_shared` / `copies_private`: (summed PSS - the replicas' baseline) / the weights' bytes,
  i.e. how many copies of the model (and what running it costs besides: activations, a small KV
  cache) the host holds. Goal: `copies_shared` about 1 whatever `--replicas` is. Without sharing a
  worker's weights are partly its own (the fused projections are copies) and partly pages of the
  checkpoint file that `safetensors` maps, which the page cache shares between the processes
  reading the same file: `copies_private` lies between 1 and `--replicas`.
* `pss_ratio_shared_vs_private`: summed PSS shared / private.

A worker whose host shares its weights keeps no packed copy of them unless the role asks for one
(`packed_float32`, unset by default; `engine.compute.llm.config.EngineConfig`): with
`--packed-float32` each worker also keeps a private copy, in oneDNN's packed layout, of the
float32 weights whose decode products it measured fastest so (`engine.compute.llm.products`),
which cannot be shared, and `copies_shared` counts them. (`--no-host-weights` workers hold their
weights alone, and so keep those copies where the role leaves it unset.)
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import psutil

from engine.data.peer import Peer, PeerConfig
from engine.flow.dsl import Workflow
from engine.flow.executor import Executor
from engine.flow.remote import WorkerDispatcher
from engine.spec.graph import GraphSpec
from engine.spec.kinds import default_kinds
from engine.worker.launcher import LocalCluster

MiB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="an LLM: a built-in name or a checkpoint directory")
    parser.add_argument("--replicas", type=int, default=2, help="worker processes of the role")
    parser.add_argument("--baseline-model", default="tiny-llama", help="the worker without a model to speak of")
    parser.add_argument("--new-tokens", type=int, default=4, help="greedy tokens each replica generates first")
    parser.add_argument("--packed-float32", action=argparse.BooleanOptionalAction, default=None,
                        help="set the role param packed_float32 (default: unset, the role's default): on, each worker"
                        " keeps a private packed copy of the float32 weights its decode products measured fastest"
                        " over one")


def role_spec(model: str, replicas: int, new_tokens: int, packed_float32: bool | None = None) -> GraphSpec:
    wf = Workflow("bench_weights")
    params: dict[str, Any] = {"device_pages": 64}
    if packed_float32 is not None:
        params["packed_float32"] = packed_float32
    llm = wf.role("llm", kind="llm", model=model, replicas=replicas, balance="round_robin", params=params)
    prompt = wf.input("prompt", "text", default="The capital of France is")
    reply = wf.node("reply", "llm", role=llm, params={"max_new_tokens": new_tokens})
    wf.edge(prompt, reply.inp("prompt"))
    wf.output("text", reply.out("text"), "text")
    return wf.to_spec()


def _memory(pid: int) -> dict[str, int]:
    info = psutil.Process(pid).memory_full_info()
    return {"uss": int(info.uss), "pss": int(info.pss), "rss": int(info.rss)}


async def _measure(spec: GraphSpec, replicas: int, share: bool = True) -> list[dict[str, int]]:
    cluster = LocalCluster(spec, allow_module_ops=False, ready_timeout_s=600.0,
                           extra_args=() if share else ("--no-host-weights",))
    peer = Peer.start(PeerConfig(keys=cluster.keys))
    executor = None
    try:
        await cluster.start()
        executor = Executor(WorkerDispatcher(cluster.registry, peer), default_kinds())
        plan = executor.plan(spec)
        for _ in range(replicas):  # round robin: one generation per replica reads all its weights
            result = await (await executor.submit(plan, {})).wait()
            if result.status != "done":
                raise RuntimeError(f"bench run failed: {result.error}")
        return [_memory(worker.pid) for worker in cluster.workers]
    finally:
        if executor is not None:
            await executor.aclose()
        await cluster.stop()
        peer.close()


def _model_bytes(model: str) -> int:
    from pathlib import Path

    from engine.compute.models.loader import load_model

    loaded = load_model(path=model) if Path(model).is_dir() else load_model(name=model)
    seen: set[int] = set()
    total = 0
    for tensor in [*loaded.model.parameters(), *loaded.model.buffers()]:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.replicas < 2:
        raise SystemExit("--replicas: at least 2 (sharing is between processes)")
    spec = role_spec(args.model, args.replicas, args.new_tokens, args.packed_float32)
    started = time.perf_counter()
    model = _model_bytes(args.model)
    baseline = asyncio.run(_measure(role_spec(args.baseline_model, args.replicas, args.new_tokens), args.replicas))
    shared = asyncio.run(_measure(spec, args.replicas, share=True))
    private = asyncio.run(_measure(spec, args.replicas, share=False))
    base = sum(w["pss"] for w in baseline) / len(baseline)

    def copies(workers: list[dict[str, int]]) -> float:
        return (sum(w["pss"] for w in workers) - base * len(workers)) / model

    out: dict[str, Any] = {"model": args.model, "replicas": args.replicas, "packed_float32": args.packed_float32,
                           "model_mib": model / MiB,
                           "baseline_pss_mib": base / MiB}
    for name, workers in (("shared", shared), ("private", private)):
        out[f"{name}_pss_mib"] = sum(w["pss"] for w in workers) / MiB
        out[f"{name}_uss_mib"] = sum(w["uss"] for w in workers) / MiB
        out[f"{name}_rss_mib"] = sum(w["rss"] for w in workers) / MiB
        out[f"{name}_worker_pss_mib"] = ", ".join(f"{w['pss'] / MiB:.0f}" for w in workers)
        out[f"copies_{name}"] = copies(workers)
    out["pss_ratio_shared_vs_private"] = out["shared_pss_mib"] / out["private_pss_mib"]
    out["seconds"] = time.perf_counter() - started
    return out
