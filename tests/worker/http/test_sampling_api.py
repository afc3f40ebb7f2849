"""The sampling surface over HTTP with the official `openai` client, on the sim engine
and the radix engine (tiny model): `n` choices, logprobs in OpenAI's two shapes,
penalties accepted, unsupported fields and bad values refused with a 400 naming the
field, and the requests around them unharmed."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.worker.conftest import WorkerThread, sim_config

MESSAGES = [{"role": "user", "content": "say something about caches"}]


@pytest.fixture(scope="module", params=["sim", "radix"])
def worker(request: pytest.FixtureRequest) -> Iterator[WorkerThread]:
    if request.param == "sim":
        config = sim_config(max_model_len=1024, max_n=4)
    else:
        model_dir: Path = request.getfixturevalue("tiny_model_dir")
        config = sim_config(
            engine="radix", model=str(model_dir), cache_tokens=4096, max_model_len=1024,
            device="cpu", dtype="float32", max_n=4,
        )  # fmt: skip
    with WorkerThread(config) as w:
        yield w


def client(worker: WorkerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)


def test_n_choices_count_the_prompt_once(worker: WorkerThread) -> None:
    one = client(worker).chat.completions.create(
        model=worker.engine.model_name, messages=MESSAGES, max_tokens=5, temperature=0
    )
    three = client(worker).chat.completions.create(
        model=worker.engine.model_name, messages=MESSAGES, max_tokens=5, n=3, temperature=0
    )
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(c.message.content == one.choices[0].message.content for c in three.choices)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    stream = client(worker).completions.create(
        model=worker.engine.model_name, prompt="tell me", max_tokens=4, n=2, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts, finished, usage = ["", ""], set(), None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
        usage = chunk.usage or usage
    assert finished == {0, 1} and texts[0] and usage is not None
    assert usage.completion_tokens == 8
    worker.engine.engine.check_integrity()


def test_logprobs_in_openai_shapes(worker: WorkerThread) -> None:
    chat = client(worker).chat.completions.create(
        model=worker.engine.model_name, messages=MESSAGES, max_tokens=4, logprobs=True,
        top_logprobs=2, temperature=0,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    for entry in content:
        assert entry.logprob <= 0 and 1 <= len(entry.top_logprobs) <= 2
        # `bytes` are the token's raw bytes (maybe part of a character: see test_formats).
        assert entry.token == bytes(entry.bytes).decode("utf-8", errors="replace")
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # the best is first
    comp = client(worker).completions.create(
        model=worker.engine.model_name, prompt="tell me", max_tokens=3, logprobs=2,
        temperature=0,
    )  # fmt: skip
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    text = comp.choices[0].text
    # Whole tokens sit at their offsets; a token that is part of a character shows as
    # U+FFFD (the exact relation, with split characters, is tested in test_formats).
    assert all(
        text[o : o + len(t)] == t
        for t, o in zip(lp.tokens, lp.text_offset, strict=True)
        if t != "\ufffd"
    )
    assert lp.text_offset[0] == 0 and all(v <= 0 for v in lp.token_logprobs)
    total = sum(math.exp(v) for v in lp.top_logprobs[0].values())
    assert total <= 1 + 1e-6


def test_penalties_and_bias_are_accepted(worker: WorkerThread) -> None:
    resp = client(worker).chat.completions.create(
        model=worker.engine.model_name, messages=MESSAGES, max_tokens=4, presence_penalty=1.0,
        frequency_penalty=0.5, logit_bias={"5": -100}, extra_body={"min_p": 0.1,
        "repetition_penalty": 1.2},
    )  # fmt: skip
    assert resp.usage.completion_tokens >= 1


def test_response_format_text_is_the_default_and_accepted(worker: WorkerThread) -> None:
    """OpenAI's default `response_format`, sent explicitly by some SDKs: plain text is
    what this worker serves, so it must not be refused like json_object is."""
    c = client(worker)
    chat = c.chat.completions.create(
        model=worker.engine.model_name, messages=MESSAGES, max_tokens=2,
        response_format={"type": "text"}, temperature=0,
    )  # fmt: skip
    plain = c.chat.completions.create(
        model=worker.engine.model_name, messages=MESSAGES, max_tokens=2, temperature=0
    )
    assert chat.choices[0].message.content == plain.choices[0].message.content
    assert chat.usage.completion_tokens == 2
    worker.engine.engine.check_integrity()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"n": 5}, "n"),  # over this worker's max_n
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"999999999": 1}}, "logit_bias"),  # outside the vocabulary
        ({"logit_bias": {"5": 150}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"service_tier": "turbo"}, "service_tier"),  # shared/wire/service_class.py
        ({"priority": "1"}, "priority"),
        ({"priority": 1.5}, "priority"),
    ],
)
def test_bad_or_unsupported_fields_are_400_naming_them(
    worker: WorkerThread, extra: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client(worker).chat.completions.create(
            model=worker.engine.model_name, messages=MESSAGES, max_tokens=2, extra_body=extra
        )
    error = err.value.body
    assert isinstance(error, dict)
    assert error["param"] == param or str(error["param"]).startswith(param + "."), error
    ok = client(worker).chat.completions.create(  # random weights: EOS may come; ignore it
        model=worker.engine.model_name, messages=MESSAGES, max_tokens=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert ok.choices[0].finish_reason == "length"
    worker.engine.engine.check_integrity()
