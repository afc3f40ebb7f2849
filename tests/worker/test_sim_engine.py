"""The sim engine: real RadixCache + SlotAllocator under a cost model."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.waiting import wait_until
from worker.backends.sim import SimConfig, SimEngine
from worker.backends.text_tokenizer import TextTokenizer
from worker.engine.types import (
    EngineError,
    EngineOverloaded,
    GenerateOutput,
    GenerateRequest,
    SamplingParams,
)

LONG = "You are a helpful assistant. Answer briefly and precisely, citing sources. " * 8


def engine(**kw: object) -> SimEngine:
    return SimEngine(SimConfig(**kw), TextTokenizer())  # type: ignore[arg-type]


def req(rid: str, prompt: str, max_tokens: int = 8, **params: object) -> GenerateRequest:
    return GenerateRequest(
        rid, prompt=prompt, params=SamplingParams(max_tokens=max_tokens, **params)
    )  # type: ignore[arg-type]


async def run(eng: SimEngine, r: GenerateRequest) -> tuple[str, GenerateOutput]:
    text, last = "", None
    async for out in eng.generate(r):
        text += out.text_delta
        last = out
    assert last is not None and last.finished
    return text, last


async def test_output_is_deterministic_and_exactly_max_tokens() -> None:
    eng = engine()
    a, out_a = await run(eng, req("a", "hello there", 13))
    b, out_b = await run(eng, req("b", "hello there", 13))
    c, _ = await run(eng, req("c", "something else", 13))
    assert a == b and a != c
    assert out_a.completion_tokens == 13 and out_a.finish_reason == "length"
    assert out_b.completion_tokens == 13
    eng.check_integrity()


async def test_shared_prefix_is_cached_and_counted() -> None:
    eng = engine()
    _, first = await run(eng, req("1", LONG + "question one"))
    _, second = await run(eng, req("2", LONG + "question two"))
    assert first.cached_tokens == 0
    n_long = len(TextTokenizer().encode(LONG))
    assert n_long - 2 <= second.cached_tokens < second.prompt_tokens
    stats = eng.stats()
    assert stats.cached_tokens_total == second.cached_tokens
    assert stats.prompt_tokens_total == first.prompt_tokens + second.prompt_tokens
    assert stats.completion_tokens_total == 16 and stats.running == 0
    eng.check_integrity()


async def test_eviction_is_real_lru() -> None:
    eng = engine(cache_tokens=600, evict_batch_tokens=16)
    prompts = [f"document {i}: " + f"fact{i} " * 40 for i in range(8)]
    for i, p in enumerate(prompts):
        await run(eng, req(f"r{i}", p, 4))
        eng.check_integrity()
        assert eng.stats().cache_used_tokens <= 600
    _, recent = await run(eng, req("again-last", prompts[-1], 4))
    _, old = await run(eng, req("again-first", prompts[0], 4))
    assert recent.cached_tokens > 0  # still in the tree
    assert old.cached_tokens <= 3  # evicted long ago: only "document " may be shared
    eng.check_integrity()


async def test_queue_beyond_max_running_and_overload() -> None:
    eng = engine(max_running_requests=2, max_waiting_requests=3, decode_ms_per_token=2.0)
    tasks = [asyncio.create_task(run(eng, req(f"q{i}", f"prompt {i}", 30))) for i in range(5)]
    await wait_until(lambda: (eng.stats().running, eng.stats().waiting) == (2, 3), every=0.005)
    assert (eng.stats().running, eng.stats().waiting) == (2, 3)
    with pytest.raises(EngineOverloaded):
        eng.generate(req("too-many", "x"))
    outs = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert all(o.completion_tokens == 30 for _, o in outs)
    assert eng.stats().running == 0 and eng.stats().waiting == 0
    eng.check_integrity()


async def test_closing_the_stream_aborts_and_frees() -> None:
    eng = engine(decode_ms_per_token=1.0, max_running_requests=1)
    stream = eng.generate(req("long", LONG, 500))
    waiting = eng.generate(req("queued", LONG + "x", 5))
    wait_task = asyncio.create_task(run(eng, req("queued2", "other", 5)))
    async with contextlib.aclosing(stream) as it:  # type: ignore[type-var]
        await anext(it)
        assert eng.stats().running == 1
        await eng.abort("queued2")  # aborted while waiting
        _, out = await asyncio.wait_for(wait_task, 5)
        assert out.finish_reason == "abort"
    assert eng.stats().running == 0
    used_by_tree = eng.cache.total_size
    assert eng.stats().cache_used_tokens == used_by_tree  # nothing held by a request
    eng.check_integrity()
    _, out = await run(eng, req("again", LONG, 5))  # the aborted prompt was cached
    assert out.cached_tokens > 0
    del waiting  # never started: holds nothing
    eng.check_integrity()


async def test_abort_by_id_ends_a_running_stream() -> None:
    eng = engine(decode_ms_per_token=1.0)

    async def abort_soon() -> None:
        await asyncio.sleep(0.02)
        await eng.abort("x")

    task = asyncio.create_task(abort_soon())
    _, out = await run(eng, req("x", "abc", 10_000))
    await task
    assert out.finish_reason == "abort" and out.completion_tokens < 10_000
    eng.check_integrity()


async def test_stop_string_and_stop_token() -> None:
    eng = engine()
    full, _ = await run(eng, req("f", "seed text", 40))
    word = full.split()[3]
    cut, out = await run(eng, req("s", "seed text", 40, stop=(word,)))
    assert out.finish_reason == "stop" and word not in cut and full.startswith(cut)
    ids = [t async for o in eng.generate(req("ids", "seed text", 40)) for t in o.token_ids]
    _, out = await run(eng, req("t", "seed text", 40, stop_token_ids=(ids[5],)))
    assert out.finish_reason == "stop" and out.completion_tokens == ids.index(ids[5]) + 1


async def test_bad_requests_raise_engine_errors() -> None:
    eng = engine(max_model_len=64)
    with pytest.raises(EngineError) as e:
        eng.generate(req("long", "word " * 100))
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    with pytest.raises(EngineError) as e:
        eng.generate(req("mt", "hi", 100))
    assert e.value.param == "max_tokens"
    with pytest.raises(EngineError):
        eng.generate(GenerateRequest("ids", prompt_token_ids=(-1,)))


async def test_zero_cost_still_yields_to_the_loop() -> None:
    eng = engine()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await run(eng, req("z", "hello", 50))
    task.cancel()
    assert ticks >= 50


@settings(max_examples=200, deadline=None)
@given(st.text(), st.text())
def test_text_tokenizer_round_trips_and_splits_at_tags(a: str, b: str) -> None:
    tok = TextTokenizer()
    assert tok.decode(tok.encode(a)) == a
    detok = tok.detokenizer()
    assert "".join(detok.push(i) for i in tok.encode(a)) == a
    # Tags and punctuation are tokens of their own: a chat turn re-tokenizes to an
    # extension of the previous turn.
    assert tok.encode(a + "<|end|>" + b)[: len(tok.encode(a + "<"))] == tok.encode(a + "<")
