"""The sim engine's stand-in for a model: a deterministic answer for every prompt.

The answer is words drawn from a generator seeded by a hash of the prompt's token ids
(same prompt, same answer, in every process), tokenized with the engine's tokenizer.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np

from worker.engine.protocols import EngineTokenizer

_WORDS = (
    "the", "cache", "holds", "a", "prefix", "of", "every", "prompt", "so", "router", "that",
    "sends", "each", "request", "to", "worker", "with", "its", "longest", "match", "skips",
    "most", "prefill", "work", "while", "load", "stays", "even", "across", "all", "nodes",
    "in", "fleet",
)  # fmt: skip


def answer_ids(tokenizer: EngineTokenizer, prompt_ids: list[int], n: int) -> list[int]:
    """Exactly `n` token ids of the prompt's deterministic answer."""
    digest = hashlib.blake2b(np.asarray(prompt_ids, dtype=np.int64).tobytes(), digest_size=8)
    rng = random.Random(digest.digest())
    ids: list[int] = []
    while len(ids) < n:
        words = " ".join(rng.choice(_WORDS) for _ in range(max(8, n - len(ids))))
        ids.extend(tokenizer.encode(words + " ", add_special_tokens=False))
    return ids[:n]
