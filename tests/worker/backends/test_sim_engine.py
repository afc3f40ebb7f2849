"""The sim backend: the engine's own scheduler, radix cache and allocator over a cost
model (worker/backends/sim.py), started as the live worker runs it."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.tokens.text_tokenizer import TextTokenizer
from tests.waiting import wait_until
from worker.backends import build_sim_async_engine
from worker.engine.async_engine import AsyncEngine
from worker.engine.config import EngineConfig
from worker.engine.types import (
    EngineError,
    EngineOverloaded,
    EngineRequest,
    GenerateOutput,
    SamplingParams,
)

pytestmark = pytest.mark.timeout(60)

LONG = "You are a helpful assistant. Answer briefly and precisely, citing sources. " * 8


@contextlib.asynccontextmanager
async def engine(decode_ms: float = 0.0, **cfg: object) -> AsyncIterator[AsyncEngine]:
    cfg.setdefault("kv_capacity_tokens", 1_000_000)
    max_model_len = int(cfg.pop("max_model_len", 32_768))  # type: ignore[call-overload]
    eng = build_sim_async_engine(
        EngineConfig(**cfg),  # type: ignore[arg-type]
        TextTokenizer(),
        max_model_len=max_model_len,
        decode_ms_per_token=decode_ms,
    )
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


def req(rid: str, prompt: str, max_tokens: int = 8, **params: object) -> EngineRequest:
    return EngineRequest(rid, prompt=prompt, params=SamplingParams(max_tokens=max_tokens, **params))  # type: ignore[arg-type]


async def run(eng: AsyncEngine, r: EngineRequest) -> tuple[str, GenerateOutput]:
    text, last = "", None
    async for out in eng.generate(r):
        text += out.text_delta
        last = out
    assert last is not None and last.finished
    return text, last


def test_the_sim_path_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from shared.config import WorkerConfig\n"
        "from worker.backends import build_engine\n"
        "build_engine(WorkerConfig(engine='sim'))\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_output_is_deterministic_and_exactly_max_tokens() -> None:
    async with engine() as eng:
        a, out_a = await run(eng, req("a", "hello there", 13))
        b, out_b = await run(eng, req("b", "hello there", 13))
        c, _ = await run(eng, req("c", "something else", 13))
        assert a == b and a != c
        assert out_a.completion_tokens == 13 and out_a.finish_reason == "length"
        assert out_b.completion_tokens == 13
        eng.engine.check_integrity()


async def test_shared_prefix_is_cached_and_counted() -> None:
    async with engine() as eng:
        _, first = await run(eng, req("1", LONG + "question one"))
        _, second = await run(eng, req("2", LONG + "question two"))
        assert first.cached_tokens == 0
        n_long = len(TextTokenizer().encode(LONG))
        assert n_long - 2 <= second.cached_tokens < second.prompt_tokens
        stats = eng.stats()
        assert stats.cached_tokens_total == second.cached_tokens
        assert stats.prompt_tokens_total == first.prompt_tokens + second.prompt_tokens
        assert stats.completion_tokens_total == 16 and stats.running == 0
        eng.engine.check_integrity()


async def test_eviction_is_real_lru() -> None:
    async with engine(kv_capacity_tokens=600, evict_batch_tokens=16) as eng:
        prompts = [f"document {i}: " + f"fact{i} " * 40 for i in range(8)]
        for i, p in enumerate(prompts):
            await run(eng, req(f"r{i}", p, 4))
            eng.engine.check_integrity()
            assert eng.stats().kv_used_tokens <= 600
        _, recent = await run(eng, req("again-last", prompts[-1], 4))
        _, old = await run(eng, req("again-first", prompts[0], 4))
        assert recent.cached_tokens > 0  # still in the tree
        assert old.cached_tokens <= 3  # evicted long ago: only "document " may be shared
        eng.engine.check_integrity()


async def test_queue_beyond_max_running_and_overload() -> None:
    async with engine(decode_ms=2.0, max_running_requests=2, max_waiting_requests=3) as eng:
        tasks = [asyncio.create_task(run(eng, req(f"q{i}", f"prompt {i}", 30))) for i in range(5)]
        await wait_until(lambda: (eng.stats().running, eng.stats().waiting) == (2, 3), every=0.005)
        assert (eng.stats().running, eng.stats().waiting) == (2, 3)
        with pytest.raises(EngineOverloaded):
            eng.generate(req("too-many", "x"))
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert all(o.completion_tokens == 30 for _, o in outs)
        assert eng.stats().running == 0 and eng.stats().waiting == 0
        eng.engine.check_integrity()


async def test_closing_the_stream_aborts_and_frees() -> None:
    async with engine(decode_ms=1.0, max_running_requests=1) as eng:
        stream = eng.generate(req("long", LONG, 500))
        wait_task = asyncio.create_task(run(eng, req("queued2", "other", 5)))
        async with contextlib.aclosing(stream) as it:  # type: ignore[type-var]
            await anext(it)
            assert eng.stats().running == 1
            await eng.abort("queued2")  # aborted while waiting
            _, out = await asyncio.wait_for(wait_task, 5)
            assert out.finish_reason == "abort"
        await wait_until(lambda: eng.stats().running == 0)
        assert eng.stats().kv_used_tokens == eng.engine.cache.total_size  # none held
        eng.engine.check_integrity()
        _, out = await run(eng, req("again", LONG, 5))  # the aborted prompt was cached
        assert out.cached_tokens > 0
        eng.engine.check_integrity()


async def test_stop_string_and_stop_token() -> None:
    async with engine() as eng:
        full, _ = await run(eng, req("f", "seed text", 40))
        word = full.split()[3]
        cut, out = await run(eng, req("s", "seed text", 40, stop=(word,)))
        assert out.finish_reason == "stop" and word not in cut and full.startswith(cut)
        ids = [t async for o in eng.generate(req("ids", "seed text", 40)) for t in o.token_ids]
        _, out = await run(eng, req("t", "seed text", 40, stop_token_ids=(ids[5],)))
        assert out.finish_reason == "stop" and out.completion_tokens == ids.index(ids[5]) + 1


async def test_bad_requests_raise_engine_errors() -> None:
    async with engine(max_model_len=64) as eng:
        with pytest.raises(EngineError) as e:
            eng.generate(req("long", "word " * 100))
        assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
        with pytest.raises(EngineError) as e:
            eng.generate(req("mt", "hi", 100))
        assert e.value.param == "max_tokens"
        with pytest.raises(EngineError):
            eng.generate(EngineRequest("ids", prompt_token_ids=(-1,)))


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
