"""A SGLang PD transfer backend over Omni-Flow's Data Flow: `--disaggregation-transfer-backend omniflow`.

SGLang 0.5.23 picks a backend's classes with `sglang.srt.disaggregation.utils.get_kv_class`
from a closed `TransferBackend` enum; `engine.compute.sglang.plugin.register` (the
`sglang.srt.plugins` entry point) extends both. The classes here subclass SGLang's
`BaseKVManager`, `BaseKVSender`, `BaseKVReceiver` and `BaseKVBootstrapServer`.

How one request's KV moves (room = SGLang's bootstrap room):

1. Every prefill manager registers its control endpoint at the bootstrap server
   (`host:disaggregation_bootstrap_port`) under its (dp rank, tp rank).
2. The decode receiver looks the endpoint up (`init`), and once SGLang has allocated its
   pages (`send_metadata`) asks the prefill for the room (`KVReceiveRequest`). The sender
   now polls `WaitingForInput`.
3. `send` gathers the pages from the prefill's KV buffers into host memory; after the last
   chunk the payload goes into the prefill's tensor store and the decode gets its ref
   (`KVReadyEvent`). Sender and receiver poll `Transferring`.
4. The receiver pulls the ref with `engine.data.peer.Peer` (shared memory on one host, TCP
   otherwise), writes the pages into its own KV buffers when polled, and reports
   `KVDoneRequest`; both sides poll `Success`.

No pickle anywhere: control messages are msgspec structs (`messages.py`), KV bytes are raw
frames or shared memory. Every phase has a deadline (`TransferConfig`); `poll()` checks it
itself, so it reaches `Success` or `Failed` even when the I/O thread or the peer is dead.
While a decode waits for the prefill to compute, it probes the prefill every
`timeout_s / 4` (`KVStatusRequest`); a prefill that stops answering for `timeout_s` fails the
receiver then, not at the end of the longer waiting deadline.

Modules: `config` (settings from the environment, errors), `messages` (the wire messages),
`buffers` (SGLang's buffers by pointer), `loop` (the I/O thread, a transfer's progress),
`bootstrap` (the server), `dealers` (sockets to peers), `registration` (a prefill rank at its
bootstrap server), `prefill` and `decode` (each side's rooms), `manager` (one per scheduler,
owning the above), `conn` (sender and receiver).

Buffers are read and written through the raw pointers SGLang hands over in `KVArgs`: KV
buffers on the server's device (`server_args.device`: `cuda` or `cpu`), aux (metadata)
buffers in host memory, where SGLang's `MetadataBuffers` keep them. Supported: equal
attention tp on both sides (decode rank r reads prefill rank r), pp 1, no state buffers
(Mamba/SWA/DSA state indices fail the transfer), device destinations only.
"""

from __future__ import annotations

from engine.compute.sglang.transfer.bootstrap import OmniFlowKVBootstrapServer
from engine.compute.sglang.transfer.config import (
    BACKEND_NAME,
    KVTransferConfigError,
    KVTransferError,
    TransferConfig,
)
from engine.compute.sglang.transfer.conn import OmniFlowKVReceiver, OmniFlowKVSender
from engine.compute.sglang.transfer.manager import OmniFlowKVManager

KV_CLASSES: dict[str, type] = {
    "manager": OmniFlowKVManager,
    "sender": OmniFlowKVSender,
    "receiver": OmniFlowKVReceiver,
    "bootstrap_server": OmniFlowKVBootstrapServer,
}

__all__ = [
    "BACKEND_NAME",
    "KV_CLASSES",
    "KVTransferConfigError",
    "KVTransferError",
    "OmniFlowKVBootstrapServer",
    "OmniFlowKVManager",
    "OmniFlowKVReceiver",
    "OmniFlowKVSender",
    "TransferConfig",
]
