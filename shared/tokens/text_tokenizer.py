"""The sim engine's built-in tokenizer: deterministic, reversible, no model files.

So that `radix-router up --engine sim` runs without a model, text is split with one
regular expression into pieces a real BPE tokenizer would roughly produce, about four
characters each (the router's default `tree_chars_per_token`):

    runs of up to 4 ASCII word chars | runs of up to 4 ASCII spaces | any other char

An ASCII piece of n <= 4 chars becomes the id 256 + Σ code_i·128^i (codes are 1..127,
so the length is implied); any other character becomes its UTF-8 bytes, ids 0..255.
Decoding reverses that exactly, so `decode(encode(t)) == t` for every string.

Word and punctuation boundaries always split, so tokens(a + b) == tokens(a) + tokens(b)
whenever `a` ends in (or `b` starts with) punctuation or a template tag: each chat turn
re-tokenizes to an extension of the previous turn's tokens, as with real tokenizers.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Sequence
from typing import Any

_PIECE = re.compile(r"\w{1,4}|\s{1,4}|.", re.ASCII | re.DOTALL)
_BASE = 128
VOCAB_SIZE = 256 + _BASE**4  # every id the encoder can produce is below this
_MEMO_LIMIT = 200_000  # pieces remembered: prompts repeat, so most lookups hit


def _piece_ids(piece: str) -> list[int]:
    if piece.isascii() and "\x00" not in piece:
        value = 0
        for ch in reversed(piece):
            value = value * _BASE + ord(ch)
        return [256 + value]
    return list(piece.encode("utf-8"))


def _id_bytes(token_id: int) -> bytes:
    if token_id < 256:
        return bytes((token_id,))
    value, out = token_id - 256, bytearray()
    while value:
        value, code = divmod(value, _BASE)
        out.append(code)
    return bytes(out)


class ByteDetokenizer:
    """Turns ids into text deltas, holding back a partial UTF-8 character."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(_id_bytes(int(token_id)))


class _AsciiIds(dict[str, int]):
    """piece -> id for ASCII pieces, filled on first use (`map` over it runs in C)."""

    def __missing__(self, piece: str) -> int:
        (self[piece],) = ids = _piece_ids(piece)
        return ids[0]


class TextTokenizer:
    """Same surface as shared.tokens.tokenizer.Tokenizer for what the sim engine uses."""

    eos_token_ids: tuple[int, ...] = ()
    vocab_size = VOCAB_SIZE

    def __init__(self) -> None:
        self._ascii = _AsciiIds()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(self._ascii) > _MEMO_LIMIT:
            self._ascii.clear()
        pieces = _PIECE.findall(text)
        if text.isascii() and "\x00" not in text:  # the common case: one id per piece
            return list(map(self._ascii.__getitem__, pieces))
        ids: list[int] = []
        for piece in pieces:
            ids.extend(_piece_ids(piece))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return b"".join(_id_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each token's raw UTF-8 bytes (ids below 256 are single, maybe partial, bytes)."""
        return [_id_bytes(int(i)) for i in ids]

    def detokenizer(self, skip_special_tokens: bool = True) -> ByteDetokenizer:
        return ByteDetokenizer()

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **_: Any
    ) -> str:
        """A ChatML-like rendering: `<|role|>\\ncontent<|end|>\\n` per message."""
        text = "".join(f"<|{m['role']}|>\n{m.get('content') or ''}<|end|>\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")
