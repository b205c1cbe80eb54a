"""A byte-level tokenizer built offline: one token per byte plus a few special tokens.

Built with `tokenizers` (a BPE model with no merges over the GPT-2 byte alphabet, so
token id `b` is byte `b`) and wrapped in `transformers.PreTrainedTokenizerFast`, so
`save_pretrained` writes a `tokenizer.json` that `AutoTokenizer` loads unchanged.
"""

from __future__ import annotations

from types import MappingProxyType

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

BYTE_VOCAB = 256
SPECIAL_TOKENS: MappingProxyType[str, int] = MappingProxyType(
    {"<|bos|>": 256, "<|eos|>": 257, "<|pad|>": 258, "<|image|>": 259, "<|audio|>": 260}
)
BOS_ID = SPECIAL_TOKENS["<|bos|>"]
EOS_ID = SPECIAL_TOKENS["<|eos|>"]
PAD_ID = SPECIAL_TOKENS["<|pad|>"]
IMAGE_ID = SPECIAL_TOKENS["<|image|>"]
AUDIO_ID = SPECIAL_TOKENS["<|audio|>"]
VOCAB_SIZE = BYTE_VOCAB + len(SPECIAL_TOKENS)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenizers use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(BYTE_VOCAB):
        if b not in printable:
            printable.append(b)
            chars.append(BYTE_VOCAB + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer of the built-in models; nothing is downloaded."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # Ids are assigned in insertion order, after the 256 byte tokens.
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    for name, expected in SPECIAL_TOKENS.items():
        actual = tok.token_to_id(name)
        if actual != expected:
            raise RuntimeError(f"special token {name} got id {actual}, expected {expected}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|image|>", "<|audio|>"],
        clean_up_tokenization_spaces=False,
    )
