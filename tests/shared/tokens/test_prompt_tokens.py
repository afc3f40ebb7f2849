"""The router's prompt tokens are the worker's: the same ids for chats and prompts, on the
project's tiny Llama / Qwen2 / Qwen3 models and the sim tokenizer, turn after turn (where
the pieces of earlier turns come from the cache)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.tokens.prompt_tokens import PromptTokens, encode_prompt, load_tokenizer

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)


@pytest.fixture(params=["sim", "tiny", "qwen2", "qwen3"])
def setting(request, tiny_model_dir: Path, tiny_qwen2_dir: Path, tiny_qwen3_dir: Path) -> str:
    dirs = {"sim": "sim", "tiny": tiny_model_dir, "qwen2": tiny_qwen2_dir, "qwen3": tiny_qwen3_dir}
    return str(dirs[request.param])


def test_conversations_tokenize_as_the_worker_does(setting: str) -> None:
    router = PromptTokens.load(setting)
    worker = load_tokenizer(setting)  # the worker's path: render, then encode_prompt
    messages = [{"role": "system", "content": "Be brief. " * 30}]

    @settings(max_examples=40, deadline=None)
    @given(turns=st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=4))
    def check(turns: list[tuple[str, str]]) -> None:
        chat = list(messages)
        for user, answer in turns:
            chat.append({"role": "user", "content": user})
            text = worker.apply_chat_template(chat, True)
            assert router.chat(chat).tolist() == encode_prompt(worker, text)
            assert router.text(user + answer).tolist() == encode_prompt(worker, user + answer)
            chat.append({"role": "assistant", "content": answer})

    check()
    assert router.piecewise  # every tokenizer the project ships splits at its tags
    assert router.hits > router.misses  # earlier turns' pieces were not re-encoded


class _CountingRuns(dict):
    """The trie's dict, counting the look-ups a prompt's walk makes."""

    gets = 0

    def get(self, key, default=None):  # type: ignore[no-untyped-def,override]
        self.gets += 1
        return super().get(key, default)


def _chat(turns: int, system: str = "Be brief. ") -> list[dict[str, str]]:
    chat = [{"role": "system", "content": system * 30}]
    for t in range(turns):
        chat += [{"role": "user", "content": f"Question {t}?"},
                 {"role": "assistant", "content": f"Answer {t}."}]  # fmt: skip
    return chat


def test_a_next_turn_steps_the_trie_only_for_the_pieces_it_adds() -> None:
    """A conversation's next turn takes its previous turn's runs by one text comparison
    (`PromptTokens._pieced`): the trie is looked up for its first new piece only (the
    answer: not in it, so neither are the question and the generation prompt after it,
    `_extend`), and the runs are the very ones the steps would find."""
    tokens = PromptTokens.load("sim")
    tokens._runs = counting = _CountingRuns()
    chat = _chat(20)
    tokens.chat(chat[:-1])  # turn 20 asked: 41 pieces stepped
    counting.gets = 0
    ids = tokens.chat([*chat, {"role": "user", "content": "And then?"}])
    assert counting.gets == 1
    fresh = PromptTokens.load("sim")
    again = fresh.chat([*chat, {"role": "user", "content": "And then?"}])
    assert ids.tolist() == again.tolist() and ids.tree_key() == again.tree_key()
    assert ids.block_keys(16) == again.block_keys(16)
    walked = [tokens._runs[(run.parent, run.piece if run.parent else ("", run.piece))]
              for run in ids.runs[:-1]]  # fmt: skip
    assert walked == list(ids.runs[:-1])  # the trie's own runs, not copies


def test_an_edited_or_branching_turn_is_tokenized_as_a_fresh_prompt_is() -> None:
    """A prompt that repeats its line's first piece but not the rest (an edited turn,
    another chat on the same system prompt, a shorter one) takes no runs it does not
    share: its ids and keys are a fresh tokenizer's."""
    tokens, worker = PromptTokens.load("sim"), load_tokenizer("sim")
    chat = _chat(6)
    tokens.chat(chat)
    edited = [dict(m) for m in chat]
    edited[3]["content"] = "Answer 1, edited."
    for prompt in (edited, chat[:3], [*_chat(2), {"role": "user", "content": "Other?"}], chat):
        ids = tokens.chat(prompt)
        expected = encode_prompt(worker, worker.apply_chat_template(prompt, True))
        assert ids.tolist() == expected
        assert ids.block_keys(16) == PromptTokens.load("sim").chat(prompt).block_keys(16)


def test_lines_go_with_the_caches_and_hold_no_run_the_trie_does_not() -> None:
    """The lines hold runs of the trie only: they are emptied when a bound clears the
    caches, and a prompt with a piece too large to keep leaves no line (it would hold
    memory the byte bound does not count)."""
    tokens = PromptTokens.load("sim")
    tokens.chat(_chat(3))
    assert tokens._lines
    tokens._grow(tokens.max_bytes)  # over the byte bound: everything goes
    assert not tokens._lines and not tokens._runs
    small = PromptTokens(load_tokenizer("sim"), max_bytes=256 * 1024)  # a piece: <= 16 KB
    small.chat([{"role": "system", "content": "word " * 2000}, {"role": "user", "content": "Hi?"}])
    assert not small._lines  # the system piece was encoded, not kept
    assert small.chat(_chat(1))  # and a prompt that fits is lined again
    assert small._lines


@pytest.mark.parametrize("model", ["sim", "qwen2"])
def test_chats_on_one_system_prompt_keep_lines_of_their_own(
    model: str, tiny_qwen2_dir: Path
) -> None:
    """Conversations that share a system prompt (and, on Qwen's template, the head every
    chat starts with) are told apart by their first question: turn after turn,
    interleaved, each next turn looks the trie up only for the first piece it adds."""
    setting = "sim" if model == "sim" else str(tiny_qwen2_dir)
    tokens = PromptTokens.load(setting)
    tokens._runs = counting = _CountingRuns(tokens._runs)
    chats = [[*_chat(0), {"role": "user", "content": f"First question {c}?"}] for c in range(3)]
    for turn in range(4):
        for c, chat in enumerate(chats):
            counting.gets = 0
            ids = tokens.chat(chat)
            if turn >= 2:  # (turn 1 renames the line: its key's third piece is new)
                assert counting.gets == 1, (turn, c)
            assert ids.tolist() == PromptTokens.load(setting).chat(chat).tolist()
            chat += [{"role": "assistant", "content": f"Answer {turn}."},
                     {"role": "user", "content": f"Next {turn}?"}]  # fmt: skip


# A template that renders a chat's last message its own way and adds a system prompt
# where the chat has none: an earlier turn's last message is a different piece later.
LAST_DIFFERENT = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nDefault.<|im_end|>\n{% endif %}{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{% if loop.last %} (last){% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Contents of any characters, empty ones, and long ones (encoded past BATCH_CHARS).
CONTENT = st.one_of(TEXT, st.just(""), TEXT.map(lambda t: (t + " words ") * 40))


@pytest.mark.parametrize("template", ["tiny", "last-different"])
def test_chats_tokenize_as_transformers_does(
    template: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The router's ids for a chat, turn after turn from its caches, are transformers'
    (its own render and encoding, the worker's BOS rule: an independent oracle), on
    random conversations with and without a system prompt."""
    transformers = pytest.importorskip("transformers")
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model_dir)
    if template == "last-different":
        cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
        cfg["chat_template"] = LAST_DIFFERENT
        (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    router = PromptTokens.load(str(model_dir))
    assert router.piecewise

    def expected(chat: list[dict[str, str]]) -> list[int]:
        text = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ids = theirs.encode(text)
        return ids[1:] if ids[:2] == [theirs.bos_token_id] * 2 else ids

    @settings(max_examples=40, deadline=None)
    @given(
        system=st.one_of(st.none(), CONTENT),
        turns=st.lists(st.tuples(CONTENT, CONTENT), min_size=1, max_size=4),
    )
    def check(system: str | None, turns: list[tuple[str, str]]) -> None:
        chat = [] if system is None else [{"role": "system", "content": system}]
        for user, answer in turns:
            chat.append({"role": "user", "content": user})
            assert router.chat(chat).tolist() == expected(chat)
            chat.append({"role": "assistant", "content": answer})

    check()
