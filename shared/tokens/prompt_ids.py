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
"""

from __future__ import annotations

from itertools import chain

from shared.wire.kv_events import block_key_list

# Per block size: (keys of the blocks ending in this run, ids after the last whole
# block, the last key so far: 0 before the first block).
_Keyed = tuple[list[int], tuple[int, ...], int]


class Run:
    """One piece's ids after a given prefix: a node of the conversation trie."""

    __slots__ = ("ids", "keyed", "parent")

    def __init__(self, parent: Run | None, ids: tuple[int, ...]) -> None:
        self.parent = parent
        self.ids = ids
        self.keyed: dict[int, _Keyed] = {}  # block size -> what `chain_keys` computed


def chain_keys(last: Run, block_size: int) -> list[int]:
    """The block keys of the ids of `last` and its ancestors, root first.

    The runs not keyed yet at this block size (a new turn's few pieces; iteratively: a
    chat of thousands of messages is a chain that deep) are keyed together, from the
    last key before them."""
    runs = []
    run: Run | None = last
    while run is not None and block_size not in run.keyed:
        runs.append(run)
        run = run.parent
    if runs:
        tail, prev = run.keyed[block_size][1:] if run is not None else ((), 0)
        runs.reverse()
        flat = list(tail)
        ends = []
        for run in runs:
            flat += run.ids
            ends.append(len(flat))
        keys = block_key_list(flat, block_size, prev)  # whole blocks only
        done = 0  # blocks keyed by the runs before
        for run, end in zip(runs, ends, strict=True):
            upto = end // block_size  # the blocks that end inside this run (or before)
            new = keys[done:upto]
            prev = new[-1] if new else prev
            run.keyed[block_size] = (new, tuple(flat[upto * block_size : end]), prev)
            done = upto
    parts = []
    run = last
    while run is not None:
        parts.append(run.keyed[block_size][0])
        run = run.parent
    return list(chain.from_iterable(reversed(parts)))


class PromptIds(tuple[int, ...]):
    """A prompt's ids as a tuple of ints (what the token tree keys on, no conversion per
    request) that knows its block keys when it was built from cached pieces."""

    last: Run | None = None  # the run of its last piece; None: keyed from scratch

    def tolist(self) -> list[int]:
        return list(self)

    def block_keys(self, block_size: int) -> list[int]:
        """`block_keys(self, block_size)` as ints, from the runs' keys where it has them."""
        if self.last is None:
            return block_key_list(self, block_size)
        return chain_keys(self.last, block_size)


def from_runs(last: Run) -> PromptIds:
    """The ids of `last` and its ancestors, carrying `last` for their block keys."""
    parts = []
    run: Run | None = last
    while run is not None:
        parts.append(run.ids)
        run = run.parent
    flat: list[int] = []
    for ids in reversed(parts):
        flat += ids  # a list grown by tuples: a copy of pointers, 3x a chain iterator
    out = PromptIds(flat)
    out.last = last
    return out
