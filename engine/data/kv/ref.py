"""`KVRef`: the value of an `llm` node's `kv` port — which KV pages a generation left, and where.

An `llm` node (the native engine, the SGLang runner, a tensor-parallel role) outputs one when
it finishes; an `llm.prefill` node outputs one that also carries a `KVHold` (a hand-off to one
`llm.decode` node). The consumers read it as this struct and nothing else: an `llm.decode` node
(the hold), the diffusion role (the pages, pulled from the holder), the KV-aware router
(`engine.flow.kvroute`: the page keys), python ops (token counts), and the studio, which shows
it as JSON (`msgspec.json`, the tag `"type": "kv"` included).

Across a worker's wire it travels as a `PortValue` of kind `ValueKind.KV` (msgpack, decoded
back into a `KVRef` by `engine.data.values`); `KVRef.of` is the one validator of a value that
claims to be one (a struct, or its JSON/msgpack map from a file or an older run).

Pages are named by their keys (`engine.data.kv.keys`): the chain over `key_ids` (where given)
under `model_id` and the run's tenant, the same on every worker of that model, so any holder of
a key holds those bytes. A reader takes a ref's `page_hashes` only through `pages_for`, which
checks them against the ref's own token ids under the reader's tenant: a value can be forged or
relabelled, and keys taken as given would name another tenant's pages.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.data.kv.keys import ExtraKeys, PageHash, page_hashes
from engine.data.kv.layout import KVLayout
from engine.data.wire import TensorRef


class KVRefError(ValueError):
    """A value that is not a `KVRef`, or one that does not fit the role reading it; the message
    says what is wrong (the caller adds the node and port)."""


class KVHolder(msgspec.Struct, frozen=True):
    """A worker holding the pages: `address` is its data address (its tensor server, where pages
    are pulled from), `worker_id` its id (None when the unit runs outside a worker)."""

    address: str
    worker_id: str | None = None


class KVHold(msgspec.Struct, frozen=True):
    """What an `llm.prefill` node hands one `llm.decode` node besides the pages.

    `token` is the hold token: the prefill worker keeps the prompt's pages locked while this ref
    lives in its tensor store; it holds the K/V of the partial last page (`tail_len` tokens; a
    one-element placeholder when the prompt ends on a page boundary). The decode side pulls the
    pages and the tail, then releases it; if it never does, the ref's lease ends the hold.
    `token` is None when there is nothing to hand off because the generation ended at
    `first_token` (`finish_reason` says why). `sampling` are the prefill node's sampling
    params, which the decode node continues with (its own override them).
    """

    handoff_id: str
    first_token: int
    tail_len: int = 0
    token: TensorRef | None = None
    finish_reason: str | None = None
    sampling: dict[str, Any] = {}


class KVRef(msgspec.Struct, frozen=True, tag="kv", tag_field="type"):
    """The KV pages of one generation.

    `page_hashes` are the keys of its full pages in order: prompt and output (but the last
    token, which has no KV yet) for an `llm` node, the prompt's for a prefill hand-off.
    `prompt_ids` are the prompt's token ids (a session's history included) and `output_ids` the
    generated ones (an `llm` node's; empty for a hand-off): the context the pages hold, which the
    diffusion role attends to without tokenizing the prompt again. `key_ids` are the ids the
    prompt's page keys are computed over (multimodal items as their sentinels; a hand-off's). `layout` is the pages'
    `KVLayout.to_dict()` (None from a runner that does not expose it: SGLang), `page_size` always.
    `tokens`, `prompt_tokens`, `cached_tokens` count the generation's context, its prompt and
    the prompt tokens read from cache (`cached_tokens_details`: by tier, where the runner says).
    `tenant_salt` is the tenant its pages are keyed under (None: none, or a runner that does not
    say). `holder` is where the pages are cached (None: not pullable, e.g. SGLang's own cache);
    `hold` the prefill hand-off, if any; a decode node's result says how many pages it pulled
    (`pulled_pages`) and from whom (`pulled_from`).
    """

    model_id: str
    page_size: int
    layout: dict[str, Any] | None = None
    page_hashes: tuple[PageHash, ...] = ()
    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()
    key_ids: tuple[int, ...] = ()
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_details: dict[str, int] = {}
    tenant_salt: str | None = None
    holder: KVHolder | None = None
    hold: KVHold | None = None
    pulled_pages: int = 0
    pulled_from: KVHolder | None = None

    @classmethod
    def of(cls, value: Any) -> KVRef:
        """`value` as a `KVRef`: the struct itself, or its JSON/msgpack map (tag `"type": "kv"`).
        Raises `KVRefError` naming what is wrong."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict) or value.get("type") != "kv":
            raise KVRefError("not a KV reference (connect the 'kv' output of an llm node)")
        try:
            return msgspec.convert(value, cls)
        except msgspec.ValidationError as exc:
            raise KVRefError(f"malformed KV reference: {exc}") from None

    @classmethod
    def for_role(cls, value: Any, model_id: str, layout: KVLayout) -> KVRef:
        """`KVRef.of(value)`, checked to name pages of `model_id` in `layout` (the reading role's
        whole layout: a tensor-parallel role's, not a rank's). A ref without a layout (SGLang's)
        is checked by its page size."""
        ref = cls.of(value)
        if ref.model_id != model_id:
            raise KVRefError(f"KV of model {ref.model_id!r}, this role runs {model_id!r}")
        expected = layout.to_dict()
        if ref.layout is not None and ref.layout != expected:
            raise KVRefError(f"KV layout {ref.layout} is not this role's {expected} (give both roles one page_size)")
        if ref.layout is None and ref.page_size != layout.page_size:
            raise KVRefError(f"KV pages of {ref.page_size} tokens, this role's hold {layout.page_size}"
                             " (give both roles one page_size)")
        return ref

    def pages_for(self, tenant: str | None) -> tuple[PageHash, ...]:
        """`page_hashes`, checked to be the keys of this ref's own context for a reader of
        `tenant` (the reading call's; None, a run without one: the ref's `tenant_salt`): the chain
        over `key_ids` (else `prompt_ids`) and then `output_ids`, `page_size` ids a page, seeded by
        `model_id` and that tenant. So a forged or relabelled ref never names, to a reader that
        pulls them or stores pages under them, pages of another tenant or of other tokens. The
        check hashes those pages once. Raises `KVRefError` naming the field when they are not."""
        salt = tenant if tenant is not None else self.tenant_salt
        ids = (*(self.key_ids or self.prompt_ids), *self.output_ids)
        count = len(self.page_hashes)
        if self.page_size <= 0 or count * self.page_size > len(ids):
            raise KVRefError(f"page_hashes names {count} pages of {self.page_size} tokens, more than its"
                             f" {len(ids)} token ids (key_ids or prompt_ids, then output_ids) fill")
        try:
            own = page_hashes(ids[: count * self.page_size], self.page_size,
                              extra_keys=ExtraKeys(model_id=self.model_id, tenant_salt=salt))
        except ValueError as exc:  # token ids out of [0, 2**63)
            raise KVRefError(f"its token ids cannot be keyed: {exc}") from None
        for index, (given, expected) in enumerate(zip(self.page_hashes, own, strict=True)):
            if given != expected:
                raise KVRefError(f"page_hashes[{index}] is not the key of page {index} of its token ids under"
                                 f" model {self.model_id!r} and this run's tenant (a KV reference of another"
                                 " tenant's run, or altered)")
        return self.page_hashes

    @property
    def handoff(self) -> KVHold:
        """The prefill hand-off this ref carries; `KVRefError` when it carries none (or no layout,
        which a decode side needs to read the pages)."""
        if self.hold is None:
            raise KVRefError("not a prefill handoff (connect the 'kv' output of an llm.prefill node)")
        if self.layout is None:
            raise KVRefError("a prefill handoff without its KV layout")
        return self.hold

    def to_json(self) -> dict[str, Any]:
        """Plain JSON data (what the studio stores and shows; `type` names it)."""
        return msgspec.json.decode(msgspec.json.encode(self))

    def brief(self) -> dict[str, Any]:
        """`to_json()` with its id lists (token ids, page keys) given as their lengths: a bounded
        rendering for events and previews, whatever the context's length."""
        data = self.to_json()
        for name in _ID_LISTS:
            data[name] = {"count": len(data[name])}
        return data


_ID_LISTS = ("page_hashes", "prompt_ids", "output_ids", "key_ids")


__all__ = ["KVHold", "KVHolder", "KVRef", "KVRefError"]
