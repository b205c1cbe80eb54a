"""A publisher process for the GPU weight-sharing tests: `python -m tests.gpu.weights_publisher CKPT ROOT`.

Loads the causal LM checkpoint CKPT on cuda:0 through a `WeightStore` with `DeviceWeights`
(index files under ROOT), which publishes it, and prints one JSON line: the origin, the
last-position logits of `PROMPT`, and the float64 sum of every parameter. Then obeys commands
on standard input, one per line, answering `ok` to each: `bump NAME` adds 1 in place to
parameter NAME (a process attached to its memory must see it). At the end of its input it
closes the store (withdrawing the index) and exits.
"""

from __future__ import annotations

import json
import sys

import torch

from engine.compute.weights import DeviceWeights, HostWeights, WeightStore
from engine.data.peer import Peer

PROMPT = [256, 72, 105, 33, 10]
DEVICE = "cuda:0"


def main() -> int:
    checkpoint, root = sys.argv[1], sys.argv[2]
    with Peer.start() as peer:
        store = WeightStore(HostWeights(root=root), DeviceWeights(peer, root=root))
        try:
            loaded = store.llm(checkpoint, DEVICE)
            params = dict(loaded.model.named_parameters(remove_duplicate=False))
            with torch.inference_mode():
                logits = loaded.model(torch.tensor([PROMPT], device=DEVICE)).logits[0, -1]
                sums = {name: float(p.double().sum()) for name, p in params.items()}
            torch.cuda.synchronize()
            print(json.dumps({"origin": store.origin(WeightStore.llm_key(checkpoint, DEVICE)),
                              "logits": logits.tolist(), "sums": sums}), flush=True)
            for line in sys.stdin:
                command, _, arg = line.strip().partition(" ")
                if command == "bump" and arg in params:
                    with torch.no_grad():
                        params[arg].add_(1.0)
                    torch.cuda.synchronize()
                    print("ok", flush=True)
                else:
                    print(f"unknown command {line.strip()!r}", flush=True)
        finally:
            store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
