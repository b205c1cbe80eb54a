"""The prefill side of the transfer plug-in tests, run as its own process:

    python -m tests.sglang.transfer_peer --bootstrap-port P --room R --mode send|die

It builds seeded CPU KV and aux buffers (`prefill_buffers`), an omniflow KV manager in
prefill mode that registers at the bootstrap server, and a sender for room R, then prints
`READY` once registered. `send`: waits for the decode (`WaitingForInput`), sends the pages
`SOURCE_PAGES` in two chunks and prints `RESULT <KVPoll>` when the sender settles. `die`:
exits abruptly once the decode is waiting, without sending.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll

from tests.sglang.polling import poll_until

PAGE, HEADS, DIM, LAYERS = 4, 2, 8, 3
POOL_PAGES = 32
AUX_ROWS = 8
SOURCE_PAGES = [3, 17, 5, 30, 9, 11]
SOURCE_AUX = 2


def server_args(bootstrap_port: int) -> SimpleNamespace:
    """The ServerArgs fields the manager reads (a full ServerArgs needs a model)."""
    return SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=bootstrap_port, device="cpu",
                           tp_size=1, dp_size=1)


def prefill_buffers(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K and V per layer (pages of PAGE tokens), and two aux buffers, filled from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    kv = [torch.randn(POOL_PAGES, PAGE, HEADS, DIM, generator=generator).to(torch.bfloat16) for _ in range(2 * LAYERS)]
    aux = [torch.randint(0, 1 << 30, (AUX_ROWS, 16), generator=generator, dtype=torch.int32),
           torch.randn(AUX_ROWS, 4, generator=generator)]
    return kv, aux


def empty_like_buffers(kv: list[torch.Tensor], aux: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.zeros_like(t) for t in kv], [torch.zeros_like(t) for t in aux]


def kv_args(kv: list[torch.Tensor], aux: list[torch.Tensor]) -> KVArgs:
    args = KVArgs()
    args.engine_rank = 0
    args.pp_rank = 0
    args.system_dp_rank = 0
    args.gpu_id = 0
    args.page_size = PAGE
    args.kv_cache_dtype_str = "bfloat16"
    args.kv_data_ptrs = [t.data_ptr() for t in kv]
    args.kv_data_lens = [t.nbytes for t in kv]
    args.kv_item_lens = [t[0].nbytes for t in kv]
    args.aux_data_ptrs = [t.data_ptr() for t in aux]
    args.aux_data_lens = [t.nbytes for t in aux]
    args.aux_item_lens = [t[0].nbytes for t in aux]
    return args


def wait_for(sender, states: tuple[int, ...], deadline: float) -> int:
    return poll_until(sender.poll, lambda state: state in states or state == KVPoll.Failed, deadline)


def main() -> int:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from engine.compute.sglang.transfer import OmniFlowKVManager, OmniFlowKVSender, TransferConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap-port", type=int, required=True)
    parser.add_argument("--room", type=int, required=True)
    parser.add_argument("--mode", choices=["send", "die"], required=True)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()

    kv, aux = prefill_buffers(args.seed)
    config = TransferConfig(timeout_s=args.timeout, waiting_timeout_s=args.timeout)
    manager = OmniFlowKVManager(kv_args(kv, aux), DisaggregationMode.PREFILL, server_args(args.bootstrap_port),
                                config=config)
    try:
        if not manager.registered.wait(args.timeout):
            print(f"ERROR registration: {manager.registration_error}", flush=True)
            return 1
        sender = OmniFlowKVSender(manager, f"127.0.0.1:{args.bootstrap_port}", args.room)
        print("READY", flush=True)
        deadline = time.monotonic() + args.timeout
        state = wait_for(sender, (KVPoll.WaitingForInput,), deadline)
        if state != KVPoll.WaitingForInput:
            print(f"RESULT {state}", flush=True)
            return 1
        if args.mode == "die":
            sys.stdout.flush()
            os._exit(3)
        sender.init(len(SOURCE_PAGES), SOURCE_AUX)
        sender.send(np.array(SOURCE_PAGES[:4], dtype=np.int32))
        sender.send(np.array(SOURCE_PAGES[4:], dtype=np.int32))
        state = wait_for(sender, (KVPoll.Success,), time.monotonic() + 2 * args.timeout)
        print(f"RESULT {state}", flush=True)
        return 0 if state == KVPoll.Success else 1
    finally:
        manager.close()


if __name__ == "__main__":
    sys.exit(main())
