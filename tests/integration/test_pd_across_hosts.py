"""A prefill -> decode handoff between two nodes: the prefill worker in one network namespace,
the decode worker in another (`engine.bench._netns`), each with its node's host identity
(`OMNIFLOW_HOST_ID`), so the decode worker pulls the prompt's pages over TCP with the plane's
CURVE keys, never through the shared memory the two namespaces could in fact both map. The
greedy tokens equal Hugging Face `generate`'s; the decode worker's metrics say which path the
pages took. Redis is reached from the namespaces through a forwarder this module owns on the
test network (`tests.tcp_forward`); every process it starts ends with the namespaces.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from transformers import AutoModelForCausalLM

from engine.bench._netns import Lan
from engine.compute.models import export_model
from engine.data.curve import PlaneKeys
from engine.data.peer import Peer, PeerConfig
from engine.flow.discovery import make_registry
from engine.flow.dsl import Workflow
from engine.flow.executor import Executor
from engine.flow.remote import WorkerDispatcher
from engine.spec.graph import encode_spec
from engine.spec.kinds import default_kinds
from engine.worker.announce import READY_PREFIX
from tests.integration.deployments import hf_greedy, text_ids
from tests.integration.workerfns import wait_until

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
ROOT = Path(__file__).resolve().parents[2]
NEW = 8
HB = 0.2
_NO_NETNS = Lan.unavailable()
pytestmark = [pytest.mark.redis,
              pytest.mark.skipif(_NO_NETNS is not None, reason=f"cannot make network namespaces here: {_NO_NETNS}")]


def pd_spec() -> Workflow:
    wf = Workflow("pd_hosts")
    params = {"page_size": 16}
    prefill = wf.role("prefill", kind="llm", model="tiny-llama", params=params)
    decode = wf.role("decode", kind="llm", model="tiny-llama", params={**params, "kv_pull_timeout_s": 20})
    tokens = wf.input("prompt", "tokens")
    pre = wf.node("pre", "llm.prefill", role=prefill, params={"max_new_tokens": NEW})
    dec = wf.node("dec", "llm.decode", role=decode)
    wf.edge(tokens, pre.inp("tokens"))
    wf.edge(pre, dec)
    wf.output("tokens", dec.out("tokens"), "tokens")
    return wf


@dataclass
class Hosts:
    namespace: str
    keys: PlaneKeys
    workers: dict[str, dict]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    tmp = tmp_path_factory.mktemp("hosts")
    spec_path = tmp / "pd.json"
    spec_path.write_bytes(encode_spec(pd_spec().to_spec()))
    keys = PlaneKeys.generate()
    keys_dir = keys.write(tmp / "keys")
    namespace = f"pd-hosts-{uuid.uuid4().hex[:8]}"
    redis = urlsplit(REDIS_URL)
    with Lan.make(["a", "b"]) as lan:
        forward = subprocess.Popen([sys.executable, "-m", "tests.tcp_forward", lan.host_address,
                                    f"{redis.hostname or '127.0.0.1'}:{redis.port or 6379}"],
                                   cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs: list[subprocess.Popen[str]] = []
        try:
            assert forward.stdout is not None
            port = int(forward.stdout.readline().split()[1])
            node_redis = f"redis://{lan.host_address}:{port}{redis.path or '/0'}"
            for role, node in (("prefill", lan.nodes["a"]), ("decode", lan.nodes["b"])):
                procs.append(subprocess.Popen(
                    [*node.exec_prefix, sys.executable, "-m", "engine.worker", "--role", role, "--workflow",
                     str(spec_path), "--registry", node_redis, "--namespace", namespace, "--listen",
                     f"tcp://{node.address}:0", "--keys", str(keys_dir), "--heartbeat", str(HB),
                     "--registry-ttl", "2", "--worker-id", f"{role}-{node.name}"],
                    cwd=ROOT, env={**os.environ, "OMNIFLOW_HOST_ID": f"node:{node.name}",
                                   "PYTHONPATH": str(ROOT)},
                    stdout=subprocess.PIPE, text=True))
            workers = {}
            for proc in procs:
                assert proc.stdout is not None
                for line in proc.stdout:  # READY once it registered; EOF if it died
                    if line.startswith(READY_PREFIX):
                        details = json.loads(line[len(READY_PREFIX):])
                        workers[details["role"]] = details
                        break
                else:
                    raise RuntimeError(f"a worker exited with {proc.wait(timeout=10)} before it was ready")
            yield Hosts(namespace, keys, workers)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
            assert forward.stdin is not None
            forward.stdin.close()
            forward.wait(timeout=10)


async def test_a_prefill_decode_handoff_crosses_nodes_over_tcp_and_matches_hf(hosts: Hosts, tmp_path: Path) -> None:
    prompt = text_ids(21, 100)  # 6 full pages of 16 KiB (past the inline limit) and a partial one
    assert hosts.workers["prefill"]["host"] != hosts.workers["decode"]["host"]
    registry = make_registry(REDIS_URL, namespace=hosts.namespace, ttl_s=2.0)
    peer = Peer.start(PeerConfig(keys=hosts.keys))
    executor = Executor(WorkerDispatcher(registry, peer, heartbeat_s=HB), default_kinds())
    try:
        run = await executor.submit(pd_spec().to_spec(), {"prompt": prompt})
        async with asyncio.timeout(120):
            result = await run.wait()
        assert result.status == "done", result.error
        tokens = result.outputs["tokens"]

        async def decode_counted_its_pull() -> dict | None:
            # A worker's metrics reach the registry with its next heartbeat, not with the reply.
            metrics = {s.role: s.load.metrics for s in await registry.workers()}
            counted = metrics.get("decode", {}).keys() >= {"kv.pull.tcp.pages", "transfer.tcp.pulls"}
            return metrics if counted else None

        metrics = await wait_until(decode_counted_its_pull, 10 * 2.0, "the decode worker's pull counted")
    finally:
        await executor.aclose()
        await registry.close()
        peer.close()
    model = AutoModelForCausalLM.from_pretrained(export_model("tiny-llama", tmp_path / "ckpt"),
                                                 local_files_only=True).eval()
    assert list(tokens) == hf_greedy(model, prompt, NEW)
    decode = metrics["decode"]
    assert decode["kv.pull.tcp.pages"] == 6 and "kv.pull.shm.pages" not in decode
    assert decode["transfer.tcp.pulls"] >= 1 and "transfer.shm.pulls" not in decode
