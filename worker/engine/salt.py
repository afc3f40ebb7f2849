"""Cache namespaces: a request's `cache_salt` keeps its prefix cache apart (vLLM's field).

vLLM mixes the salt into the hash of a prompt's first block (`generate_block_hash_extra_keys`:
`cache_salt_keys = [cache_salt] if start_token_idx == 0`), so a salted prompt shares
blocks only with prompts of the same salt: two tenants who send the same prompt no longer
share a cache entry, and the timing of a hit tells neither what the other asked.

Our radix tree keys on token ids (int64), and a real token id is below 2**31. A salted
request's key carries its salt in the high bits of its first two elements:

    key[i] = token[i] | part_i << 31      i = 0, 1; part_i: 32 bits of blake2b(salt), odd

so the tree's root children (keyed by the first token, or the first page) differ for
every salt and for no salt: nothing below is shared across namespaces, while everything
within one is (same salt, same tokens, same key). 64 bits of the salt in all: two salts
share a namespace only on a 64-bit collision. The model never sees the key: its inputs
are the prompt's ids. The KV events publish the real ids (`untagged`) and the salt in
vLLM's form, `extra_keys` of the first block `(salt,)` (kv_blocks.py): each event's block
hashes are of the tagged key, so they differ per salt, as vLLM's do.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

TOKEN_MASK = (1 << 31) - 1
Tag = tuple[int, int]
MAX_SALT_CHARS = 256  # longer is refused (shared/wire/protocol.py): KV events bound strings


def salt_tag(salt: str) -> Tag:
    """The two 32-bit parts a salt puts in a key (odd: never 0, never no salt)."""
    digest = hashlib.blake2b(salt.encode(), digest_size=8, person=b"cache_salt").digest()
    return int.from_bytes(digest[:4], "big") | 1, int.from_bytes(digest[4:], "big") | 1


def salted(ids: Sequence[int] | np.ndarray, tag: Tag | None) -> np.ndarray:
    """The tree key of `ids` in `tag`'s namespace (no tag: the ids as they are)."""
    arr = np.array(ids, dtype=np.int64)  # a copy: the request's ids stay the model's input
    if tag is not None:
        for i, part in enumerate(tag[: len(arr)]):
            arr[i] |= part << 31
    return arr


def tag_of(key: np.ndarray) -> Tag | None:
    """The salt tag in a key that starts at the root (None: unsalted)."""
    if len(key) == 0 or key[0] <= TOKEN_MASK:
        return None
    second = int(key[1]) >> 31 if len(key) > 1 else 0
    return int(key[0]) >> 31, second


class SaltNames:
    """Tag -> the salt it came from, so events can name the salt (vLLM's extra_keys).
    Bounded (least recently named dropped): an unnamed tag is published as its hex."""

    def __init__(self, max_names: int = 65_536) -> None:
        self.max_names = max_names
        self._names: OrderedDict[Tag, str] = OrderedDict()

    def name(self, tag: Tag, salt: str) -> None:
        names = self._names
        for key in (tag, (tag[0], 0)):  # (first part, 0): a one-token prompt's key
            names[key] = salt
            names.move_to_end(key)
        while len(names) > self.max_names:
            names.popitem(last=False)

    def of(self, tag: Tag) -> str:
        found = self._names.get(tag)
        return found if found is not None else f"tag:{tag[0]:08x}{tag[1]:08x}"
