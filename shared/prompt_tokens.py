"""A request's prompt as the worker's token ids: the same code on both sides (issue 26).

The worker renders chat messages with the model's chat template and encodes the text
(`encode_prompt`); the router does the same with `PromptTokens` to look the request up
in its block index, and prompts given as token ids are used as they are.

Repeated conversation prefixes are not re-tokenized: the rendered text is cut before the
special token the template writes once per message (e.g. `<|im_start|>`), which every
tokenizer splits off before anything else, so the ids of the whole are the ids of the
pieces in order. Each piece's ids are remembered (a bounded dict), so a new turn costs
one look-up per message and the encoding of its new text only.
Whether that holds for a tokenizer is checked when it is loaded (a normalizer that
treats the first piece differently, e.g. SentencePiece's leading `▁`, fails the check);
where it does not, the whole text is encoded each time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

_CHECK = [
    {"role": "system", "content": "You are brief. Answer in one line."},
    {"role": "user", "content": "Hello there,  world! 12 + 30 = ?"},
    {"role": "assistant", "content": " 42.\n\nAnything else?"},
    {"role": "user", "content": "No — thanks. ¿Qué tal?"},
]


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...


def encode_prompt(tokenizer: Encoder, text: str) -> list[int]:
    """The worker's prompt ids for `text` (a rendered chat or a completion prompt)."""
    ids = tokenizer.encode(text)
    bos = getattr(tokenizer, "bos_token_id", None)
    # A chat template's output already starts with BOS; encoding adds a second one.
    if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
        ids = ids[1:]
    return ids


def load_tokenizer(setting: str) -> Encoder:
    """`sim`: the sim workers' built-in tokenizer; else a local model or tokenizer folder."""
    if setting == "sim":
        from shared.text_tokenizer import TextTokenizer

        return TextTokenizer()
    from shared.tokenizer import Tokenizer

    if not Path(setting, "tokenizer.json").is_file():
        raise ValueError(f"tokenizer: {setting} has no tokenizer.json (or use 'sim')")
    return Tokenizer.from_dir(setting)


class PromptTokens:
    def __init__(self, tokenizer: Encoder, max_pieces: int = 100_000) -> None:
        self.tokenizer = tokenizer
        self.max_pieces = max_pieces
        self._pieces: dict[str, np.ndarray] = {}
        self._split = _special_split(tokenizer)
        self._lead = np.empty(0, dtype=np.int64)  # what encoding adds in front (BOS)
        self.hits = self.misses = 0
        if self._split is not None and not self._pieces_agree():
            self._split = None
        self.hits = self.misses = 0

    @classmethod
    def load(cls, setting: str) -> PromptTokens:
        return cls(load_tokenizer(setting))

    @property
    def piecewise(self) -> bool:
        return self._split is not None

    def chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> np.ndarray:
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt)
        return self.text(text)

    def text(self, text: str) -> np.ndarray:
        """int64 ids: the block index keys them with array arithmetic, no list round trip."""
        if self._split is None:
            return np.asarray(encode_prompt(self.tokenizer, text), dtype=np.int64)
        parts = [self._lead]
        cache, tag = self._pieces, self._split
        first, *rest = text.split(tag)  # a literal split: C speed, no regex scan
        # Cached by the text after each tag (the first piece, before any tag, on its own
        # key); the ids include the tag's.
        for i, piece in enumerate((first, *rest)):
            key = piece if i else ("", piece)
            got = cache.get(key)  # type: ignore[call-overload]
            if got is None:
                self.misses += 1
                whole = piece if not i else tag + piece
                got = np.asarray(self.tokenizer.encode(whole, add_special_tokens=False), np.int64)
                if len(cache) >= self.max_pieces:
                    cache.clear()  # rare: a cheap bound, refilled by the next turns
                cache[key] = got  # type: ignore[index]
            else:
                self.hits += 1
            parts.append(got)
        ids = np.concatenate(parts)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
            ids = ids[1:]
        return ids

    def _pieces_agree(self) -> bool:
        """Pieces encoded apart == the whole encoded, on a sample chat and a plain text."""
        tok = self.tokenizer
        plain = "Hello world"
        whole, bare = tok.encode(plain), tok.encode(plain, add_special_tokens=False)
        if whole[len(whole) - len(bare) :] != bare:
            return False  # something added at the end (EOS, SEP): not a prefix
        self._lead = np.asarray(whole[: len(whole) - len(bare)], dtype=np.int64)
        try:
            samples = [
                tok.apply_chat_template(_CHECK, True),
                tok.apply_chat_template(_CHECK[:2], True),
            ]
        except ValueError:  # no template: completion prompts only
            samples = []
        samples += [plain, "  two leading spaces\nand lines", "x<|y|>z"]
        for sample in samples:
            if self.text(sample).tolist() != encode_prompt(tok, sample):
                return False
        self._pieces.clear()
        return True


def _special_split(tokenizer: Encoder) -> str | None:
    """A regex that cuts text just before the special token the chat template writes
    once per message (`<|im_start|>`, `<|end|>`, ...): one piece per message, each
    starting with that token, so a turn costs a dict look-up per message."""
    hf = getattr(tokenizer, "_tok", None)
    if hf is None:  # the sim tokenizer: its template tags are `<|role|>` and `<|end|>`
        added = ["<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
    else:
        added = [t.content for t in hf.get_added_tokens_decoder().values() if t.content]
    if not added:
        return None
    try:
        sample = tokenizer.apply_chat_template(_CHECK, True)
    except ValueError:
        sample = ""
    counts = {tag: sample.count(tag) for tag in added}
    tag = max(added, key=lambda t: (counts[t], len(t)))
    if not counts[tag]:
        return None
    return tag
