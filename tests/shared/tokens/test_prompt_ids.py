"""Block keys carried across conversation turns (shared/tokens/prompt_ids.py) equal the keys of
the whole prompt computed from scratch: across turns, edited earlier messages, block
sizes, tokenizers, and after the caches are cleared at their bounds."""

from __future__ import annotations

import sys
from array import array
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.holdings.kv_index import BlockIndex
from shared.tokens import prompt_ids
from shared.tokens.prompt_ids import (
    ID_CHARS,
    MAX_ID,
    PromptIds,
    Run,
    TokenKey,
    key_of_wire,
    token_key,
)
from shared.tokens.prompt_tokens import PromptTokens, encode_prompt, load_tokenizer
from shared.wire.kv_events import (
    BlockStored,
    block_key_list,
    block_key_text,
    block_keys,
    ids_text,
)

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
SIZES = (1, 3, 16)


def scratch(ids: PromptIds, size: int) -> list[int]:
    return block_keys(np.asarray(list(ids), dtype=np.int64), size).tolist()


@pytest.fixture(params=["sim", "tiny"])  # tiny: a Llama template that writes BOS itself
def setting(request, tiny_model_dir: Path) -> str:
    return "sim" if request.param == "sim" else str(tiny_model_dir)


def test_carried_keys_are_the_whole_prompts_keys(setting: str) -> None:
    router = PromptTokens.load(setting)
    worker = load_tokenizer(setting)

    @settings(max_examples=40, deadline=None)
    @given(
        system=st.sampled_from(["Be brief. " * 12, "Be kind. " * 9]),
        turns=st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=5),
        edit=st.integers(0, 9),
    )
    def check(system: str, turns: list[tuple[str, str]], edit: int) -> None:
        chat = [{"role": "system", "content": system}]
        for user, answer in turns:
            chat.append({"role": "user", "content": user})
            ids = router.chat(chat)
            assert list(ids) == encode_prompt(worker, worker.apply_chat_template(chat, True))
            for size in SIZES:  # each size keyed apart; asked twice: cached the second time
                assert ids.block_keys(size) == scratch(ids, size)
                assert ids.block_keys(size) == scratch(ids, size)
            chat.append({"role": "assistant", "content": answer})
        # An earlier message edited: the turns after it are another branch of the trie.
        k = edit % len(chat)
        chat[k] = {**chat[k], "content": chat[k]["content"] + " (edited)"}
        ids = router.chat(chat)
        assert list(ids) == encode_prompt(worker, worker.apply_chat_template(chat, True))
        assert all(ids.block_keys(size) == scratch(ids, size) for size in SIZES)

    check()
    assert router.piecewise


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, MAX_ID), max_size=40))
def test_a_token_key_is_the_ids_bytes(ids: list[int]) -> None:
    key = token_key(ids)
    assert type(key) is TokenKey and len(key) == 4 * len(ids)
    assert key.ids() == ids
    assert key.wire() == np.asarray(ids, dtype="<u4").tobytes()  # replica sync's payload
    assert key_of_wire(key.wire()) == key
    assert token_key(np.asarray(ids, dtype=np.int64)) == key


def _token_key_by_int32(ids: list[object]) -> TokenKey | None:
    """`token_key` as it packed ids before (array "i", int32), the reference."""
    try:
        packed = array("i", ids)  # type: ignore[arg-type]
    except (TypeError, OverflowError, ValueError):
        return None
    if sys.byteorder == "big":
        packed.byteswap()
    raw = packed.tobytes()
    return key_of_wire(raw) if raw[3::4].isascii() else None


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.one_of(
    st.integers(0, MAX_ID), st.integers(-(2**40), 2**40), st.sampled_from(
        [-1, MAX_ID, MAX_ID + 1, 2**32 - 1, 2**32, -(2**31), True, False, 1.0, "7", None]
    ),
), max_size=12))  # fmt: skip
def test_a_token_key_answers_as_the_int32_packing_did(ids: list[object]) -> None:
    assert token_key(ids) == _token_key_by_int32(ids)  # type: ignore[arg-type]


def test_a_token_key_refuses_what_is_no_token_id() -> None:
    """A client's token-id prompt can hold anything: no key (the room keys it by text),
    never an exception."""
    for bad in ([-1], [MAX_ID + 1], [0xDC00D800], [2**70], [1.0], ["7"], [[1]], [None]):
        assert token_key(bad) is None, bad  # type: ignore[arg-type]
    assert token_key(np.asarray([5, -1])) is None
    assert token_key(np.asarray([0.5])) is None
    assert token_key(()) == ""


def test_prompt_ids_carry_their_tree_key() -> None:
    router = PromptTokens.load("sim")
    chat = [{"role": "system", "content": "Keyed words. " * 30}]
    for turn in range(4):
        chat.append({"role": "user", "content": f"turn {turn}"})
        ids = router.chat(chat)
        assert ids.key is not None  # joined from the runs' keys, not rebuilt per request
        assert ids.tree_key() == token_key(list(ids))
        chat.append({"role": "assistant", "content": f"answer {turn}"})


def test_a_conversations_block_keys_are_held_once_and_moved_on() -> None:
    """One run of a line of turns holds the whole chain's keys (the run before the last,
    which the next turn extends): a turn keys its new runs only, and a 30-turn chat holds
    one list, not one a turn. A turn that branches off (an edit) keys from its runs."""
    router = PromptTokens.load("sim")
    chat = [{"role": "system", "content": "Moved words. " * 40}]
    for turn in range(30):
        chat.append({"role": "user", "content": f"turn {turn}"})
        ids = router.chat(chat)
        assert ids.block_keys(4) == scratch(ids, 4)
        holders = [run for run in ids.runs if 4 in run.whole]
        assert holders == [ids.runs[-2]]
        chat.append({"role": "assistant", "content": f"answer {turn}"})
    edited = [*chat[:3], {"role": "assistant", "content": "another answer"}, chat[3]]
    ids = router.chat(edited)
    assert ids.block_keys(4) == scratch(ids, 4)


def test_the_caches_stay_within_their_bounds_and_stay_right() -> None:
    router = PromptTokens(load_tokenizer("sim"), max_entries=12, max_tokens=600)
    chats = [[{"role": "system", "content": f"Chat {i}. " + "word " * 40}] for i in range(5)]
    for turn in range(8):
        for i, chat in enumerate(chats):
            chat.append({"role": "user", "content": f"turn {turn} of {i}"})
            ids = router.chat(chat)
            pieces, runs, held = router.cached
            assert pieces + runs <= 12 and held <= 600
            assert ids.block_keys(4) == scratch(ids, 4)
    # Ids made before a clear keep their own chain: still right after many clears.
    early = router.chat(chats[0][:2])
    for i in range(30):
        router.chat([{"role": "user", "content": f"filler {i} " * 10}])
    assert early.block_keys(8) == scratch(early, 8)


def test_another_tokenizer_never_reads_the_cache(tiny_model_dir: Path) -> None:
    chat = [{"role": "system", "content": "Shared words. " * 20}, {"role": "user", "content": "hi"}]
    sim, tiny = PromptTokens.load("sim"), PromptTokens.load(str(tiny_model_dir))
    a = sim.chat(chat)
    misses = tiny.misses
    b = tiny.chat(chat)
    assert tiny.misses > misses  # nothing of sim's reached tiny's instance
    assert list(b) == encode_prompt(tiny.tokenizer, tiny.tokenizer.apply_chat_template(chat))
    assert list(a) != list(b)
    assert a.block_keys(4) == scratch(a, 4) and b.block_keys(4) == scratch(b, 4)


def test_the_index_matches_carried_keys_as_plain_ids() -> None:
    router = PromptTokens.load("sim")
    chat = [{"role": "system", "content": "Held words. " * 30}, {"role": "user", "content": "one"}]
    held = router.chat(chat)
    index = BlockIndex(4)
    n = len(held) // 4 * 4
    index.apply("w0", [BlockStored(tuple(range(1, n // 4 + 1)), None, list(held)[:n], 4)])
    chat += [{"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}]
    ids = router.chat(chat)
    assert ids.runs  # carried, not keyed from scratch
    assert index.match(ids) == index.match(np.asarray(list(ids))) == {"w0": n}


def test_prompt_ids_read_as_the_tuple_of_their_ids() -> None:
    """Held as runs, the ids still read as the tuple they stand for: length, items,
    slices, equality and hash, numpy."""
    router, worker = PromptTokens.load("sim"), load_tokenizer("sim")
    chat = [{"role": "system", "content": "Runs of words. " * 20}, {"role": "user", "content": "a"}]
    router.chat(chat)
    chat += [{"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    ids = router.chat(chat)
    assert ids.runs
    whole = tuple(encode_prompt(worker, worker.apply_chat_template(chat, True)))
    assert len(ids) == len(whole) and ids.tolist() == list(whole) == list(ids)
    assert ids == whole and hash(ids) == hash(whole) and ids != whole[:-1]
    assert ids[5] == whole[5] and ids[-1] == whole[-1] and ids[3:9] == whole[3:9]
    assert np.asarray(ids, dtype=np.int64).tolist() == list(whole)
    assert PromptIds(whole) == ids and PromptIds([1, 2]) == (1, 2)


def test_routing_reads_a_prompts_keys_not_its_ids_one_by_one() -> None:
    """The tree's key, the index's block keys and the length come from the runs: the
    flat tuple of ints (~40 us of a 2k-id chat's tokenizing when it was built on every
    request) is not made on the way."""
    router = PromptTokens.load("sim")
    chat = [{"role": "system", "content": "Joined late. " * 40}, {"role": "user", "content": "x"}]
    held = router.chat(chat)
    index = BlockIndex(16)
    n = len(held) // 16 * 16
    index.apply("w0", [BlockStored(tuple(range(1, n // 16 + 1)), None, held.tolist()[:n], 16)])
    chat += [{"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}]
    ids = router.chat(chat)
    assert ids.tree_key() == token_key(list(ids))
    ids = router.chat(chat)  # asked again: nothing read above
    assert index.match_tiers(ids) == {"w0": (n, n)} and len(ids) > n
    assert index.lost_at("w0", ids, 0) == float("-inf") and ids.tree_key()
    assert ids._flat is None  # (private: what this test is about)


def test_block_keys_chain_from_their_parent_and_tell_repeats_apart() -> None:
    a, b = list(range(32)), list(range(100, 116))
    whole = block_key_list(a + b + [7, 7], 16)  # the partial block is not keyed
    assert len(whole) == 3 and all(0 <= k < 2**64 for k in whole)
    assert whole[:2] == block_key_list(a, 16)
    assert whole[2:] == block_key_list(b, 16, parent=whole[1])
    assert block_keys(np.asarray(a + b), 16).tolist() == whole  # the events' array form
    assert len(set(block_key_list([0] * 64, 16))) == 4  # same tokens, other parents


def test_keys_of_the_ids_key_text_are_the_ids_keys_and_non_ids_are_keyed_apart() -> None:
    """Block keys hash each block's slice of the ids' key text (the TokenKey's chars):
    from a list of ids, from that text, or from a prompt's TokenKey, the same keys. Ids
    that are no token ids (a client's prompt can hold anything) get keys of their own,
    never a token prompt's: a negative id is not the uint32 it wraps to."""
    ids = [7, 0, 2**31 - 1, 300] * 12  # 3 blocks of 16
    keys = block_key_list(ids, 16)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert block_key_text(ids_text(ids), 16) == keys  # type: ignore[arg-type]
    assert block_key_text(token_key(ids), 16) == keys  # type: ignore[arg-type]
    assert block_key_list(ids[:40], 16) == keys[:2]  # whole blocks only
    assert block_key_text(ids_text(ids[16:]), 16, keys[0]) == keys[1:]  # type: ignore[arg-type]
    assert ids_text([-1]) is None and ids_text([2**32]) is None and ids_text([1.0]) is None
    wrapped = block_key_list([5] * 15 + [2**32 - 1], 16)
    assert block_key_list([5] * 15 + [-1], 16) != wrapped
    assert block_key_list([5] * 15 + [2**32 + 5], 16) != block_key_list([5] * 16, 16)
    assert len(block_key_list([-1] * 40, 16)) == 2


def old_chain_keys(runs, block_size, grow=None):  # type: ignore[no-untyped-def]
    """`chain_keys` as main ecd65ff had it (before its keying loop skipped the pieces no
    block ends in and its scan for `whole` started at the last keyed run)."""
    keyed = len(runs)
    while keyed and block_size not in runs[keyed - 1].keyed:
        keyed -= 1
    if keyed < len(runs):
        tail, prev = runs[keyed - 1].keyed[block_size][1:] if keyed else ("", 0)
        width = ID_CHARS * block_size
        for run in runs[keyed:]:
            text = tail + run.key if tail else run.key
            cut = len(text) - len(text) % width
            new = block_key_text(text, block_size, prev) if cut else []
            prev = new[-1] if new else prev
            tail = text[cut:]
            run.keyed[block_size] = (new, tail, prev)
    last = len(runs) - 1
    held = last - 1
    while held >= 0 and block_size not in runs[held].whole:
        held -= 1
    if held + 1 < last:
        whole = runs[held].whole.pop(block_size) if held >= 0 else []
        for run in runs[held + 1 : last]:
            whole += run.keyed[block_size][0]
        if held < 0 and grow is not None:
            grow(8 * len(whole))
        runs[last - 1].whole[block_size] = whole
    else:
        whole = runs[held].whole[block_size] if held >= 0 else []
    return whole + runs[last].keyed[block_size][0]


def run_state(runs: list[Run]) -> list:
    return [(sorted(r.keyed.items()), sorted(r.whole.items())) for r in runs]


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    prompts=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 3)), min_size=1, max_size=12),
    sizes=st.lists(st.sampled_from((1, 3, 16)), min_size=1, max_size=3),
)
def test_chain_keys_answers_and_moves_as_it_did(
    pieces: list[int], prompts: list[tuple[int, int]], sizes: list[int]
) -> None:
    """Twin tries of runs (pieces of 0-40 ids), prompts that extend, repeat and branch
    off them, keyed at mixed block sizes: every answer, every run's keyed pieces and
    `whole` lists, and the bytes `grow` is told, are the old code's."""
    tries = []
    for _ in range(2):
        root = Run(None, tuple(range(1, pieces[0] + 1)))
        line = [root]
        for i, n in enumerate(pieces[1:]):
            line.append(Run(line[-1], tuple(range(100 * i, 100 * i + n))))
        tries.append(line)
    grown: list[list[int]] = [[], []]
    for depth, branch in prompts:
        answers = []
        for t, fn in enumerate((prompt_ids.chain_keys, old_chain_keys)):
            line = tries[t]
            runs = line[: 1 + depth % len(line)]
            if branch:  # a leaf off the line (a generation prompt, an edited turn)
                runs = [*runs, Run(runs[-1], tuple(range(7, 7 + 5 * branch)))]
            answers.append([fn(runs, size, grown[t].append) for size in sizes])
        assert answers[0] == answers[1]
        assert run_state(tries[0]) == run_state(tries[1])
        assert grown[0] == grown[1]
