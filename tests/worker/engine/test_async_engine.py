"""AsyncEngine: the step loop in its own thread behind the `Engine` protocol."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from worker.engine.async_engine import AsyncEngine
from worker.engine.config import EngineConfig
from worker.engine.runtime.load import load_engine
from worker.engine.types import (
    Engine,
    EngineError,
    EngineOverloaded,
    EngineRequest,
    GenerateOutput,
    SamplingParams,
)

pytestmark = pytest.mark.timeout(120)

CONFIG = EngineConfig(kv_capacity_tokens=4096, device="cpu")


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(load_engine(tiny_model_dir, CONFIG), "tiny")
    await eng.start()
    yield eng
    await eng.stop()


def ids(seed: int, n: int = 30) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(4, 1000) for _ in range(n))


def greedy(rid: str, prompt: tuple[int, ...], max_tokens: int = 8) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return EngineRequest(rid, prompt_token_ids=prompt, params=params)


async def collect(it: AsyncIterator[GenerateOutput]) -> list[GenerateOutput]:
    return [o async for o in it]


async def wait_idle(eng: AsyncEngine) -> None:
    for _ in range(500):
        s = eng.stats()
        if s.running == 0 and s.waiting == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("engine did not go idle")


async def test_satisfies_the_engine_protocol(engine: AsyncEngine, tiny_model_dir: Path) -> None:
    as_protocol: Engine = engine
    assert as_protocol.model_name == "tiny"
    assert engine.max_model_len == 2048
    assert engine.tokenize("the cat sees a dog") == engine.engine.encode_prompt(
        "the cat sees a dog"
    )
    chat = engine.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.endswith("<|im_start|>assistant\n")
    # The template's BOS is not doubled when the rendered chat is encoded again.
    assert engine.engine.encode_prompt(chat).count(engine.engine.tokenizer.bos_token_id) == 1


async def test_concurrent_requests_match_the_sync_engine(
    engine: AsyncEngine, tiny_model_dir: Path
) -> None:
    requests = [greedy(f"r{i}", ids(i), max_tokens=6 + i) for i in range(5)]
    results = await asyncio.gather(*(collect(engine.generate(r)) for r in requests))

    sync = load_engine(tiny_model_dir, CONFIG)
    for r, outs in zip(requests, results, strict=True):
        sync.add_request(r)
        want: list[int] = []
        while sync.has_work:
            want += [t for o in sync.step() for t in o.token_ids]
        assert [t for o in outs for t in o.token_ids] == want
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].completion_tokens == r.params.max_tokens
        assert outs[-1].prompt_tokens == len(r.prompt_token_ids or ())


async def test_closing_the_stream_aborts_and_frees_the_kv(engine: AsyncEngine) -> None:
    stream = engine.generate(greedy("long", ids(10, 200), max_tokens=1000))
    seen = [await anext(stream) for _ in range(3)]
    assert not seen[-1].finished and engine.stats().kv_used_tokens > 200
    await stream.aclose()
    await wait_idle(engine)
    assert await engine.flush_cache() is True
    assert engine.stats().kv_used_tokens == 0
    engine.engine.check_integrity()  # the step thread sleeps: nothing runs concurrently


async def test_cancelled_consumer_aborts(engine: AsyncEngine) -> None:
    async def consume() -> None:
        async for _ in engine.generate(greedy("c", ids(11), max_tokens=1000)):
            pass

    task = asyncio.create_task(consume())
    for _ in range(500):
        if engine.stats().running:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(engine)
    # The same id is free again.
    outs = await collect(engine.generate(greedy("c", ids(11), max_tokens=2)))
    assert outs[-1].finish_reason == "length"


async def test_explicit_abort_ends_the_stream(engine: AsyncEngine) -> None:
    stream = engine.generate(greedy("a", ids(12), max_tokens=1000))
    first = await anext(stream)
    await engine.abort("a")
    rest = await collect(stream)
    assert not first.finished and rest[-1].finished and rest[-1].finish_reason == "abort"


async def test_seeded_sampling_is_reproducible(engine: AsyncEngine) -> None:
    def sampled(rid: str, seed: int) -> EngineRequest:
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
        return EngineRequest(rid, prompt_token_ids=ids(13), params=params)

    noise = [greedy(f"n{i}", ids(20 + i)) for i in range(3)]
    first, *_ = await asyncio.gather(
        collect(engine.generate(sampled("a", 7))), *map(collect, map(engine.generate, noise))
    )
    again = await collect(engine.generate(sampled("b", 7)))
    other = await collect(engine.generate(sampled("c", 8)))

    def toks(outs: list[GenerateOutput]) -> list[int]:
        return [t for o in outs for t in o.token_ids]

    assert toks(first) == toks(again)
    assert toks(first) != toks(other)


async def test_stop_string_over_the_async_path(engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompt = "my friend answers many questions on Monday."
    full = "".join(
        o.text_delta
        for o in await collect(engine.generate(EngineRequest("f", prompt=prompt, params=params)))
    )
    stop = full[5:8]
    stopped = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=(stop,))
    outs = await collect(engine.generate(EngineRequest("s", prompt=prompt, params=stopped)))
    assert "".join(o.text_delta for o in outs) == full[: full.index(stop)]
    assert outs[-1].finish_reason == "stop"


async def test_bad_request_raises_at_submit_and_good_one_completes(engine: AsyncEngine) -> None:
    good = asyncio.create_task(collect(engine.generate(greedy("good", ids(14), max_tokens=10))))
    with pytest.raises(EngineError) as err:
        engine.generate(EngineRequest("bad", prompt="hi", params=SamplingParams(top_p=2.0)))
    assert err.value.param == "top_p"
    with pytest.raises(EngineError):
        engine.generate(EngineRequest("bad2", prompt_token_ids=(1, 5000)))
    outs = await good
    assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 10


async def test_stop_ends_open_streams_and_refuses_new_ones(tiny_model_dir: Path) -> None:
    eng = AsyncEngine(load_engine(tiny_model_dir, CONFIG), "tiny")
    with pytest.raises(EngineOverloaded):
        eng.generate(greedy("early", ids(1)))
    await eng.start()
    stream = eng.generate(greedy("x", ids(15), max_tokens=1000))
    await anext(stream)
    await eng.stop()
    rest = await collect(stream)
    assert rest[-1].finish_reason == "abort"
    with pytest.raises(EngineOverloaded):
        eng.generate(greedy("late", ids(1)))


async def test_failing_step_fails_requests_in_flight_and_the_loop_survives(
    engine: AsyncEngine,
) -> None:
    runner = engine.engine.runner

    def device_lost(batch: object) -> None:
        raise RuntimeError("device lost")

    runner.forward = device_lost  # fault injection on this instance only
    with pytest.raises(RuntimeError, match="engine step failed"):
        await collect(engine.generate(greedy("x", ids(16))))
    del runner.forward  # back to the real method
    outs = await collect(engine.generate(greedy("y", ids(16))))
    assert outs[-1].finish_reason == "length"
    await wait_idle(engine)
    await engine.flush_cache()
    assert engine.stats().kv_used_tokens == 0


async def test_overload_is_refused_with_engine_overloaded(tiny_model_dir: Path) -> None:
    small = EngineConfig(
        kv_capacity_tokens=4096, device="cpu", max_running_requests=1, max_waiting_requests=1
    )
    eng = AsyncEngine(load_engine(tiny_model_dir, small), "tiny")
    await eng.start()
    running = eng.generate(greedy("s0", ids(30), max_tokens=1000))
    queued = eng.generate(greedy("s1", ids(31), max_tokens=1000))
    try:
        assert not (await anext(running)).finished
        waiter = asyncio.create_task(anext(queued))  # submits s1; it waits behind s0
        await asyncio.sleep(0.05)
        with pytest.raises(EngineOverloaded):
            eng.generate(greedy("third", ids(40)))
        assert eng.stats().running == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter  # cancelling the consumer aborted s1
    finally:
        await running.aclose()
        await queued.aclose()
        await eng.stop()
