"""A prefill chunk's multimodal embedding rows on the TP link: what a follower reads back is what
rank 0's forward splices in (the rows in the model's dtype), through a msgpack round trip, and a
span that does not fit its chunk is refused before its bytes are read."""

from __future__ import annotations

import msgspec
import pytest
import torch

from engine.compute.tp.embeds import chunk_embeds, embed_rows
from engine.compute.tp.group import TPError
from engine.compute.tp.messages import ChunkInputs, EmbedRows, PrefillInputs, TPMessage, TPPass
from engine.data.wire import TensorHeader

HIDDEN = 8


def rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_travel_as_the_forward_casts_them(dtype: torch.dtype) -> None:
    first, second = rows(3, 1), rows(2, 2)
    spans = embed_rows([(0, first), (4, second[:, :])], dtype)
    message = TPPass([], PrefillInputs([ChunkInputs([259] * 6, 0, [], None, spans)], [True], None))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=TPMessage)
    assert decoded == message
    assert isinstance(decoded.forward, PrefillInputs)
    got = chunk_embeds(decoded.forward.chunks[0].embeds, 6, HIDDEN, dtype, "cpu")
    assert [row for row, _ in got] == [0, 4]
    for (_, read), sent in zip(got, (first, second), strict=True):
        assert read.dtype == dtype and torch.equal(read, sent.to(dtype))


def test_an_empty_chunk_carries_no_rows() -> None:
    assert embed_rows([], torch.float32) == []
    assert chunk_embeds([], 4, HIDDEN, torch.float32, "cpu") == []


def span(row: int, n: int, hidden: int = HIDDEN, dtype: str = "float32") -> EmbedRows:
    nbytes = n * hidden * 4
    return EmbedRows(row, TensorHeader(dtype, (n, hidden), (hidden, 1), nbytes), bytes(nbytes))


@pytest.mark.parametrize(("bad", "match"), [
    (span(3, 2), "rows 3..5 of a prefill chunk of 4"),  # past the chunk's rows
    (span(-1, 1), "rows -1..0"),
    (span(0, 5), "exceeds the limit"),  # more bytes than the chunk's rows hold, checked before reading
    (span(0, 2, hidden=4), r"not \(rows, 8\) float32"),
    (span(0, 2, dtype="int32"), r"not \(rows, 8\) float32"),
    (EmbedRows(0, TensorHeader("float32", (2, HIDDEN), (HIDDEN, 1), 2 * HIDDEN * 4), b"\x00"), "in 1 bytes"),
    (EmbedRows(0, TensorHeader("float32", (2, HIDDEN), (1, 2), 2 * HIDDEN * 4), bytes(64)), "C-contiguous"),
])
def test_a_span_that_does_not_fit_its_chunk_is_refused(bad: EmbedRows, match: str) -> None:
    with pytest.raises(TPError, match=match):
        chunk_embeds([bad], 4, HIDDEN, torch.float32, "cpu")
