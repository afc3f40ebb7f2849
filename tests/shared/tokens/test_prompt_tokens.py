"""The router's prompt tokens are the worker's: the same ids for chats and prompts, on the
project's tiny Llama / Qwen2 / Qwen3 models and the sim tokenizer, turn after turn (where
the pieces of earlier turns come from the cache)."""

from __future__ import annotations

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
