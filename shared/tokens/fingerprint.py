"""A short id of what a tokenizer does, so router replicas can tell whether they agree.

Replica sync (router/holdings/sync.py) shares routing decisions as prompt token ids when the
router's tree keys on tokens. Ids only mean something under the tokenizer (and chat
template) that made them: a replica configured with another tokenizer or model must not
insert them into its tree, or its predictions would match unrelated prompts. So every
token entry carries the writer's fingerprint and a reader drops entries whose fingerprint
is not its own.

The fingerprint is computed from behaviour, not from the `tokenizer` setting: two pods
mount the same tokenizer at different paths (the same fingerprint), and one path may hold
another model after an upgrade (a different one). It hashes the ids of a probe chat
rendered with the model's template, of a probe text that exercises whitespace, digits,
punctuation and non-ASCII, and the vocabulary size where the tokenizer has one. Two
tokenizers that agree on all of that but differ elsewhere would share a fingerprint; the
cost is then a poorer prediction on the prompts where they differ, never a crash.
"""

from __future__ import annotations

import hashlib
from typing import Any

from shared.tokens.prompt_tokens import Encoder, encode_prompt

FINGERPRINT_LEN = 16  # hex chars (64 bits)

_CHAT = [
    {"role": "system", "content": "You route requests. Be brief."},
    {"role": "user", "content": "Wie geht's?  12,345.67 + 8 = ?\n\t<tag> naïve café 東京 🙂"},
    {"role": "assistant", "content": "def f(x):\n    return x ** 2  # ok"},
    {"role": "user", "content": "Again, with   spaces."},
]
_TEXT = "The quick brown fox 0123456789 !?#$%&*()[]{} \u00e9\u00e8 \u4e2d\u6587 \U0001f600\n\n  end"


def tokenizer_fingerprint(tokenizer: Encoder) -> str:
    """FINGERPRINT_LEN hex chars identifying `tokenizer`'s ids (and its chat template)."""
    h = hashlib.blake2b(digest_size=FINGERPRINT_LEN // 2)
    h.update(_ids_bytes(encode_prompt(tokenizer, _TEXT)))
    try:
        rendered = tokenizer.apply_chat_template(list(_CHAT), True)
    except ValueError:  # no chat template: completion prompts only
        rendered = ""
    h.update(b"|chat|" + rendered.encode("utf-8", "replace"))
    h.update(b"|ids|" + _ids_bytes(encode_prompt(tokenizer, rendered)) if rendered else b"")
    h.update(b"|vocab|" + str(_vocab_size(tokenizer)).encode())
    return h.hexdigest()


def _ids_bytes(ids: list[int]) -> bytes:
    return b",".join(str(int(i)).encode() for i in ids)


def _vocab_size(tokenizer: Any) -> int:
    hf = getattr(tokenizer, "_tok", None)  # shared/tokens/tokenizer.py wraps HF `tokenizers`
    if hf is not None and hasattr(hf, "get_vocab_size"):
        return int(hf.get_vocab_size(with_added_tokens=True))
    return -1
