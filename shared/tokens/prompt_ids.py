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
from collections.abc import Callable, Iterator, Sequence
from itertools import chain

import numpy as np

from shared.wire.kv_events import _MASK64, ID_CHARS, block_key_list

MAX_ID = 2**31 - 1  # the largest id a key holds (KV events and replica sync carry as many)
KEY_WIDTH = ID_CHARS  # chars of a TokenKey per id (the key text the block keys hash)


class TokenKey(str):
    """Token ids as the router's prefix tree keys them (router/holdings/tree.py): the ids'
    uint32 little-endian bytes read as Latin-1, one char a byte, KEY_WIDTH chars an id.

    A str, so the tree compares and slices a 2k-id prompt in C (a memcmp over 8 KB)
    where a tuple of ints compared item by item (match + insert: 16 µs a request as
    tuples, 2 µs as keys, loadtests/results/router_cpu.md). And it is the wire form
    (`wire()`): a replica turns a sync entry into a key with one decode, no int per id.
    Latin-1 maps every byte to one char with no error path (UTF-16 code units were tried:
    ids whose low half is a surrogate went through the codec's error handler, ~1 µs
    each). Its own type, so that a key of ids never passes for text, nor text for ids."""

    __slots__ = ()

    def wire(self) -> bytes:
        """The ids as uint32 little-endian bytes."""
        return self.encode("latin-1")

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
        # uint32, in C: refuses non-ints, negatives and anything past 2**32 - 1. Not "i":
        # its items go through an argument parser, ~3.4x the time (44 against 13 µs for
        # a 2.3k-id system prompt); the answers are the same with `ids_in_range` after.
        packed = array("I", ids)
    except (TypeError, OverflowError, ValueError):
        return None
    if sys.byteorder == "big":
        packed.byteswap()
    raw = packed.tobytes()
    if not ids_in_range(raw):
        return None  # an id past MAX_ID
    return key_of_wire(raw)


def ids_in_range(raw: bytes) -> bool:
    """Every uint32 little-endian id of `raw` is <= MAX_ID: each id's top byte is under
    0x80 (one C pass over a strided slice)."""
    return raw[3::4].isascii()


def key_of_wire(raw: bytes) -> TokenKey:
    """The key of ids given as uint32 little-endian bytes."""
    return TokenKey(raw.decode("latin-1"))


# Per block size: (keys of the blocks ending in this run, the key text after the last
# whole block, the last key so far: 0 before the first block).
_Keyed = tuple[list[int], str, int]


class Run:
    """One piece's ids after a given prefix: a node of the conversation trie."""

    __slots__ = ("chained", "end", "ids", "key", "keyed", "parent", "piece", "whole")

    def __init__(
        self, parent: Run | None, ids: tuple[int, ...], piece: str = "", key: str | None = None
    ) -> None:
        self.parent = parent
        self.ids = ids
        self.end = len(ids) if parent is None else parent.end + len(ids)  # ids up to here
        self.piece = piece  # the text it was keyed by (PromptTokens' trie)
        # `token_key(ids)` (given where the caller has it); "" where an id is no token id
        # (never a tokenizer's).
        self.key = (token_key(ids) or "") if key is None else key
        # Every run of the chain up to here has its key: a prompt's is their join.
        self.chained = (parent is None or parent.chained) and (self.key or not ids)
        self.keyed: dict[int, _Keyed] = {}  # block size -> what `chain_keys` computed
        # Block size -> the keys of every block up to this run's end, root first: held by
        # one run of a line of turns at a time (`chain_keys` moves it on).
        self.whole: dict[int, list[int]] = {}


def chain_keys(
    runs: Sequence[Run], block_size: int, grow: Callable[[int], None] | None = None
) -> list[int]:
    """The block keys of the ids of `runs` (a chain, root first), a new list.

    The runs not keyed yet at this block size (a new turn's few pieces, at the end) are
    keyed together, from the last key before them. The chain is the list the prompt was
    built from, so neither pass walks parent pointers.

    The whole chain's keys come from the deepest run before the last that holds them
    (`whole`), extended by the runs after it and moved to the run before the last: the
    next turn of the conversation extends that run, so a turn costs its new runs, not a
    pass over all of them (a 20-turn chat has ~60: the pass was the largest part of the
    KV index's lookup, loadtests/results/router_cpu.md). Moved, not copied, the lists
    hold each key of a line of turns once; a prompt that branches off where no run holds
    one (an edited turn, another chat on a shared system prompt) concatenates its runs
    and starts a list of its own, whose 8 bytes a key go to `grow` (the caches' byte
    bound, shared/tokens/prompt_tokens.py). The last run never holds one: a turn's
    generation prompt is a leaf the next turn does not extend."""
    last = len(runs) - 1
    keyed = last + 1
    while keyed and block_size not in runs[keyed - 1].keyed:
        keyed -= 1
    if keyed <= last:
        # Run by run on the runs' key text, each run's leftover carried into the next:
        # no list of ints is made. `block_key_text` in line (a slice and a hash a block):
        # the call a run was ~12% of a turn's keying (its ~3 new runs end 0-2
        # blocks each, loadtests/results/router_cpu.md).
        _, tail, prev = runs[keyed - 1].keyed[block_size] if keyed else (None, "", 0)
        width = ID_CHARS * block_size
        for run in runs[keyed:]:
            text = tail + run.key
            size = len(text)
            if size < 2 * width:
                # None or one block (most of a turn's runs: a question, an answer, its
                # generation prompt): no `range` object made (~600 instructions each)
                if size < width:
                    run.keyed[block_size] = ([], text, prev)
                    tail = text
                    continue
                prev = hash((prev, text[:width])) & _MASK64
                tail = text[width:]
                run.keyed[block_size] = ([prev], tail, prev)
                continue
            cut = size - size % width
            new = []
            for start in range(0, cut, width):
                prev = hash((prev, text[start : start + width])) & _MASK64
                new.append(prev)
            tail = text[cut:]
            run.keyed[block_size] = (new, tail, prev)
    # Only a keyed run holds `whole` (it is set below, after the keying): the scan starts
    # at the last keyed run before the last.
    held = (keyed if keyed < last else last) - 1
    while held >= 0 and block_size not in runs[held].whole:
        held -= 1
    if held + 1 < last:  # runs between: `whole` moves on to the run before the last
        whole = runs[held].whole.pop(block_size) if held >= 0 else []
        for run in runs[held + 1 : last]:
            whole += run.keyed[block_size][0]  # extended in place
        if held < 0 and grow is not None:
            grow(8 * len(whole))
        runs[last - 1].whole[block_size] = whole
    else:
        whole = runs[held].whole[block_size] if held >= 0 else []
    return whole + runs[last].keyed[block_size][0]  # a copy: `whole` changes as it moves


class PromptIds(Sequence[int]):
    """A prompt's ids, held as the runs of pieces they were built from (or as a tuple,
    keyed from scratch) and carrying their block keys and tree key.

    The flat tuple of ints is made only when something reads the ids one by one
    (iteration, indexing, `tolist`): the router reads their length, tree key and block
    keys, none of them per id. Building it on every request was the larger part of
    tokenizing a chat that was cached already: 2.3k ids joined into a list, then copied
    into the tuple subclass, each copy touching every id's int object (37 -> 7 µs for a
    cached 25-piece, 2.3k-id chat, loadtests/results/router_cpu.md). Equal to a tuple of
    the same ids (and hashed as one), as when it was a tuple."""

    __slots__ = ("_flat", "_len", "grow", "key", "runs")

    def __init__(self, ids: Sequence[int] = ()) -> None:
        self._flat: tuple[int, ...] | None = tuple(ids)
        self._len = len(self._flat)
        # The runs of its pieces, root first; none: keyed from scratch.
        self.runs: Sequence[Run] = ()
        self.key: TokenKey | None = None  # the tree's key, the runs' joined (PromptTokens.text)
        # The bytes its runs' key lists take (chain_keys).
        self.grow: Callable[[int], None] | None = None

    @classmethod
    def of_runs(
        cls, runs: Sequence[Run], length: int, key: TokenKey | None,
        grow: Callable[[int], None] | None,
    ) -> PromptIds:  # fmt: skip
        """The ids of `runs` (a chain, root first; `length` ids in all), not joined yet."""
        ids = cls.__new__(cls)
        ids._flat, ids._len, ids.runs, ids.key, ids.grow = None, length, runs, key, grow
        return ids

    def flat(self) -> tuple[int, ...]:
        """The ids as one tuple (joined from the runs the first time it is asked)."""
        flat = self._flat
        if flat is None:
            flat = self._flat = tuple(chain.from_iterable([run.ids for run in self.runs]))
        return flat

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):  # type: ignore[no-untyped-def,override]
        return self.flat()[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self.flat())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PromptIds):
            return self._len == other._len and self.flat() == other.flat()
        return self.flat() == other if isinstance(other, tuple) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.flat())

    def __repr__(self) -> str:
        return f"PromptIds({self.flat()!r})"

    def __array__(self, dtype=None, copy=None):  # type: ignore[no-untyped-def]
        return np.asarray(self.flat(), dtype=dtype)

    def tolist(self) -> list[int]:
        return list(self.flat())

    def tree_key(self) -> TokenKey | None:
        """`token_key(self)`, from the runs' keys where they are carried."""
        return self.key if self.key is not None else token_key(self.flat())

    def block_keys(self, block_size: int) -> list[int]:
        """`block_keys(self, block_size)` as ints, from the runs' keys where it has them."""
        runs = self.runs
        if not runs or not runs[-1].chained:  # an id that is no token id: no key text
            return block_key_list(self.flat(), block_size)
        return chain_keys(runs, block_size, self.grow)
