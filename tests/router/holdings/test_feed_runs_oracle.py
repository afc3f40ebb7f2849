"""The feed's runs (router/holdings/feed_entries.py `event_runs`) answer as the rule they
replaced: main 2b35cc5's `event_runs`, kept here as the oracle (before a stored event with
no LoRA and no extra keys skipped the namespace call, and a removal the stored check).
Random batches of stored, removed and cleared events, of other namespaces (LoRA names and
ids, extra keys, extra keys all None), of large events split into pieces by blocks and by
tokens, give the same runs of the same events, in the same order, and the same count of
events left out."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

from hypothesis import example, given, settings
from hypothesis import strategies as st

from router.holdings.feed_entries import RUN_BLOCKS, RUN_TOKENS, block_pieces, event_runs
from router.holdings.namespace import in_default_namespace
from shared.wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    ids_text,
)


def old_event_runs(events: Sequence[KVEvent], dropped: Counter[str]) -> Iterator[list[KVEvent]]:
    """`event_runs` as main 2b35cc5 had it."""
    run: list[KVEvent] = []
    blocks = tokens = 0
    for event in events:
        if isinstance(event, AllBlocksCleared):
            if run:
                yield run
                run, blocks, tokens = [], 0, 0
            yield [event]
            continue
        if not in_default_namespace(event):
            dropped["namespace"] += 1
            continue
        n = len(event.block_hashes)  # type: ignore[union-attr]
        t = len(event.token_ids) if isinstance(event, BlockStored) else 0
        if blocks + n <= RUN_BLOCKS and tokens + t <= RUN_TOKENS:
            run.append(event)
            blocks += n
            tokens += t
            continue
        big = n > RUN_BLOCKS or t > RUN_TOKENS
        for piece in block_pieces(event) if big else (event,):
            n = len(piece.block_hashes)  # type: ignore[union-attr]
            t = len(piece.token_ids) if isinstance(piece, BlockStored) else 0
            if run and (blocks + n > RUN_BLOCKS or tokens + t > RUN_TOKENS):
                yield run
                run, blocks, tokens = [], 0, 0
            run.append(piece)
            blocks += n
            tokens += t
    if run:
        yield run


@st.composite
def events(draw: st.DrawFn) -> KVEvent:
    kind = draw(st.sampled_from(["stored", "stored", "removed", "removed", "cleared", "again"]))
    if kind == "cleared":
        return AllBlocksCleared()
    # a few blocks (the live stream's events), or past a run's bounds (split into pieces)
    n = draw(st.sampled_from([1, 2, 3, 8, 300, 520, RUN_BLOCKS - 4, RUN_BLOCKS, RUN_BLOCKS + 600]))
    hashes = tuple(range(1, n + 1))
    medium = draw(st.sampled_from([None, "GPU", "CPU"]))
    if kind == "removed":
        return BlockRemoved(hashes, medium)
    if kind == "again":  # stored by hash only: no tokens
        return BlockStored(hashes, None, [], 0, medium)
    bs = draw(st.sampled_from([1, 16, 64]))
    ids = [7] * (n * bs)
    keys = draw(st.sampled_from([None, "none", "salt", "later"]))
    extra = {
        None: None,
        "none": (None,) * n,  # extra keys, all None: still the default namespace
        "salt": (("salt",),) + (None,) * (n - 1),
        "later": (None,) * (n - 1) + ((7,),),
    }[keys]
    lora = draw(st.sampled_from([None, None, "adapter", 3]))
    text = draw(st.sampled_from([ids_text(ids), None]))
    parent = draw(st.sampled_from([None, 99]))
    return BlockStored(hashes, parent, ids, bs, medium, extra, lora, text)


def stored(n: int, bs: int) -> BlockStored:
    return BlockStored(tuple(range(1, n + 1)), None, [7] * (n * bs), bs, None)


@settings(max_examples=300, deadline=None)
@given(st.lists(events(), max_size=12))
@example([stored(RUN_BLOCKS - 4, 64)])  # past the token bound alone: in pieces
@example([stored(300, 64), stored(300, 64), BlockRemoved((1,)), stored(2, 16)])
def test_event_runs_answer_as_the_old_rule(batch: list[KVEvent]) -> None:
    new, old = Counter[str](), Counter[str]()
    got = list(event_runs(batch, new))
    want = list(old_event_runs(batch, old))
    assert got == want
    assert [[type(e) for e in run] for run in got] == [[type(e) for e in run] for run in want]
    assert new == old
