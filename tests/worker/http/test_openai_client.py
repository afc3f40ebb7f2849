"""The official `openai` client (sync and async, streaming and not) against a real
worker on loopback: the sim engine, and the radix engine on the tiny model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from shared.procs import wait_until
from tests.worker.conftest import WorkerThread, sim_config

SYSTEM = "You are a terse assistant for a radix cache test. Keep every answer short. " * 6


@pytest.fixture(scope="module", params=["sim", "radix"])
def worker(request: pytest.FixtureRequest) -> Iterator[WorkerThread]:
    if request.param == "sim":
        config = sim_config(sim_decode_ms_per_token=1.0, max_model_len=1024)
    else:
        model_dir: Path = request.getfixturevalue("tiny_model_dir")
        config = sim_config(
            engine="radix", model=str(model_dir), cache_tokens=4096, max_model_len=1024,
            device="cpu", dtype="float32",
        )  # fmt: skip
    with WorkerThread(config) as w:
        yield w


def served_model(worker: WorkerThread) -> str:
    return worker.engine.model_name


def test_sync_chat_and_completions_report_cached_tokens(worker: WorkerThread) -> None:
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)
    model = served_model(worker)
    assert [m.id for m in client.models.list().data] == [model]
    first = client.chat.completions.create(
        model=model, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first"}],
    )  # fmt: skip
    second = client.chat.completions.create(
        model=model, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "second"}],
    )  # fmt: skip
    assert first.id.startswith("chatcmpl-") and first.choices[0].message.role == "assistant"
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens > 50
    assert 1 <= second.usage.completion_tokens <= 6
    client.completions.create(model=model, prompt=SYSTEM + "head", max_tokens=4, temperature=0)
    comp = client.completions.create(
        model=model, prompt=SYSTEM + "tail", max_tokens=4, temperature=0
    )
    assert comp.id.startswith("cmpl-") and comp.usage is not None
    assert comp.usage.prompt_tokens_details is not None
    assert comp.usage.prompt_tokens_details.cached_tokens > 0
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="not-this-one", prompt="x", max_tokens=1)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="x " * 2000, max_tokens=1)
    assert bad.value.param == "prompt"


def test_sync_streaming_with_usage(worker: WorkerThread) -> None:
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)
    cached = []
    for _ in range(2):  # the second time the prompt is in the radix cache
        stream = client.chat.completions.create(
            model=served_model(worker), max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "stream please, with usage"}],
        )  # fmt: skip
        chunks = list(stream)
        usage = chunks[-1].usage
        assert usage is not None and chunks[-1].choices == []
        assert usage.prompt_tokens_details is not None
        cached.append((usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens))
        assert chunks[-2].choices[0].finish_reason in ("length", "stop")
    (_, prompt), (again, prompt_again) = cached
    assert prompt == prompt_again and 0 < again <= prompt


async def test_async_client_streaming_and_not(worker: WorkerThread) -> None:
    client = openai.AsyncOpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)
    model = served_model(worker)
    prompt = SYSTEM + "async completion"
    texts = []
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    parts, usage = [], None
    async for chunk in stream:
        parts.extend(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    texts.append("".join(parts))
    assert usage is not None and usage.prompt_tokens_details is not None
    whole = await client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0)
    texts.append(whole.choices[0].text)
    assert texts[0] == texts[1]  # greedy (radix) or seeded by the prompt (sim)
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
    assert whole.usage.prompt_tokens_details.cached_tokens > 50
    results = await asyncio.gather(*(
        client.chat.completions.create(model=model, max_tokens=3, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"q{i}"}])
        for i in range(8)
    ))  # fmt: skip
    assert all(r.usage is not None and r.usage.completion_tokens >= 1 for r in results)
    await client.close()


async def test_client_disconnect_mid_stream_frees_kv(worker: WorkerThread) -> None:
    body = {"prompt": SYSTEM + "a long answer", "max_tokens": 400, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    async with aiohttp.ClientSession() as session:
        resp = await session.post(worker.url + "/v1/completions", json=body)
        seen = 0
        async for line in resp.content:
            if line.startswith(b"data: {"):
                json.loads(line[6:])
                seen += 1
            if seen == 2:
                break
        assert worker.run(lambda: worker.engine.stats().running) == 1
        resp.close()  # the client hangs up mid-stream
    wait_until(lambda: worker.run(lambda: worker.engine.stats().running) == 0, 20)
    check_integrity(worker)
    # A non-streaming request whose client gives up is aborted too (handler_cancellation).
    body["stream"] = False
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as session:
        with pytest.raises(asyncio.TimeoutError):
            await session.post(worker.url + "/v1/completions", json={**body, "max_tokens": 700})
    wait_until(lambda: worker.run(lambda: worker.engine.stats().running) == 0, 20)
    check_integrity(worker)


def check_integrity(worker: WorkerThread) -> None:
    """Free + cached + held == every KV slot. The radix engine's step thread is idle once
    its scheduler reports nothing running, so reading its state from here is safe."""
    worker.engine.engine.check_integrity()  # type: ignore[attr-defined]
