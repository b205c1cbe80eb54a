"""Prefill/decode disaggregation: the `llm.prefill` and `llm.decode` node kinds of an llm unit.

* `llm.prefill`: the prompt in, `kv` out: a `KVRef` with a `KVHold` (the prompt's KV pages,
  held for a decode node, and the first token). The pages stay locked in this worker's store
  while the hold token (a tensor in the worker's store, the partial last page or the first
  token) lives: the decode side releases it, or its lease (`handoff_lease_s`) ends it.
* `llm.decode`: a handoff in as `kv`; pulls the prompt's pages and its partial last page
  from the prefill worker over the transfer plane (off the engine thread), lets the prefill
  worker go once the pages are locked here, then decodes like `llm`. A handoff feeds one
  decode node: the first one ends the hold, so a second one fails unless its prompt ends on a
  page boundary and the pages are still cached (fan-out sampling belongs in one decode request).

A decode node takes only its own tenant's handoffs (`check_handoff_tenant`). A tensor-parallel
rank 0 (`engine.compute.tp.handoff`) serves the whole model's layout and gathers its ranks' heads
first (`layout`, `tail`), and splits the pages it pulls by head (`pull`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from engine.compute.llm.engine import LLMEngine
from engine.compute.llm.errors import LLMUnitError
from engine.compute.llm.loop import AddRequest, EngineLoop, Hold, Release
from engine.compute.llm.nodes import SAMPLING_PARAMS, node_prompt, node_sampling
from engine.compute.llm.sequence import FinishReason, RequestOutput
from engine.compute.llm.transfer import KVHandoff, handoff_of
from engine.data.channel import RefGone, TransferError
from engine.data.kv.errors import KVTransferError
from engine.data.kv.layout import KVLayout
from engine.data.kv.pull import fetch_pages
from engine.data.kv.ref import KVHold, KVHolder, KVRef, KVRefError
from engine.data.kv.source import HolderPageSource, PageSource
from engine.data.peer import Peer
from engine.data.wire import ReleaseRequest, TensorRef
from engine.spec.calls import NodeCall

HANDOFF_LEASE_S = 60.0
KV_PULL_TIMEOUT_S = 10.0
_RELEASE_TIMEOUT_S = 5.0


def pull_tail(peer: Peer, hold: KVHold, deadline: float) -> torch.Tensor | None:
    """A handoff's partial last page, by its hold token (None when the prompt filled its pages)."""
    if not hold.tail_len:
        return None
    assert hold.token is not None
    remaining = max(0.001, deadline - time.monotonic())
    return peer.pull(hold.token, remaining).torch().clone()  # a shared-memory view is the holder's


@dataclass(frozen=True, slots=True)
class Pulled:
    """What a decode call pulled for its handoff: how many pages, from which prefill worker."""

    pages: int = 0
    source: KVHolder | None = None


NOTHING_PULLED = Pulled()


@dataclass(frozen=True, slots=True)
class PulledHandoff:
    """A decode's handoff as the engine admits it: `pages` pulled, and where the engine gets those
    it lacks when it admits the request (pages evicted meanwhile)."""

    pages: int
    handoff: KVHandoff
    source: PageSource


def check_handoff_tenant(call: NodeCall, ref: KVRef) -> None:
    """A decode call takes only its own tenant's handoffs: the pages a handoff names must be
    the page keys of its prompt under the call's tenant (under the handoff's own tenant when the
    call has none: the command line; `KVRef.pages_for`), so a handoff of another tenant's run,
    however relabelled, never reads that run's KV."""
    tenant = call.tenant if call.tenant is not None else ref.tenant_salt
    own = ref.tenant_salt == tenant
    if own:
        try:
            ref.pages_for(tenant)
        except KVRefError:
            own = False
    if not own:
        raise LLMUnitError(f"node {call.node_id!r}: input 'kv': the handoff belongs to another tenant's run")


class PrefillDecode:
    """The unit's prefill and decode node kinds (see the module docstring).

    `transfer` gives the worker's seat on the transfer plane (starting one where the unit has
    none), `worker_id` this worker's id as holders name it.
    """

    def __init__(self, engine: LLMEngine, loop: EngineLoop, transfer: Callable[[], Peer],
                 worker_id: Callable[[], str | None], *, lease_s: float, pull_timeout_s: float) -> None:
        self.engine = engine
        self.loop = loop
        self.transfer = transfer
        self.worker_id = worker_id
        self.lease_s = lease_s
        self.pull_timeout_s = pull_timeout_s

    # -- prefill ------------------------------------------------------------------------------------

    async def prefill(self, call: NodeCall) -> KVRef:
        """Compute the prompt's KV and first token; hold the pages for a decode node (see `KVHold`)."""
        peer = self.transfer()
        prompt = node_prompt(call)
        request_id, inbox = self.loop.open(call.call_id)
        self.loop.put(AddRequest(request_id, prompt, node_sampling(call.node_id, call.params), None, call.tenant,
                                 stream_text=False, prefill_only=True))
        final = None
        async for out in self.loop.outputs(call.node_id, request_id, inbox):
            final = out
        assert final is not None
        handoff = final.handoff
        layout = self.layout()
        sampling = {k: v for k, v in call.params.items() if k in SAMPLING_PARAMS}
        ref = KVRef(model_id=self.engine.model_id, page_size=int(layout["page_size"]), layout=layout,
                    tokens=final.prompt_tokens, prompt_tokens=final.prompt_tokens,
                    cached_tokens=final.cached_tokens, tenant_salt=call.tenant,
                    holder=KVHolder(peer.address, self.worker_id()))
        if handoff is None:  # the first token ended the generation: nothing to hand off
            ids = tuple(self.engine.encode(prompt) if isinstance(prompt, str) else prompt)
            hold = KVHold(handoff_id=request_id, first_token=final.output_ids[0],
                          finish_reason=str(final.finish_reason), sampling=sampling)
            return msgspec.structs.replace(ref, prompt_ids=ids, key_ids=ids, hold=hold)
        with contextlib.ExitStack() as undo:
            undo.callback(self.loop.put, Release(handoff.handoff_id))  # no hold token: free the pages
            tail = await self.tail(handoff)
            token = tail if handoff.tail_len else torch.tensor([handoff.first_token])
            held = peer.put(token, self.lease_s)
            undo.pop_all()
        self.loop.put(Hold(handoff.handoff_id, held.id))
        hold = KVHold(handoff_id=handoff.handoff_id, first_token=handoff.first_token, tail_len=handoff.tail_len,
                      token=held, sampling=sampling)
        return msgspec.structs.replace(ref, page_hashes=tuple(handoff.page_hashes), prompt_ids=handoff.prompt_ids,
                                       key_ids=handoff.key_ids, tenant_salt=handoff.tenant_salt, hold=hold)

    def layout(self) -> dict[str, Any]:
        """The KV layout a handoff's pages are served in (a tensor-parallel unit: the whole model's)."""
        return self.engine.layout.to_dict()

    async def tail(self, handoff: KVHandoff) -> torch.Tensor | None:
        """The partial last page as the decode side pulls it (a tensor-parallel unit gathers it and
        the pages from its ranks first); if it raises, the handoff is released."""
        return handoff.tail

    # -- decode -------------------------------------------------------------------------------------

    def handoff_ref(self, call: NodeCall) -> tuple[KVRef, KVHold]:
        """The call's input `kv`, checked to be a prefill hand-off of this role's model, layout
        (`layout`) and tenant."""
        layout = KVLayout.from_dict(self.layout())
        try:
            ref = KVRef.for_role(call.inputs["kv"], self.engine.model_id, layout)
            hold = ref.handoff
        except KVRefError as exc:
            raise LLMUnitError(f"node {call.node_id!r}: input 'kv': {exc}") from None
        check_handoff_tenant(call, ref)
        return ref, hold

    async def decode(self, call: NodeCall, stream: bool) -> AsyncIterator[tuple[RequestOutput, Pulled]]:
        ref, hold = self.handoff_ref(call)
        sampling = node_sampling(call.node_id, {**hold.sampling, **call.params})
        if hold.finish_reason is not None:
            yield self.finished_at_prefill(ref, hold), Pulled(0, ref.holder)
            return
        if hold.token is None or ref.holder is None:
            raise LLMUnitError(f"node {call.node_id!r}: input 'kv': a handoff without a hold token or holder")
        holder = ref.holder
        peer = self.transfer()

        async def admit(request_id: str) -> Pulled:
            pulled = await asyncio.to_thread(self.pull, peer, ref, holder, hold, call.node_id)
            self.loop.put(AddRequest(request_id, None, sampling, None, call.tenant, stream_text=stream,
                                     handoff=pulled.handoff, source=pulled.source))
            return Pulled(pulled.pages, holder)

        async for item in self.held_decode(call, peer, hold.token, admit):
            yield item

    async def held_decode(self, call: NodeCall, peer: Peer, token: TensorRef,
                          admit: Callable[[str], Any]) -> AsyncIterator[tuple[RequestOutput, Pulled]]:
        """Open a request, `admit` it (pull the pages, queue it; returns what it pulled), and yield
        its outputs; the prefill worker's hold token is let go once the request is admitted (its
        pages locked here), or when the decode fails before."""
        released = False
        try:
            request_id, inbox = self.loop.open(call.call_id)
            queued = False
            try:
                pulled = await admit(request_id)
                queued = True
            finally:
                if not queued:  # the pull failed or was cancelled: nothing will answer this inbox
                    self.loop.discard(request_id)
            async for out in self.loop.outputs(call.node_id, request_id, inbox):
                if not released:  # admitted: the pages are locked here now
                    released = True
                    self._let_go(peer, token)
                yield out, pulled
        finally:
            if not released:
                self._let_go(peer, token)

    def pull(self, peer: Peer, ref: KVRef, holder: KVHolder, hold: KVHold, node_id: str) -> PulledHandoff:
        """Blocking (run in a thread): bring the handoff's pages into the store and fetch its tail
        (a tensor-parallel unit splits them by head)."""
        pages = list(ref.page_hashes)
        deadline = time.monotonic() + self.pull_timeout_s
        where = f"prefill worker {holder.worker_id or '?'} at {holder.address}"
        store = self.engine.store
        with self.pull_errors(node_id, where):
            have = store.resident_run(pages)
            pulled = 0
            if have < len(pages):
                pulled = len(fetch_pages(store, peer, holder.address, pages[have:], self.pull_timeout_s).pages)
                if have + pulled < len(pages):
                    raise LLMUnitError(f"node {node_id!r}: {where} holds only {have + pulled} of the prompt's"
                                       f" {len(pages)} KV pages (its hold on them ended?)")
            tail = pull_tail(peer, hold, deadline)
        return PulledHandoff(pulled, handoff_of(ref, tail), HolderPageSource(peer, holder.address))

    @contextlib.contextmanager
    def pull_errors(self, node_id: str, where: str) -> Iterator[None]:
        """A handoff pull's transfer failures as the node's error, naming the prefill worker."""
        try:
            yield
        except RefGone as exc:
            # One handoff feeds one decode node: the first to take it ends the hold.
            raise LLMUnitError(f"node {node_id!r}: {where} no longer holds this handoff (another llm.decode"
                               f" node took it, or its handoff_lease_s ran out): {exc}") from exc
        except (KVTransferError, TransferError) as exc:
            raise LLMUnitError(f"node {node_id!r}: cannot pull the prompt's KV from {where} within"
                               f" {self.pull_timeout_s} s: {exc}") from exc

    @staticmethod
    def _let_go(peer: Peer, ref: TensorRef) -> None:
        """Release the hold token at the prefill worker without waiting (its lease ends it anyway)."""
        if ref.owner == peer.address:
            peer.store.release(ref.id)
            return
        peer.client.call(ref.owner, lambda rid: ReleaseRequest(rid, ref.id), _RELEASE_TIMEOUT_S)

    def finished_at_prefill(self, ref: KVRef, hold: KVHold) -> RequestOutput:
        """The whole output of a handoff whose first token ended the generation."""
        token = hold.first_token
        text = self.engine.decode_text([token])
        return RequestOutput(
            request_id=hold.handoff_id, new_token_ids=(token,), text_delta=text, finished=True,
            finish_reason=FinishReason(hold.finish_reason), output_ids=(token,), text=text,
            prompt_tokens=len(ref.prompt_ids), cached_tokens=ref.cached_tokens, prompt_ids=ref.prompt_ids,
        )
