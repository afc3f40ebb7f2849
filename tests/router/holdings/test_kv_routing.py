"""Routing on what workers report: prompts warmed by sending them straight to one worker
(not through the router, so its tree never saw them) are then routed to that worker, and
a prefix a worker moved to its host tier counts there, below a device copy elsewhere.
Real sim workers publishing KV events, a real Redis-protocol server, the real router app
with `kv_events` and the sim tokenizer; the official openai client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

from router.http.state import FLEET, KV_FEED, TOKENS
from shared.config import RouterConfig
from shared.redis_server import RedisServer, free_port
from tests.fuzz.conftest import start_router, worker_config
from worker.backends import build_engine
from worker.http.app import create_app


def create_worker(config):
    return create_app(config, build_engine(config))


SYSTEM = "You answer questions about the warehouse inventory, briefly and exactly. "


def chat(i: int, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"Team {i}. " + SYSTEM * 12},
            {"role": "user", "content": question}]  # fmt: skip


@contextlib.asynccontextmanager
async def kv_fleet(
    redis_url: str, policy: str, **worker_kw: object
) -> AsyncIterator[tuple[TestServer, list[openai.AsyncOpenAI], openai.AsyncOpenAI]]:
    """Two sim workers publishing KV events and the router reading them: the router,
    a client straight to each worker, and one through the router."""
    workers: list[TestServer] = []
    router = None
    try:
        for i in range(2):
            port = free_port()
            app = create_worker(worker_config(
                redis_url=redis_url, worker_id=f"w{i}", kv_events=True, kv_events_interval=0.02,
                heartbeat_interval=0.3, port=port, advertise_url=f"http://127.0.0.1:{port}",
                **worker_kw,
            ))  # fmt: skip
            server = TestServer(app, host="127.0.0.1", port=port)
            await server.start_server()
            workers.append(server)
        router = await start_router(RouterConfig(
            host="127.0.0.1", redis_url=redis_url, discovery_interval=0.1, policy=policy,
            kv_events=True, tokenizer="sim", access_log=False,
        ))  # fmt: skip
        direct = [
            openai.AsyncOpenAI(base_url=str(w.make_url("/v1")), api_key="x", max_retries=0)
            for w in workers
        ]
        url = str(router.make_url("/v1"))
        yield router, direct, openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
    finally:
        if router is not None:
            await router.close()
        for w in workers:
            await w.close()


@pytest.mark.parametrize("policy", ["cache_aware", "cost_aware"])
async def test_a_prompt_warmed_on_a_worker_routes_there(
    redis_server: RedisServer, policy: str
) -> None:
    async with kv_fleet(redis_server.url, policy) as (router, direct, client):
        for _ in range(100):
            models = await client.models.list()
            if models.data and len(router.app[FLEET].workers) == 2:
                break
            await asyncio.sleep(0.05)
        feed = router.app[KV_FEED]
        warmed = {i: f"w{i % 2}" for i in range(4)}
        for i, wid in warmed.items():
            await direct[int(wid[1])].chat.completions.create(
                model="sim", messages=chat(i, "How many boxes?"), max_tokens=2
            )
        tokens = router.app[TOKENS]

        def indexed() -> bool:  # every warmed prompt's blocks, on the worker that holds them
            return all(feed.trusted(w) for w in ("w0", "w1")) and all(
                feed.match("sim", tokens.chat(chat(i, "How many boxes?"))).get(wid, 0) > 0
                for i, wid in warmed.items()
            )

        for _ in range(200):  # (a count of blocks let the last prompt's events lag: flaky)
            if indexed():
                break
            await asyncio.sleep(0.05)
        for i, wid in warmed.items():
            raw = await client.chat.completions.with_raw_response.create(
                model="sim", messages=chat(i, "And how many pallets?"), max_tokens=2
            )
            assert raw.headers["x-radix-worker"] == wid, (i, raw.headers["x-radix-route-reason"])
            usage = raw.parse().usage
            assert usage.prompt_tokens_details.cached_tokens > 0.8 * usage.prompt_tokens
        async with aiohttp.ClientSession() as http:  # the status, where operators look
            async with http.get(router.make_url("/workers")) as r:
                listed = {w["worker_id"]: w["kv_events"] for w in (await r.json())["data"]}
            async with http.get(router.make_url("/metrics")) as r:
                metrics = await r.text()
        assert listed == {"w0": "ok", "w1": "ok"}
        assert 'radix_router_kv_events_status{status="ok",worker="w0"} 1.0' in metrics


async def _wait(check, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(300):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("policy", ["cache_aware", "cost_aware"])
async def test_a_prefix_demoted_to_the_host_tier_still_routes_to_its_holder(
    redis_server: RedisServer, policy: str
) -> None:
    """Workers with a small device pool and a host tier. Prompt A is warmed on w0 only,
    prompt B on both; then other prompts sent straight to w0 push A and B off its device
    to its host tier (KV events: stored CPU, removed GPU). Through the router, A goes to
    w0 (its only holder, loading it back: a host hit, not a prefill) and B to w1 (a device
    copy beats a host copy)."""
    async with kv_fleet(
        redis_server.url, policy,
        cache_tokens=1200, host_cache_tokens=20_000, max_model_len=1200,
    ) as (router, direct, client):  # fmt: skip
        await _wait(lambda: len(router.app[FLEET].workers) == 2, "the fleet")
        feed, tokens = router.app[KV_FEED], router.app[TOKENS]

        async def send(worker: int, i: int) -> None:
            await direct[worker].chat.completions.create(
                model="sim", messages=chat(i, "How many boxes?"), max_tokens=2
            )

        await send(0, 1)  # A on w0
        await send(0, 2)  # B on w0 ...
        await send(1, 2)  # ... and on w1
        for i in range(10, 14):  # others through w0's device pool: A and B go to its host
            await send(0, i)
        a_ids = tokens.chat(chat(1, "How many boxes?"))
        b_ids = tokens.chat(chat(2, "How many boxes?"))

        def demoted() -> bool:
            a, b = feed.match_tiers("sim", a_ids), feed.match_tiers("sim", b_ids)
            return (
                all(feed.trusted(w) for w in ("w0", "w1"))
                and "w0" in a and a["w0"][0] < a["w0"][1] > 0.8 * len(a_ids)
                and "w0" in b and b["w0"][0] < b["w0"][1]
                and "w1" in b and b["w1"][0] == b["w1"][1] > 0.8 * len(b_ids)
            )  # fmt: skip

        await _wait(demoted, "A and B on w0's host tier, B on w1's device")
        for i, holder in ((1, "w0"), (2, "w1")):
            raw = await client.chat.completions.with_raw_response.create(
                model="sim", messages=chat(i, "And how many pallets?"), max_tokens=2
            )
            assert raw.headers["x-radix-worker"] == holder, (i, raw.headers)
            usage = raw.parse().usage
            assert usage.prompt_tokens_details.cached_tokens > 0.8 * usage.prompt_tokens
