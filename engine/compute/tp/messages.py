"""Messages of a tensor-parallel role's ranks (msgspec, msgpack; nothing is pickled).

Role workers (`unit.py`): rank 0 sends every operation it applies to its engine, in order,
and each follower applies the same one to its own engine; `now` is rank 0's clock at that
moment, which the followers' engines read as theirs, so time-dependent decisions (session
expiry) agree too. Upstream a follower sends only its hello and, now and then, `TPRefusals`.

`TPRole` (`role.py`): the driver sends every rank the same `TPRoleCall`s (and `TPStop`);
each rank says `TPHello` once its shard is built, and rank 0 answers each call with a
`TPRoleResult` or a `TPRoleFailure`. Tensors in results travel as `TPTensor`: a header and
their raw bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.data.wire import TensorHeader


class TPHello(msgspec.Struct, tag=True, frozen=True):
    """Follower -> rank 0 (every rank -> the driver, for `TPRole`), once its shard is built:
    it is ready to follow."""

    rank: int
    pid: int


class TPSetup(msgspec.Struct, tag=True, frozen=True):
    """Rank 0 -> follower: the sampler seed every rank's engine uses (unseeded requests then
    draw the same tokens on every rank) and rank 0's pid (a follower exits when it is gone)."""

    seed: int
    leader_pid: int


class TPAdd(msgspec.Struct, tag=True, frozen=True):
    now: float
    request_id: str
    prompt: str | list[int] | None
    params: dict[str, Any]
    """`SamplingParams` fields (no logits processors: they cannot travel)."""
    session_id: str | None = None
    tenant_salt: str | None = None
    stream_text: bool = False
    prefill_only: bool = False
    handoff_id: str | None = None
    """Admit the handoff the last `TPPullHandoff` of this id brought in (the prompt is its)."""


class TPAbort(msgspec.Struct, tag=True, frozen=True):
    now: float
    request_id: str


class TPOpenSession(msgspec.Struct, tag=True, frozen=True):
    now: float
    session_id: str
    tenant_salt: str | None = None
    turns: int = 0


class TPCloseSession(msgspec.Struct, tag=True, frozen=True):
    now: float
    session_id: str


class TPStep(msgspec.Struct, tag=True, frozen=True):
    now: float


class TPExpire(msgspec.Struct, tag=True, frozen=True):
    now: float


class TPPullHandoff(msgspec.Struct, tag=True, frozen=True):
    """Every rank pulls a prefill handoff's whole KV pages (and partial last page) from its
    holder and keeps its own KV heads; then the ranks agree that each of them has all of it."""

    now: float
    ref: bytes
    """The handoff: a msgpack-encoded `engine.data.kv.ref.KVRef` (with its `KVHold`)."""
    timeout_s: float


class TPExport(msgspec.Struct, tag=True, frozen=True):
    """Every rank hands its KV heads of prefill handoff `handoff_id` (pages and partial last page)
    to rank 0, which serves them whole to a decode role of any TP size."""

    now: float
    handoff_id: str


class TPRelease(msgspec.Struct, tag=True, frozen=True):
    """The decode side has the pages: every rank drops its hold on handoff `handoff_id`."""

    now: float
    handoff_id: str


class TPStop(msgspec.Struct, tag=True, frozen=True):
    pass


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


class TPRoleCall(msgspec.Struct, tag=True, frozen=True):
    """Driver -> every rank of a `TPRole`: run `RankState.cmd_<name>(*args)` (msgpack-native args)."""

    name: str
    args: list[Any]


class TPRoleResult(msgspec.Struct, tag=True, frozen=True):
    """Rank 0 -> driver: the call's result, encoded as the command's return annotation says."""

    value: msgspec.Raw


class TPRoleFailure(msgspec.Struct, tag=True, frozen=True):
    """Rank 0 -> driver: the call raised; `broken` when the group itself failed (`TPRankError`)."""

    message: str
    broken: bool


class TPTensor(msgspec.Struct, frozen=True, array_like=True):
    """A CPU tensor in a `TPRoleResult`: C-contiguous bytes under their header."""

    header: TensorHeader
    data: bytes


TPMessage = (TPHello | TPSetup | TPAdd | TPAbort | TPOpenSession | TPCloseSession | TPStep | TPExpire | TPPullHandoff | TPExport
             | TPRelease | TPStop | TPDiffuse | TPRefusals)

TPRoleRequest = TPRoleCall | TPStop
"""What a `TPRole` rank reads from its driver."""
TPRoleReply = TPHello | TPRoleResult | TPRoleFailure
"""What a `TPRole` driver reads from a rank."""
