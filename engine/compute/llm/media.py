"""An llm node's media: the `items`/`embeds` inputs (encoder outputs) as `EncodedItem`s, and the
prompt with each `<|image|>`/`<|audio|>` marker replaced by its item's embedding rows."""

from __future__ import annotations

import re
from typing import Any

import torch

from engine.compute.encoders.items import PLACEHOLDER_IDS, EncodedItem, SplicedPrompt, splice_prompt
from engine.compute.llm.errors import LLMUnitError


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def encoded_items(node_id: str, items: Any, embeds: Any) -> list[EncodedItem]:
    """The `items` (json: one `{kind, hash, length, hidden}` or a list, e.g. a join of encoder
    nodes) and `embeds` (a `(rows, hidden)` tensor or a list, aligned with `items`; one tensor
    for several items holds their rows in order) inputs of an `llm` node as `EncodedItem`s."""
    descs, tensors = _as_list(items), [t if isinstance(t, torch.Tensor) else torch.as_tensor(t)
                                       for t in _as_list(embeds)]
    if not descs and not tensors:
        return []
    if not descs or not tensors:
        raise LLMUnitError(f"node {node_id!r}: the inputs 'items' and 'embeds' go together")
    for desc in descs:
        if not isinstance(desc, dict) or desc.get("kind") not in PLACEHOLDER_IDS or "hash" not in desc \
                or not isinstance(desc.get("length"), int):
            raise LLMUnitError(f"node {node_id!r}: input 'items': expected encoder items"
                               f" {{kind, hash, length, hidden}}, got {desc!r}")
    if len(tensors) == 1 and len(descs) > 1:
        tensors = list(torch.split(tensors[0], [d["length"] for d in descs]))
    if len(tensors) != len(descs):
        raise LLMUnitError(f"node {node_id!r}: {len(descs)} items but {len(tensors)} embeddings tensors")
    out = []
    for desc, rows in zip(descs, tensors, strict=True):
        if rows.ndim != 2 or rows.shape[0] != desc["length"]:
            raise LLMUnitError(f"node {node_id!r}: a {desc['kind']} item of length {desc['length']} needs"
                               f" ({desc['length']}, hidden) embeddings, got {tuple(rows.shape)}")
        out.append(EncodedItem(desc["kind"], str(desc["hash"]), rows.to(torch.float32)))
    return out


_MARKER = re.compile(r"<\|(image|audio)\|>")


def splice_marked_text(prompt: str, items: list[EncodedItem], encode: Any) -> SplicedPrompt:
    """Replace each `<|image|>`/`<|audio|>` marker in the text `prompt` with the next item of its
    kind (in order), encoding the text between markers on its own; a prompt with no markers gets
    the items in front of it. Markers are found in the text, not among the token ids, so a model
    whose tokenizer has no such special tokens (a real one) takes them too."""
    pieces = _MARKER.split(prompt)  # text, kind, text, kind, ..., text
    kinds = pieces[1::2]
    if not kinds:
        return splice_prompt([*items, prompt], encode)
    if len(kinds) != len(items):
        raise ValueError(f"the prompt has {len(kinds)} media markers for {len(items)} items")
    queues = {kind: [it for it in items if it.kind == kind] for kind in PLACEHOLDER_IDS}
    parts: list[Any] = [pieces[0]] if pieces[0] else []
    for kind, text in zip(kinds, pieces[2::2], strict=True):
        if not queues[kind]:
            raise ValueError(f"the prompt has more <|{kind}|> markers than {kind} items")
        parts.append(queues[kind].pop(0))
        if text:
            parts.append(text)
    return splice_prompt(parts, encode)


def splice_marked(ids: list[int], items: list[EncodedItem], encode: Any) -> SplicedPrompt:
    """Replace each `<|image|>`/`<|audio|>` marker in `ids` with the next item of its kind (in
    order); a prompt with no markers gets the items in front of it."""
    kinds = {v: k for k, v in PLACEHOLDER_IDS.items()}
    markers = [i for i, t in enumerate(ids) if t in kinds]
    if not markers:
        return splice_prompt([*items, ids], encode)
    if len(markers) != len(items):
        raise ValueError(f"the prompt has {len(markers)} media markers for {len(items)} items")
    queues = {kind: [it for it in items if it.kind == kind] for kind in PLACEHOLDER_IDS}
    parts: list[Any] = []
    last = 0
    for pos in markers:
        kind = kinds[ids[pos]]
        if not queues[kind]:
            raise ValueError(f"the prompt has more <|{kind}|> markers than {kind} items")
        parts.append(ids[last:pos])
        parts.append(queues[kind].pop(0))
        last = pos + 1
    parts.append(ids[last:])
    return splice_prompt(parts, encode)
