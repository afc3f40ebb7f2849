"""The vLLM backend, for real: vLLM's CPU build on the tiny model, the same client test.

Runs only where vllm is installed (`.ci/vllm-tests` makes that virtualenv); skipped
cleanly elsewhere. One engine per module: vLLM takes tens of seconds to start.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from shared.procs import wait_until  # noqa: E402
from tests.worker.conftest import WorkerThread, sim_config  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
SYSTEM = "You are a terse assistant for a prefix cache test. Keep every answer short. " * 8


@pytest.fixture(scope="module")
def vllm_worker(tiny_model_dir: Path) -> Iterator[WorkerThread]:
    config = sim_config(
        engine="vllm", model=str(tiny_model_dir), max_model_len=1024, max_running_requests=8,
        device="cpu", worker_id="vllm-test",
    )  # fmt: skip
    with WorkerThread(config) as worker:
        assert worker.app is not None
        yield worker


def test_openai_client_and_cached_tokens(vllm_worker: WorkerThread) -> None:
    client = openai.OpenAI(base_url=vllm_worker.url + "/v1", api_key="unused", max_retries=0)
    model = vllm_worker.engine.model_name
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "one"}]
    first = client.chat.completions.create(
        model=model, messages=messages, max_tokens=5, temperature=0
    )
    messages[1]["content"] = "two"
    second = client.chat.completions.create(
        model=model, messages=messages, max_tokens=5, temperature=0
    )
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    comp = client.completions.create(model=model, prompt=SYSTEM, max_tokens=4, temperature=0)
    again = client.completions.create(model=model, prompt=SYSTEM, max_tokens=4, temperature=0)
    assert comp.choices[0].text == again.choices[0].text  # greedy
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details is not None
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_flush_cache_resets_prefix_cache(vllm_worker: WorkerThread) -> None:
    client = openai.OpenAI(base_url=vllm_worker.url + "/v1", api_key="unused", max_retries=0)
    model = vllm_worker.engine.model_name
    prompt = SYSTEM + "flush me"
    client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    flush = urllib.request.Request(vllm_worker.url + "/flush_cache", method="POST")
    with urllib.request.urlopen(flush, timeout=30) as resp:
        assert resp.status == 200
    after = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert after.usage is not None and after.usage.prompt_tokens_details is not None
    assert after.usage.prompt_tokens_details.cached_tokens == 0


async def test_disconnect_aborts(vllm_worker: WorkerThread) -> None:
    body = {"prompt": SYSTEM, "max_tokens": 500, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(vllm_worker.url + "/v1/completions", json=body)
        seen = 0
        async for line in resp.content:
            seen += line.startswith(b"data: {")
            if seen == 2:
                break
        assert vllm_worker.run(lambda: vllm_worker.engine.stats().running) == 1
        resp.close()
    wait_until(lambda: vllm_worker.run(lambda: vllm_worker.engine.stats().running) == 0, 20)
    llm = vllm_worker.engine._llm  # type: ignore[attr-defined]
    wait_until(lambda: llm.get_num_unfinished_requests() == 0, 20)
    await asyncio.sleep(0)
