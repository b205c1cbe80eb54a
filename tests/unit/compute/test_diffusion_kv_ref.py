"""The diffusion unit reads an llm node's `kv` by the page keys the llm role computed and sent
(`KVRef.page_hashes`), checked against the ref's token ids under the call's tenant: the pages it
pulls are the ones a full recomputation of the context gives, and a ref whose keys are not its own
context's (altered, too many, another tenant's) is refused before a page is pulled."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch
from msgspec.structs import replace

from engine.compute.diffusion import Prompt
from engine.compute.diffusion.unit import DiffusionUnit
from engine.compute.llm import EngineConfig, LLMEngine
from engine.compute.llm.sequence import RequestOutput
from engine.compute.models.tokenizer import BOS_ID
from engine.compute.sampling import SamplingParams
from engine.compute.threaded import UnitInputError
from engine.data.kv.keys import PageHash
from engine.data.kv.ref import KVRef
from engine.data.kv.source import StorePageSource
from engine.data.kv.store import KVStore
from engine.spec.calls import NodeCall, NodeContext
from engine.spec.graph import RoleSpec

PAGE = 4
PROMPT = [BOS_ID, *range(40, 61)]  # 22 tokens
CTX = NodeContext("r", "paint", 1, 1, lambda fraction, message: None)


@dataclass
class CountingSource:
    """A `PageSource` over another store (as another worker would serve), counting the pages asked for."""

    inner: StorePageSource
    asked: int = 0

    def pull(self, store: KVStore, pages: Sequence[PageHash], timeout_s: float) -> int:
        self.asked += len(pages)
        return self.inner.pull(store, pages, timeout_s)


@pytest.fixture
def llm(tiny_llama) -> Iterator[LLMEngine]:
    engine = LLMEngine(tiny_llama, EngineConfig(page_size=PAGE))
    yield engine
    engine.close()


@pytest.fixture
async def unit(llm: LLMEngine):
    role = RoleSpec(name="dit", kind="diffusion", model="tiny-llama", params={"page_size": PAGE, "steps": 1})
    source = CountingSource(StorePageSource(llm.store))
    dit = DiffusionUnit(role, page_source=source)
    yield dit, source
    await dit.close()


def llm_kv(engine: LLMEngine, tenant: str) -> KVRef:
    """The `kv` an llm node of `tenant`'s run outputs (as `LLMUnit` builds it) for `PROMPT`."""
    (out,) = engine.generate([PROMPT], SamplingParams(max_new_tokens=6), tenant_salt=tenant)
    assert isinstance(out, RequestOutput) and out.tenant_salt == tenant
    return KVRef(model_id=engine.model_id, page_size=PAGE, layout=engine.layout.to_dict(),
                 page_hashes=out.kv_pages, prompt_ids=out.prompt_ids, output_ids=out.output_ids,
                 key_ids=out.key_ids, tenant_salt=out.tenant_salt)


def paint(kv: KVRef, tenant: str) -> NodeCall:
    return NodeCall("r", "paint", None, {"guidance_scale": 1.0}, {"kv": kv}, ("latents",), False, False, 1, 1,
                    tenant)


async def test_the_pages_pulled_by_the_kvs_keys_equal_a_full_recomputation(unit, llm):
    dit, source = unit
    kv = llm_kv(llm, "user:1")
    context = [*kv.prompt_ids, *kv.output_ids]
    assert len(context) == 28 and len(kv.page_hashes) == (28 - 1) // PAGE  # the last token has no KV yet
    await dit.execute(paint(kv, "user:1"), CTX)
    runner = dit.runner
    assert source.asked == 7 and runner.stats.prompt_tokens_reused == 6 * PAGE  # six pulled, the seventh computed
    # The independent reference: the whole context prefilled here, and its page keys hashed whole.
    recomputed = runner.encode_prompt(Prompt.of(context))
    keys = runner.page_keys(Prompt.of(context), "user:1")
    assert keys[:6] == list(kv.page_hashes) and len(keys) == 7
    for index, key in enumerate(keys):
        page = dit.kv_store.get(key)
        assert page is not None, index
        assert torch.allclose(page, recomputed.page(index, runner.layout), atol=1e-5), index


async def test_a_kv_whose_keys_are_not_its_contexts_is_refused_before_a_page_is_pulled(unit, llm):
    dit, source = unit
    kv = llm_kv(llm, "user:1")
    theirs = llm_kv(llm, "user:2")
    hashes = kv.page_hashes
    bad = {
        r"page_hashes\[1\] is not the key of page 1 of its token ids": replace(kv, page_hashes=(hashes[0], hashes[2])),
        r"page_hashes names 8 pages of 4 tokens, more than its 28 token ids": replace(
            kv, page_hashes=hashes + hashes[:2]),
        r"page_hashes\[0\] is not the key of page 0 .* another tenant's run": theirs,
        r"page_hashes\[0\] is not the key of page 0": replace(kv, prompt_ids=(BOS_ID, *PROMPT[2:], 7), key_ids=()),
    }
    for message, ref in bad.items():
        with pytest.raises(UnitInputError, match=rf"^node 'paint': input 'kv': {message}"):
            await dit.execute(paint(ref, "user:1"), CTX)
    assert source.asked == 0 and dit.runner.stats.images == 0
    assert not any(dit.kv_store.contains(key) for key in (*hashes, *theirs.page_hashes))
