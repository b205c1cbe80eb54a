"""Which path a pulled tensor takes: the server's choice among the transports a consumer accepts.

`choose_transport` reads only the stored entry (where its bytes are) and the store's config; it
sends nothing. In order:

* CUDA IPC for a tensor kept on its GPU, unless it is small and may travel inline (staging a
  few bytes and sending them inline is cheaper than an IPC event, a reference count and a mapping);
* inline for a small tensor in one buffer;
* then the consumer's own order: shared memory when the tensor is (or, staged for this pull,
  will be) in a segment, else TCP.

A lent tensor (several buffers of its lender's, not in a segment) travels as TCP chunks only.
"""

from __future__ import annotations

from engine.data.ref_table import StoredTensor
from engine.data.tensor_store import StoreConfig
from engine.data.wire import Transport

__all__ = ["NoTransport", "choose_transport"]


class NoTransport(Exception):
    """None of the transports the consumer accepts can carry this tensor (the server answers
    UNSUPPORTED)."""


def choose_transport(entry: StoredTensor, accepted: tuple[Transport, ...], config: StoreConfig) -> Transport:
    """The transport to send `entry` by, one of `accepted` (the consumer's, in its order of
    preference); `config` is the config of the store holding `entry`. Raises `NoTransport`."""
    small = entry.header.nbytes <= config.inline_max_bytes and entry.parts is None
    if (entry.cuda is not None and entry.header.nbytes > 0 and Transport.CUDA_IPC in accepted
            and not (small and Transport.INLINE in accepted)):
        return Transport.CUDA_IPC  # the consumer opens it where it is, no host copy at all
    if small and Transport.INLINE in accepted:
        return Transport.INLINE
    for transport in accepted:
        # A large CUDA tensor gets a segment when it is staged for this pull.
        in_segment = entry.location is not None or (
            entry.cuda is not None and entry.data is None and config.use_shm and not small)
        if transport is Transport.SHM and in_segment:
            return transport
        if transport is Transport.TCP:
            return transport
    raise NoTransport(f"none of {[t.value for t in accepted]} can carry this tensor")
