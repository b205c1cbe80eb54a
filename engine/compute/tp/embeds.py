"""A prefill chunk's multimodal embedding rows on the TP link: rank 0 encodes them, followers read them back.

Rank 0's engine splices a multimodal item's embeddings into the prefill chunks that cover its
positions (`PrefillChunk.embeds`: a row of the chunk, a `(rows, hidden)` tensor); a follower's
shard of the forward needs the same rows. They travel in the chunk's `ChunkInputs` as
`EmbedRows`: a `TensorHeader` and the raw bytes (msgpack bin; nothing is pickled), cast to the
model's dtype first. The forward casts them to that dtype when it splices them in
(`PagedForward._embed`), so every rank feeds its layers the same values, and a bfloat16 model
sends half the bytes.

Sizes: a chunk's embedding rows are some of its own rows, so one pass carries at most the
engine's `max_prefill_tokens` rows of `hidden` values; a follower checks each header against its
chunk before reading the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.compute.tp.group import TPError
from engine.compute.tp.messages import EmbedRows
from engine.data.codec import TensorData, WireError, check_header, flatten_tensor
from engine.data.wire import Transport


def embed_rows(embeds: Sequence[tuple[int, torch.Tensor]], dtype: torch.dtype) -> list[EmbedRows]:
    """Rank 0: a chunk's `embeds` as they travel, in `dtype` (the model's)."""
    out = []
    for row, rows in embeds:
        flat = flatten_tensor(rows.detach().to(dtype))
        out.append(EmbedRows(row, flat.header, flat.data.tobytes()))
    return out


def chunk_embeds(spans: Sequence[EmbedRows], tokens: int, hidden: int, dtype: torch.dtype,
                 device: torch.device | str) -> list[tuple[int, torch.Tensor]]:
    """A follower: the `PrefillChunk.embeds` of a chunk of `tokens` rows from its `spans`, on
    `device`. TPError where a span is not `(rows, hidden)` values of `dtype` within the chunk."""
    name = str(dtype).removeprefix("torch.")
    out = []
    for span in spans:
        header = span.header
        try:
            check_header(header, max_nbytes=tokens * hidden * dtype.itemsize)
        except WireError as exc:
            raise TPError(f"embedding rows of a prefill chunk: {exc}") from None
        shape = header.shape
        if header.dtype != name or len(shape) != 2 or shape[1] != hidden or len(span.data) != header.nbytes:
            raise TPError(f"embedding rows of a prefill chunk: {header.dtype}{list(shape)} in {len(span.data)}"
                          f" bytes, not (rows, {hidden}) {name} values")
        if span.row < 0 or span.row + shape[0] > tokens:
            raise TPError(f"embedding rows {span.row}..{span.row + shape[0]} of a prefill chunk of {tokens} rows")
        rows = TensorData(header, span.data, Transport.INLINE).torch()
        out.append((span.row, rows.to(device)))
    return out


__all__ = ["chunk_embeds", "embed_rows"]
