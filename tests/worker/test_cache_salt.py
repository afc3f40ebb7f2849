"""Cache namespaces in our engine (issue 30): vLLM's `cache_salt` keeps a prompt's cached
blocks apart per salt, and the KV events say so in vLLM's form (`extra_keys` of the first
block). A real worker (the sim engine: the same scheduler and radix cache as the model
backend) over loopback, a real Redis-protocol server, the official openai client."""

from __future__ import annotations

import asyncio

import openai
import pytest
from redis.asyncio import Redis

from shared.redis_server import RedisServer
from shared.wire.kv_events import BlockStored, parse_entry
from shared.wire.registry import Registry
from tests.fuzz.conftest import start_worker, worker_config
from worker.engine.salt import salt_tag, salted, tag_of

PROMPT = "The quarterly inventory report lists every pallet in aisle seven. " * 8


async def cached(api: openai.AsyncOpenAI, salt: str | None) -> int:
    extra = {"cache_salt": salt} if salt is not None else None
    answer = await api.completions.create(
        model="sim", prompt=PROMPT, max_tokens=1, extra_body=extra
    )
    return answer.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]


async def test_a_salted_prompt_shares_blocks_only_with_its_own_salt(
    redis_server: RedisServer, redis: Redis
) -> None:
    worker = await start_worker(worker_config(
        redis_url=redis_server.url, worker_id="salty", kv_events=True, kv_events_interval=0.02,
        kv_events_block_size=4, heartbeat_interval=0.2,
    ))  # fmt: skip
    api = openai.AsyncOpenAI(base_url=str(worker.make_url("/v1")), api_key="x", max_retries=0)
    try:
        assert await cached(api, "tenant-a") == 0
        assert await cached(api, "tenant-a") > 0  # the same salt: its blocks
        assert await cached(api, "tenant-b") == 0  # another salt: none of them
        assert await cached(api, None) == 0  # no salt: none either
        assert await cached(api, None) > 0
        assert await cached(api, "tenant-b") > 0

        with pytest.raises(openai.BadRequestError) as empty:  # vLLM: non-empty if given
            await cached(api, "")
        assert "cache_salt" in str(empty.value)

        async def first_blocks() -> dict[object, BlockStored]:
            """The first block of each namespace's path, by its extra keys."""
            entries = await redis.xrange(Registry(redis).kv_events_key("salty"))
            firsts = {}
            for _, fields in entries:
                for e in parse_entry("salty", fields).batch.events:
                    if isinstance(e, BlockStored) and e.parent_block_hash is None:
                        firsts[e.extra_keys[0] if e.extra_keys else None] = e
            return firsts

        firsts: dict[object, BlockStored] = {}
        for _ in range(200):  # the publisher writes every 20 ms
            firsts = await first_blocks()
            if len(firsts) == 3:
                break
            await asyncio.sleep(0.02)
        assert set(firsts) == {("tenant-a",), ("tenant-b",), None}  # vLLM's form
        # The real token ids in each, the same prompt; the hashes differ per salt.
        ids = {tuple(e.token_ids[:4]) for e in firsts.values()}
        assert len(ids) == 1 and max(next(iter(ids))) < 2**31
        assert len({e.block_hashes[0] for e in firsts.values()}) == 3
        assert all(k is None for e in firsts.values() for k in (e.extra_keys or (None,))[1:])
    finally:
        await worker.close()


async def test_a_model_the_worker_does_not_serve_is_refused(redis_server: RedisServer) -> None:
    """A LoRA adapter's name is a model name (vLLM serves adapters as models): one this
    worker does not serve is refused as vLLM refuses it (404 NotFound, `model`), never
    answered by the base model, whose blocks are not the adapter's."""
    worker = await start_worker(worker_config())
    api = openai.AsyncOpenAI(base_url=str(worker.make_url("/v1")), api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.NotFoundError) as refused:
            await api.completions.create(model="sim-lora-sql", prompt="hi", max_tokens=1)
        assert "sim-lora-sql" in str(refused.value)
    finally:
        await worker.close()


def test_salted_keys_never_meet_unsalted_or_other_salts() -> None:
    ids = [5, 6, 7, 8]
    a, b = salt_tag("a"), salt_tag("b")
    assert salted(ids, None).tolist() == ids
    ka, kb = salted(ids, a), salted(ids, b)
    assert ka[0] != kb[0] and ka[0] != 5 and ka[1] != 6 and ka[2:].tolist() == [7, 8]
    assert salted(ids, a).tolist() == ka.tolist()  # the same salt: the same key
    assert tag_of(ka) == a and tag_of(salted(ids, None)) is None
    assert (ka & (2**31 - 1)).tolist() == ids
