"""A producer process for the CUDA IPC tests: `python -m tests.gpu.cuda_peer N`.

Puts `torch.arange(N, dtype=float32)` on cuda:0 into its store and prints the ref
(msgpack, hex) on one line; then obeys commands on standard input, one per line, answering
`ok` to each: `bump` adds 1 to the stored tensor in place (the consumer, sharing its memory,
must see it), `release` releases the ref, `stats` prints the store's stats as JSON. It exits at
the end of its input.
"""

from __future__ import annotations

import json
import sys

import msgspec
import torch

from engine.data.peer import Peer


def main() -> int:
    n = int(sys.argv[1])
    with Peer.start() as peer:
        ref = peer.put(torch.arange(n, dtype=torch.float32, device="cuda:0"))
        torch.cuda.synchronize()
        print(msgspec.msgpack.encode(ref).hex(), flush=True)
        for line in sys.stdin:
            command = line.strip()
            if command == "bump":
                entry = peer.store.get(ref.id)
                assert entry.cuda is not None, "a CUDA tensor stays on its GPU in the store"
                entry.cuda.add_(1)
                torch.cuda.synchronize()
                print("ok", flush=True)
            elif command == "release":
                print("ok" if peer.release(ref) else "gone", flush=True)
            elif command == "stats":
                stats = peer.store.stats()
                print(json.dumps({"live_refs": stats.live_refs, "segments": stats.segments}), flush=True)
            else:
                print(f"unknown command {command!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
