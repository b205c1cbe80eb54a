"""Messages of a tensor-parallel role's ranks (msgspec, msgpack; nothing is pickled).

`llm` roles (`unit.py`, `runner.py`, `follower.py`): at every paged forward rank 0 sends one
`TPPass`: the KV memory operations its engine did since the last pass (`KVOp`: pages written,
copied between tiers, dropped; tail pages set, saved, forgotten), then the forward's inputs
(`PrefillInputs` or `DecodeInputs`: token ids, positions, page and tail slots, and a prefill
chunk's multimodal embedding rows, `EmbedRows`), or a request to gather whole pages
(`GatherRequest`), or to say which pages just promoted from the disk tier a rank found corrupt
(`CheckPages`). A follower mirrors the operations on its own heads'
pages at the same slots and runs its shard of the same forward. Upstream a follower sends
only its hello (with the pages its disk tier recovered) and, now and then, `TPRefusals`.

`diffusion` roles (`diffusion_unit.py`): rank 0 sends each node's prompts (`TPDiffuse`).
"""

from __future__ import annotations

import msgspec

from engine.data.wire import TensorHeader


class TPHello(msgspec.Struct, tag=True, frozen=True):
    """Follower -> rank 0, once its shard is built: it is ready to follow. `disk_pages`: the page
    keys its disk tier recovered from an earlier run (rank 0 keeps only those every rank has)."""

    rank: int
    pid: int
    disk_pages: list[str] = []


class TPSetup(msgspec.Struct, tag=True, frozen=True):
    """Rank 0 -> follower: rank 0's pid (a follower exits when it is gone) and the recovered disk
    pages every rank holds (a follower drops the others)."""

    leader_pid: int
    disk_pages: list[str] = []


class TPRefusals(msgspec.Struct, tag=True, frozen=True):
    """Follower -> rank 0, the one message upstream after the hello: how many connections this
    rank's server sockets (its seat on the transfer plane) have refused so far, a running total
    sent when it grew. Rank 0 reports the latest of each follower with its own (`plane.refused`):
    a follower has no metrics of its own."""

    rank: int
    refused: int


class TPDiffuse(msgspec.Struct, tag=True, frozen=True):
    """Rank 0 of a `diffusion` role -> follower: encode `prompts` (model token ids: the conditional
    branch, then the unconditional one under guidance) and denoise them, as rank 0 does."""

    prompts: list[list[int]]
    seed: int
    steps: int | None
    guidance_scale: float
    holder: str | None = None
    """The data address of an `llm` worker serving the prompts' leading pages whole (input `kv`)."""
    pages: list[list[str]] = []
    """With `holder`: the keys of each prompt's full pages, as rank 0 found them once (input `kv`'s
    own, checked, where it names them; else hashed under the call's tenant)."""




# -- an llm role's pass: KV memory operations and the forward ---------------------------------------------


class Fresh(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Page `index` of chunk `chunk`'s fresh pages in the last prefill forward."""

    chunk: int
    index: int


class Tail(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Tail page slot `slot`, as it is now."""

    slot: int


class Saved(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Saved tail `id` (a session's or a handoff's copy; see `SaveTail`)."""

    id: int


class Shards(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Bytes from outside the role (a pulled handoff): follower rank r's heads are `data[r - 1]`."""

    data: list[bytes]


PageOrigin = Fresh | Tail | Saved | Shards


class WritePage(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Page `page` was written into device slot `slot` from `origin`."""

    page: str
    slot: int
    origin: PageOrigin


class CopyPage(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Page `page` was copied from tier `source` into tier `tier` (`engine.data.kv.tier.Tier`
    values; a demotion, a promotion or a write-through); `slot`: its device slot when `tier` is the
    device tier."""

    page: str
    source: int
    tier: int
    slot: int = -1


class DropPage(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Page `page` left tier `tier` (evicted, found corrupt, removed)."""

    page: str
    tier: int


class SetTail(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Tail page slot `slot` was overwritten from `origin`."""

    slot: int
    origin: PageOrigin


class SaveTail(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """A copy of `origin` is kept as saved tail `id` (until `ForgetTail`)."""

    id: int
    origin: PageOrigin


class ForgetTail(msgspec.Struct, tag=True, frozen=True, array_like=True):
    id: int


KVOp = WritePage | CopyPage | DropPage | SetTail | SaveTail | ForgetTail


class EmbedRows(msgspec.Struct, frozen=True, array_like=True):
    """Rows of input embeddings (a multimodal item's, or part of one) replacing a prefill chunk's
    token embeddings from row `row` of the chunk on: `data` is a C-contiguous `(rows, hidden)`
    tensor in the model's dtype, read as `header` says (`engine.data.codec`; see `tp/embeds.py`)."""

    row: int
    header: TensorHeader
    data: bytes


class ChunkInputs(msgspec.Struct, frozen=True, array_like=True):
    """One `PrefillChunk`: `tail_slot` is the slot of its tail page (None: it starts page-aligned);
    `embeds`: its multimodal embedding rows (`PrefillChunk.embeds`), at most its own rows, so a
    pass carries at most the engine's `max_prefill_tokens` rows of them."""

    token_ids: list[int]
    start: int
    prefix_slots: list[int]
    tail_slot: int | None
    embeds: list[EmbedRows] = []


class PrefillInputs(msgspec.Struct, tag=True, frozen=True):
    """`PagedForward.prefill_batch`'s arguments."""

    chunks: list[ChunkInputs]
    want_logits: list[bool]
    decode_key: str | None


class DecodeInputs(msgspec.Struct, tag=True, frozen=True):
    """`PagedForward.decode`'s batch. A follower continues a decode buffer of its own where one
    fits the batch (`engine.compute.llm.forward.DecodeBuffer`): a buffer only caches what the
    pages and tail pages hold, so which one a rank reuses never changes the result."""

    token_ids: list[int]
    positions: list[int]
    page_slots: list[list[int]]
    tail_slots: list[int]
    keys: list[str]


class GatherRequest(msgspec.Struct, tag=True, frozen=True):
    """Every rank sends rank 0 its heads of `pages` (in order) and of saved tail `tail` (None: no
    tail), in two collectives (pages first, when there are any). With `check` (pages served to
    other workers, read where they are, the disk tier included), a page a follower's disk tier
    finds corrupt comes as zeros, and one more collective after the pages' says which (an int per
    page, `all_reduce`; rank 0 adds zeros)."""

    pages: list[str]
    tail: int | None
    check: bool = False


class CheckPages(msgspec.Struct, tag=True, frozen=True):
    """After the pass's operations, which promoted `pages` from the disk tier into device slots:
    every rank says, in one `all_reduce` (an int per page, in order; rank 0 adds zeros), which of
    them its own disk tier found corrupt (1), so that rank 0 drops them before a forward reads them."""

    pages: list[str]


class TPPass(msgspec.Struct, tag=True, frozen=True):
    """Rank 0 -> follower, one per forward (or gather, or check): mirror `ops` in order, then run
    `forward`."""

    ops: list[KVOp]
    forward: PrefillInputs | DecodeInputs | GatherRequest | CheckPages | None = None


class TPStop(msgspec.Struct, tag=True, frozen=True):
    pass


TPMessage = TPHello | TPSetup | TPPass | TPStop | TPDiffuse | TPRefusals
