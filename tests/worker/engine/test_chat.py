"""Prompt handling (worker/engine/chat.py, the engine's own checks) and
`Req.to_output`, through the real sim engine and the real model tokenizer."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from shared.tokens.text_tokenizer import VOCAB_SIZE, TextTokenizer
from shared.tokens.tokenizer import Tokenizer
from worker.backends import build_sim_async_engine
from worker.engine.async_engine import AsyncEngine
from worker.engine.chat import render_chat
from worker.engine.config import EngineConfig
from worker.engine.req import Req
from worker.engine.types import EngineError, EngineRequest, SamplingParams


def sim(tokenizer: TextTokenizer | Tokenizer | None = None) -> AsyncEngine:
    return build_sim_async_engine(
        EngineConfig(kv_capacity_tokens=10_000), tokenizer or TextTokenizer()
    )


def prompt_ids(eng: AsyncEngine, request: EngineRequest) -> list[int]:
    return eng.engine.make_reqs(request)[0].prompt_ids


def test_prompt_ids_encode_text_and_pass_ids_through() -> None:
    eng = sim()
    want = eng.engine.tokenizer.encode("hello world")
    assert prompt_ids(eng, EngineRequest("a", prompt="hello world")) == want
    ids = (5, 0, VOCAB_SIZE - 1)
    assert prompt_ids(eng, EngineRequest("b", prompt_token_ids=ids)) == list(ids)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (EngineRequest("a", prompt_token_ids=(1, VOCAB_SIZE)), f"[0, {VOCAB_SIZE})"),
        (EngineRequest("b", prompt_token_ids=(-1,)), "token id -1 in prompt is outside"),
        (EngineRequest("c", prompt_token_ids=()), "prompt is empty"),
        (EngineRequest("d", prompt=""), "prompt is empty"),
    ],
)
def test_bad_prompts_are_engine_errors_on_prompt(request_: EngineRequest, message: str) -> None:
    with pytest.raises(EngineError, match=re.escape(message)) as info:
        prompt_ids(sim(), request_)
    assert info.value.param == "prompt"


def test_tokenize_and_chat_template_use_the_engine_tokenizer(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_model_dir)
    eng = sim(tok)
    messages = [{"role": "user", "content": "hi there"}]
    assert eng.apply_chat_template(messages) == tok.apply_chat_template(messages)
    assert eng.tokenize("the cat sees a dog") == tok.encode("the cat sees a dog")


def test_template_errors_become_engine_errors_on_messages(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model_dir)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(model_dir)
    for call in (
        lambda: render_chat(tok, [{"role": "user", "content": "hi"}]),
        lambda: sim(tok).apply_chat_template([{"role": "user", "content": "hi"}]),
    ):
        with pytest.raises(EngineError, match="no chat template") as info:
            call()
        assert info.value.param == "messages"


def test_to_output_takes_what_is_unsent_once() -> None:
    tok = TextTokenizer()
    prompt = tok.encode("a prompt")
    answer = tok.encode(" one two", add_special_tokens=False)
    req = Req("r", prompt, SamplingParams(max_tokens=len(answer)), tok.detokenizer(), seq_id=1)
    req.cached_tokens = 1
    for t in answer:
        req.append_token(t, max_model_len=1000)
    out = req.to_output()
    assert (out.request_id, out.text_delta, out.token_ids) == ("r", " one two", tuple(answer))
    assert (out.prompt_tokens, out.cached_tokens, out.completion_tokens) == (
        len(prompt),
        1,
        len(answer),
    )
    assert out.finished and out.finish_reason == "length"
    again = req.to_output()  # deltas were taken: nothing new, counts unchanged
    assert (again.text_delta, again.token_ids, again.completion_tokens) == ("", (), len(answer))
