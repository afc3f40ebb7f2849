"""A conversation's line (shared/tokens/prompt_tokens.py `PromptTokens._pieced`): a next
turn takes its previous turn's runs where it starts with that turn's text, found by
name (`_chat_line`, `_text_line`) and one comparison, and splits only the text after it.

Held to the rule before it (2b35cc5: the whole text split, the line found by its first
LINE_KEY pieces and a comparison of the piece lists, `OldLines` below, verbatim) and to
the worker's own encoding, over generated sessions of chats: next turns, edited and
regenerated turns, branches off an earlier turn, chats on one system prompt, text
prompts among them, caches cleared by their bounds, non-ASCII text, on the sim and a
real BPE tokenizer with a template that writes BOS itself (encoding doubles it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.tokens.prompt_ids import PromptIds, Run, TokenKey, token_key
from shared.tokens.prompt_tokens import (
    _ENTRY_BYTES,
    _ID_BYTES,
    _LINE_BYTES,
    LINE_KEY,
    PromptTokens,
    _first_two,
    encode_prompt,
    load_tokenizer,
)

# The tiny model's tags, the sim's tags and the split marks a text can hold by chance.
WORDS = st.sampled_from([
    "Alpha", "bravo", " ", "\n", "  ", "¿Qué?", "— ", "émoji 🙂", "42", "<|", "|>", "<|end|",
    "<|im_start|>", "<|end|>", "x" * 40,
])  # fmt: skip
CONTENT = st.lists(WORDS, max_size=8).map("".join)
# A BOS the template writes, which encoding adds again (`encode_prompt` drops one).
BOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class OldLines(PromptTokens):
    """`PromptTokens.text` and `_line_of` as they were (2b35cc5), on their own lines, and
    `_run` / `_remember` as they were before `_extend` (9e7b27e)."""

    def __init__(self, tokenizer: Any, **bounds: int) -> None:
        super().__init__(tokenizer, **bounds)
        self._lines = {}  # type: ignore[assignment]

    def chat(self, messages, add_generation_prompt=True):  # type: ignore[no-untyped-def]
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt)
        return self.text(text)

    def text(self, text: str) -> PromptIds:
        if self._split is None:
            return PromptIds(encode_prompt(self.tokenizer, text))
        pieces = text.split(self._split)  # a literal split: C speed, no regex scan
        seen, chain, keys = self._line_of(pieces)
        runs, run = self._runs, chain[-1] if chain else None
        cleared, self._unkept = self._cleared, False
        for i in range(len(chain), len(pieces)):
            piece = pieces[i]
            key = piece if i else ("", piece)
            got = runs.get((run, key))
            if got is None:
                got = self._run(run, key, piece)
            else:
                self.hits += 1
            run = got
            seen.append(got.piece)
            chain.append(got)
            keys.append(got.key)
        if self._cleared == cleared and not self._unkept:  # every run held by the trie
            self._lines[tuple(seen[:LINE_KEY])] = (seen, chain, keys)  # type: ignore[index]
        key = TokenKey("".join(keys)) if run.chained else None  # type: ignore[union-attr]
        ids = PromptIds.of_runs(chain, run.end, key, self._grow)  # type: ignore[union-attr]
        bos = self._bos
        if bos is not None and len(ids) >= 2 and _first_two(chain) == (bos, bos):
            return PromptIds(ids.flat()[1:])
        return ids

    def _run(self, parent: Run | None, key: object, piece: str) -> Run:  # (9e7b27e's)
        got = self._pieces.get(key)
        if got is None:
            self.misses += 1
            whole = piece if parent is None else self._split + piece  # type: ignore[operator]
            ids = tuple(self.tokenizer.encode(whole, add_special_tokens=False))
            got = (ids, token_key(ids) or "")  # "": an id that is no token id
            self._remember_old(self._pieces, key, got, 4 * len(piece))
        else:
            self.hits += 1
        ids, ids_key = got
        if parent is None:
            ids = self._lead + ids  # (the same tuple where nothing leads)
            bos = self._bos
            # A chat template's output already starts with BOS; encoding adds a second one.
            if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
                ids = ids[1:]
            if ids is not got[0]:
                ids_key = token_key(ids) or ""
        run = Run(parent, ids, piece, ids_key)
        self._remember_old(self._runs, (parent, key), run, 4 * len(piece))  # its key: the text
        return run

    def _remember_old(  # (9e7b27e's `_remember`)
        self, cache: dict[Any, Any], key: object, value: Any, text: int = 0
    ) -> None:
        n = len(value.ids if isinstance(value, Run) else value[0])
        size = text + _ID_BYTES * n + _ENTRY_BYTES
        if size > self.max_bytes // 16:
            self._unkept = True
            return  # one piece would crowd out the rest: encoded, not kept
        if (
            len(self._pieces) + len(self._runs) >= self.max_entries
            or self._held + n > self.max_tokens
            or self._bytes + size > self.max_bytes
        ):
            self._clear()
        cache[key] = value
        self._held += n
        self._bytes += size

    def _line_of(self, pieces: list[str]) -> tuple[list[str], list[Any], list[str]]:
        line = self._lines.get(tuple(pieces[:LINE_KEY]))  # type: ignore[call-overload]
        if line is None:
            return [], [], []
        seen, chain, keys = line
        m = len(seen) - 1
        if m < 1 or len(pieces) <= m or pieces[:m] != seen[:m]:
            return [], [], []
        self.hits += m
        return seen[:m], chain[:m], keys[:m]


class Counted(PromptTokens):
    """PromptTokens counting the bytes its runs' key lists took (`_grow`) since the
    caches were last cleared."""

    grown = 0

    def _grow(self, nbytes: int) -> None:
        super()._grow(nbytes)  # (which may clear, and so zero `grown`, first)
        self.grown += nbytes

    def _clear(self) -> None:
        super()._clear()
        self.grown = 0


def lines_are_held(tokens: Counted) -> None:
    """Every line holds runs of the trie only, but its last (a line kept over a clear
    would hold runs the byte bound no longer counts; its last, a prompt's last piece,
    need not be, `_extend`: the line counts its text), and their keys; the bytes
    counted are exactly
    what the caches and lines hold now (a line replaced is uncounted)."""
    held = {id(run) for run in tokens._runs.values()}
    lines = 0
    for start, chain, keys, size in tokens._lines.values():
        assert all(id(run) in held for run in chain[:-1])  # (its last: never taken)
        assert keys == [run.key for run in chain]
        assert size == 4 * (len(start) + len(chain[-1].piece)) + 16 * len(chain) + _LINE_BYTES
        lines += size
    pieces = sum(4 * len(key if type(key) is str else key[1]) + 40 * len(ids) + 200
                 for key, (ids, _) in tokens._pieces.items())  # fmt: skip
    runs = sum(4 * len(run.piece) + 40 * len(run.ids) + 200 for run in tokens._runs.values())
    assert tokens.held_bytes == pieces + runs + lines + tokens.grown <= tokens.max_bytes


# A step of a session: (chat, what happens to it, content).
STEP = st.tuples(
    st.integers(0, 2),
    st.sampled_from(["next"] * 5 + ["edit", "regenerate", "branch", "text", "clear"]),
    CONTENT,
    st.integers(0, 30),
)


@pytest.fixture(params=["sim", "bos"])
def setting(request, tiny_model_dir: Path, tmp_path: Path) -> str:
    if request.param == "sim":
        return "sim"
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model_dir)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = BOS_TEMPLATE
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(model_dir)


def test_a_turn_is_tokenized_as_by_the_rule_before_and_by_the_worker(setting: str) -> None:
    worker = load_tokenizer(setting)
    shared_system = "You are brief. " * 20

    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        systems=st.lists(st.one_of(st.none(), st.just(shared_system), CONTENT), min_size=3,
                         max_size=3),
        starts=st.lists(st.lists(CONTENT, min_size=0, max_size=4), min_size=3, max_size=3),
        steps=st.lists(STEP, min_size=4, max_size=30),
        max_bytes=st.sampled_from([256 * 1024 * 1024, 24 * 1024]),
    )  # fmt: skip
    def check(systems: list[str | None], starts: list[list[str]],
              steps: list[tuple[int, str, str, int]], max_bytes: int) -> None:  # fmt: skip
        new = Counted(worker, max_bytes=max_bytes)
        old = OldLines(worker, max_bytes=max_bytes)
        chats = [[] if s is None else [{"role": "system", "content": s}] for s in systems]
        for chat, start in zip(chats, starts, strict=True):  # earlier turns, not asked
            chat += [{"role": ("user", "assistant")[i % 2], "content": c}
                     for i, c in enumerate(start[: len(start) // 2 * 2])]  # fmt: skip
        for c, what, content, at in steps:
            chat = chats[c]
            if what == "text":
                prompt = content + "".join(m["content"] for m in chat)
                got, want = new.text(prompt), old.text(prompt)
                assert got.tolist() == want.tolist() == encode_prompt(worker, prompt)
                assert got.tree_key() == want.tree_key()
                lines_are_held(new)
                continue
            if what == "clear":
                new._grow(new.max_bytes)
                continue
            if what == "edit" and chat:
                chat[at % len(chat)] = {**chat[at % len(chat)], "content": content}
            elif what == "regenerate" and chat and chat[-1]["role"] == "assistant":
                chat[-1] = {"role": "assistant", "content": content}
            elif what == "branch" and chat:
                chats[c] = chat = chat[: at % len(chat) + 1]
            if not chat or chat[-1]["role"] != "user":
                chat.append({"role": "user", "content": content})
            got, want = new.chat(chat), old.chat(chat)
            text = worker.apply_chat_template(chat, True)
            assert got.tolist() == want.tolist() == encode_prompt(worker, text)
            assert got.tree_key() == want.tree_key()
            assert got.block_keys(16) == want.block_keys(16)
            chat.append({"role": "assistant", "content": content[::-1]})
            lines_are_held(new)

    check()
