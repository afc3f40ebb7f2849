"""A prompt's ids that carry their block keys from one conversation turn to the next.

`PromptTokens` (shared/tokens/prompt_tokens.py) builds a chat's ids from cached pieces, one per
message. The router's block index (router/holdings/kv_index.py) looks a request up by the
key of each whole block (`block_key_list`: a block's content and its parent's key). Keying
a 2k-token prompt from scratch on every turn re-hashes ~125 blocks the previous turn
already keyed, so the pieces are chained instead:

    Run(parent, ids)    the ids of one piece after the pieces before it (a trie node,
                        one per distinct conversation prefix)

and each run remembers, per block size, the keys of the blocks that end inside it, the
ids left over after its last whole block and the last key. A new turn keys only the
blocks its new pieces complete (in one call), a block that straddles two pieces by the
run where it ends. The keys equal `block_key_list` of the whole prompt exactly (a property
test checks it): a cached key is never a different prompt's, because a run is reached
only through the very pieces before it.

Runs live in `PromptTokens`' bounded trie and are dropped with it; a prompt keeps its own
chain alive only while the request that carries it is in flight.

The router's prefix tree keys ids as a `TokenKey` (below): each run keeps its piece's
key, so a prompt's key is one join of its runs' keys, with no Python object per id.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from itertools import chain

import numpy as np

from shared.wire.kv_events import block_key_list

MAX_ID = 2**31 - 1  # the largest id a key holds (KV events and replica sync carry as many)


class TokenKey(str):
    """Token ids as the router's prefix tree keys them (router/holdings/tree.py): the ids'
    uint32 little-endian bytes read as UTF-16 code units, two per id (low half first).

    A str, so the tree compares and slices a 2k-id prompt in C (a memcmp over 8 KB)
    where a tuple of ints compared item by item: match + insert cost 16 µs a request as
    tuples, 2 µs as keys (loadtests/results/router_cpu.md). And it is the wire form
    (`wire()`), so a replica turns a sync entry into a key with one decode, no int per id.
    Two code units per id, never joined: an id <= MAX_ID has a high half <= 0x7FFF, so no
    surrogate pair forms (`token_key` and replica sync refuse larger ones). Its own type
    so that a key of ids never passes for text, nor text for ids."""

    __slots__ = ()

    def wire(self) -> bytes:
        """The ids as uint32 little-endian bytes."""
        return self.encode("utf-16-le", "surrogatepass")

    def ids(self) -> list[int]:
        return np.frombuffer(self.wire(), "<u4").tolist()  # type: ignore[no-any-return]


def token_key(ids: Sequence[int] | np.ndarray) -> TokenKey | None:
    """The key of `ids`; None when one is not a token id (< 0 or > MAX_ID, or not an int:
    a client's token-id prompt can hold anything)."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            return None
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) > MAX_ID):
            return None
        return key_of_wire(ids.astype("<u4").tobytes())
    try:
        packed = array("i", ids)  # int32, in C: refuses non-ints and anything past 2**31 - 1
    except (TypeError, OverflowError, ValueError):
        return None
    if sys.byteorder == "big":
        packed.byteswap()
    raw = packed.tobytes()
    if not raw[3::4].isascii():  # an id's top byte >= 0x80: its sign bit, a negative id
        return None
    return key_of_wire(raw)


def key_of_wire(raw: bytes) -> TokenKey:
    """The key of ids given as uint32 little-endian bytes, each <= MAX_ID (checked by the
    caller: a larger one could pair two code units into one)."""
    return TokenKey(raw.decode("utf-16-le", "surrogatepass"))


# Per block size: (keys of the blocks ending in this run, ids after the last whole
# block, the last key so far: 0 before the first block).
_Keyed = tuple[list[int], tuple[int, ...], int]


class Run:
    """One piece's ids after a given prefix: a node of the conversation trie."""

    __slots__ = ("ids", "key", "keyed", "parent")

    def __init__(self, parent: Run | None, ids: tuple[int, ...]) -> None:
        self.parent = parent
        self.ids = ids
        self.key = token_key(ids)  # None: an id the tree cannot key (the prompt is keyed whole)
        self.keyed: dict[int, _Keyed] = {}  # block size -> what `chain_keys` computed


def chain_keys(runs: Sequence[Run], block_size: int) -> list[int]:
    """The block keys of the ids of `runs` (a chain, root first).

    The runs not keyed yet at this block size (a new turn's few pieces, at the end) are
    keyed together, from the last key before them. The chain is the list the prompt was
    built from, so neither pass walks parent pointers."""
    keyed = len(runs)
    while keyed and block_size not in runs[keyed - 1].keyed:
        keyed -= 1
    if keyed < len(runs):
        tail, prev = runs[keyed - 1].keyed[block_size][1:] if keyed else ((), 0)
        flat = list(tail)
        ends = []
        for run in runs[keyed:]:
            flat += run.ids
            ends.append(len(flat))
        keys = block_key_list(flat, block_size, prev)  # whole blocks only
        done = 0  # blocks keyed by the runs before
        for run, end in zip(runs[keyed:], ends, strict=True):
            upto = end // block_size  # the blocks that end inside this run (or before)
            new = keys[done:upto]
            prev = new[-1] if new else prev
            run.keyed[block_size] = (new, tuple(flat[upto * block_size : end]), prev)
            done = upto
    return list(chain.from_iterable([run.keyed[block_size][0] for run in runs]))


class PromptIds(tuple[int, ...]):
    """A prompt's ids as a tuple of ints (what the token tree keys on, no conversion per
    request) that knows its block keys when it was built from cached pieces."""

    runs: Sequence[Run] = ()  # the runs of its pieces, root first; none: keyed from scratch
    key: TokenKey | None = None  # the tree's key, the runs' joined (from_runs)

    def tolist(self) -> list[int]:
        return list(self)

    def tree_key(self) -> TokenKey | None:
        """`token_key(self)`, from the runs' keys where they are carried."""
        return self.key if self.key is not None else token_key(self)

    def block_keys(self, block_size: int) -> list[int]:
        """`block_keys(self, block_size)` as ints, from the runs' keys where it has them."""
        if not self.runs:
            return block_key_list(self, block_size)
        return chain_keys(self.runs, block_size)


def from_runs(runs: Sequence[Run]) -> PromptIds:
    """The ids of `runs` (a chain, root first), carrying the runs for their block keys
    and the runs' keys joined for the tree's."""
    flat: list[int] = []
    keys = []
    for run in runs:
        flat += run.ids  # a list grown by tuples: a copy of pointers, 3x a chain iterator
        keys.append(run.key)
    out = PromptIds(flat)
    out.runs = runs
    if None not in keys:
        out.key = TokenKey("".join(keys))  # type: ignore[arg-type]
    return out
