"""The official openai client through the router to real sim workers, with a real Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

from loadtests.load.cluster import Cluster, WorkerSpec
from router.http.app import create_app
from router.http.state import FLEET, POLICY
from shared.config import RouterConfig
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet() -> Iterator[Cluster]:
    """Redis and two zero-cost sim worker processes; the router runs in process."""
    spec = WorkerSpec(decode_ms=0.0, cache_tokens=20_000, extra=("--log-level", "WARNING"))
    with Cluster() as f:
        for i in range(2):
            f.start_worker(f"sim-{i}", spec)
        yield f


@pytest.fixture
async def router(fleet: Cluster) -> AsyncIterator[TestServer]:
    assert fleet.redis is not None
    config = RouterConfig(redis_url=fleet.redis.url, discovery_interval=0.1, host="127.0.0.1")
    server = TestServer(create_app(config), host="127.0.0.1", handler_cancellation=True)
    await server.start_server()
    await wait_until(lambda: len(server.app[FLEET].workers) == len(fleet.workers), timeout=10)
    yield server
    await server.close()


def client_for(server: TestServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0, timeout=30
    )


async def test_chat_completions_streaming_and_models(router: TestServer) -> None:
    client = client_for(router)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["sim"]
    chat = await client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "hi there"}], max_tokens=5
    )
    assert chat.choices[0].message.content and chat.usage and chat.usage.completion_tokens == 5
    comp = await client.completions.create(model="sim", prompt="once upon a time", max_tokens=4)
    assert comp.choices[0].text and comp.usage and comp.usage.prompt_tokens_details is not None
    stream = await client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "stream me"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    pieces, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
    assert "".join(pieces) and usage is not None and usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="sim", messages=[], max_tokens=5)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="x", max_tokens=1)


async def test_shared_prefix_lands_on_one_worker_with_cached_tokens(router: TestServer) -> None:
    client = client_for(router)
    system = "You are a meticulous assistant. " * 60  # ~2,000 chars shared by every request
    workers, cached = set(), []
    for i in range(6):
        raw = await client.chat.completions.with_raw_response.create(
            model="sim", max_tokens=2,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"question {i}?"}],
        )  # fmt: skip
        workers.add(raw.headers["x-radix-worker"])
        reason = raw.headers["x-radix-route-reason"]
        completion = raw.parse()
        assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
        cached.append(completion.usage.prompt_tokens_details.cached_tokens or 0)
        if i:
            assert reason == "cache_hit" and int(raw.headers["x-radix-matched-chars"]) > len(system)
    assert len(workers) == 1
    assert all(c > 0 for c in cached[1:]), cached
    wid = workers.pop()
    assert router.app[FLEET].workers[wid].actual_cached_tokens_total == sum(cached)


async def test_imbalance_sends_to_the_least_loaded(router: TestServer) -> None:
    client = client_for(router)
    prefix = "shared document " * 100
    raw = await client.completions.with_raw_response.create(
        model="sim", prompt=prefix + "a", max_tokens=1
    )
    home = raw.headers["x-radix-worker"]
    fleet = router.app[FLEET]
    other = next(w for w in fleet.workers if w != home)
    # Pretend 100 requests are in flight to `home` (beyond both balance thresholds).
    guards = [fleet.attempt(fleet.workers[home], 0.0) for _ in range(100)]
    try:
        raw = await client.completions.with_raw_response.create(
            model="sim", prompt=prefix + "b", max_tokens=1
        )
        assert (
            raw.headers["x-radix-worker"] == other
            and raw.headers["x-radix-route-reason"] == "balance"
        )
    finally:
        for guard in guards:
            guard.release()
    raw = await client.completions.with_raw_response.create(
        model="sim", prompt=prefix + "c", max_tokens=1
    )
    assert raw.headers["x-radix-route-reason"] == "cache_hit"
    assert router.app[POLICY].worker_stats()[other]["tree_chars"] > 0


async def test_generate_and_worker_table(router: TestServer) -> None:
    async with aiohttp.ClientSession() as http:
        body = {"text": "the native endpoint " * 20, "sampling_params": {"max_new_tokens": 3}}
        async with http.post(router.make_url("/generate"), json=body) as r:
            assert r.status == 200, await r.text()
            assert r.headers["x-radix-worker"] in router.app[FLEET].workers
        async with http.get(router.make_url("/workers")) as r:
            workers = (await r.json())["data"]
    assert {w["worker_id"] for w in workers} == {"sim-0", "sim-1"}
    assert all(w["engine"] == "sim" and w["epoch"] > 0 and w["source"] == "redis" for w in workers)
    assert all(w["in_flight"] == 0 and w["breaker"] == "closed" for w in workers)
