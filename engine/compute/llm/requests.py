"""What a request becomes inside the engine: a `Sequence`.

`SequenceBuilder` checks and tokenizes the prompt (text through the model's codec, token ids
against its vocabulary), puts a session's history before it (the session's own multimodal
items shifted along), or takes a prefill handoff's prompt as it is (checked against the
engine's model and KV layout); computes its cache key (`cache_key`: multimodal items as
sentinels) and namespace (model id, tenant salt; a per-request salt where the prefix cache is
off); and refuses what the model cannot hold (prompt + `max_new_tokens` past its positions).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.compute.llm.config import EngineConfig
from engine.compute.llm.errors import HandoffError, RequestError
from engine.compute.llm.sequence import Sequence
from engine.compute.llm.sessions import Session, Sessions
from engine.compute.llm.transfer import KVHandoff
from engine.compute.models.loader import LoadedModel
from engine.compute.prefix.keys import MultimodalItem, cache_key
from engine.compute.sampling import SamplingParams
from engine.data.kv.layout import KVLayout
from engine.data.kv.source import PageSource

Prompt = str | Seq[int]


class SequenceBuilder:
    def __init__(self, model: LoadedModel, layout: KVLayout, config: EngineConfig, sessions: Sessions) -> None:
        self._model = model
        self._layout = layout
        self._config = config
        self._sessions = sessions
        self._codec = model.codec
        self._max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))

    def encode(self, text: str) -> list[int]:
        return self._codec.encode(text)

    def decode(self, token_ids: Seq[int]) -> str:
        return self._codec.decode(token_ids)

    def build(self, request_id: str, prompt: Prompt | None, params: SamplingParams, *, arrival: float,
              session_id: str | None = None, tenant_salt: str | None = None, mm_items: Seq[MultimodalItem] = (),
              prefill_only: bool = False, handoff: KVHandoff | None = None, source: PageSource | None = None,
              stream_text: bool = False) -> tuple[Sequence, Session | None]:
        """The sequence of a new request, and the session it is a turn of (see the module
        docstring); RequestError (or HandoffError, SessionBusyError...) naming what is wrong."""
        salt = tenant_salt
        if handoff is not None:
            if session_id is not None or prefill_only or prompt is not None:
                raise RequestError("a handoff request takes no prompt, session or prefill_only")
            self._check_handoff(handoff)
            new_ids, key_ids, items, salt = list(handoff.prompt_ids), list(handoff.key_ids), [], handoff.tenant_salt
        else:
            if prompt is None:
                raise RequestError("a request needs a prompt")
            new_ids = self.encode(prompt) if isinstance(prompt, str) else self._check_ids(prompt, "prompt")
            if not new_ids:
                raise RequestError("the prompt is empty")
            items = list(mm_items)
            key_ids = cache_key(new_ids, items)
        session = None
        if session_id is not None:
            session = self._sessions.for_turn(session_id)
            offset = len(session.token_ids)
            items = session.mm_items + [item.shifted(offset) for item in items]
            new_ids = session.token_ids + new_ids
            key_ids = session.key_ids + key_ids
            salt = session.namespace[1]
        if len(new_ids) + params.max_new_tokens > self._max_positions:
            raise RequestError(
                f"prompt of {len(new_ids)} tokens + max_new_tokens {params.max_new_tokens} exceeds the model's"
                f" {self._max_positions} positions"
            )
        if not self._config.prefix_cache:
            salt = f"{salt or ''}|nocache:{request_id}"
        seq = Sequence(
            request_id=request_id,
            prompt_len=len(new_ids),
            token_ids=new_ids,
            key_ids=key_ids,
            params=params,
            namespace=(self._model.model_id, salt),
            mm_items=tuple(items),
            session_id=session_id,
            prefill_only=prefill_only,
            stream_text=stream_text,
            handoff=handoff,
            source=source,
            arrival=arrival,
            detokenizer=self._codec.detokenizer() if stream_text or params.stop else None,
        )
        return seq, session

    def _check_ids(self, ids: Seq[int], what: str) -> list[int]:
        out = [int(t) for t in ids]
        vocab = self._model.vocab_size
        bad = [t for t in out if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"{what}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return out

    def _check_handoff(self, handoff: KVHandoff) -> None:
        model_id = self._model.model_id
        if handoff.model_id != model_id:
            raise HandoffError(f"handoff of model {handoff.model_id!r} given to an engine of {model_id!r}")
        if handoff.layout != self._layout.to_dict():
            raise HandoffError(f"handoff KV layout {handoff.layout} is not this engine's {self._layout.to_dict()}")
