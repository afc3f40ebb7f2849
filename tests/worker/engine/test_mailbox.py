"""Engine outputs on their way to the event loop: one hand-over per step, a mailbox per
request, and the outputs a stream finds waiting together merged per choice
(worker/engine/mailbox.py), on the sim engine's real step thread."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.worker.backends.test_sim_engine import LONG, engine, req
from worker.engine.mailbox import Mailbox, coalesce, split
from worker.engine.types import GenerateOutput, TokenLogprob

pytestmark = pytest.mark.timeout(60)


def out(index: int, text: str, k: int, finish: str | None = None) -> GenerateOutput:
    """The k-th output (1-based) of choice `index`: one token, its logprob."""
    return GenerateOutput(
        "r", text, (100 * index + k,), 7, 3, k, finish is not None, finish,  # type: ignore[arg-type]
        index, (TokenLogprob(100 * index + k, -0.1 * k),), 0.25,
    )  # fmt: skip


def test_coalesce_joins_each_choice_and_keeps_the_last_counts() -> None:
    parts = [out(0, "Hel", 1), out(1, "A", 1), out(0, "lo", 2), out(1, "B", 2, "length")]
    merged = coalesce(parts)
    assert [(m.index, m.text_delta, m.token_ids) for m in merged] == [
        (0, "Hello", (1, 2)),
        (1, "AB", (101, 102)),
    ]
    zero, one = merged
    assert (zero.completion_tokens, zero.finished, zero.finish_reason) == (2, False, None)
    assert (one.completion_tokens, one.finished, one.finish_reason) == (2, True, "length")
    assert [lp.token_id for lp in one.logprobs] == [101, 102]
    assert (one.prompt_tokens, one.cached_tokens, one.queue_seconds) == (7, 3, 0.25)
    single = [out(0, "x", 1)]
    assert coalesce(single) is single and coalesce([]) == []


def test_split_stops_at_the_first_error() -> None:
    error = RuntimeError("step failed")
    assert split([out(0, "a", 1), error, out(0, "b", 2)]) == ([out(0, "a", 1)], error)
    assert split([out(0, "a", 1)]) == ([out(0, "a", 1)], None)


async def test_mailbox_take_waits_for_the_first_and_returns_all() -> None:
    box = Mailbox(asyncio.get_running_loop())
    taker = asyncio.create_task(box.take())
    await asyncio.sleep(0)
    assert not taker.done()
    box.put(out(0, "a", 1))
    box.put(out(0, "b", 2))  # both arrive before the taker runs again
    assert [o.text_delta for o in await taker] == ["a", "b"]  # type: ignore[union-attr]
    box.put(out(0, "c", 3))
    assert [o.text_delta for o in await box.take()] == ["c"]  # type: ignore[union-attr]


async def collect(stream: object, block_s: float) -> list[GenerateOutput]:
    """Every output; after the first, the event loop is blocked for `block_s` so the step
    thread runs ahead and the rest of the answer waits in the mailbox."""
    outs = []
    async for o in stream:  # type: ignore[attr-defined]
        if not outs:
            time.sleep(block_s)  # blocking the loop is the point
        outs.append(o)
    return outs


def assemble(outs: list[GenerateOutput], n: int) -> list[tuple[str, tuple[int, ...], int, str]]:
    """What a client builds per choice: text, token ids, completion tokens, finish."""
    result = []
    for i in range(n):
        mine = [o for o in outs if o.index == i]
        assert [o.finished for o in mine] == [False] * (len(mine) - 1) + [True]
        last = mine[-1]
        ids = tuple(t for o in mine for t in o.token_ids)
        result.append(("".join(o.text_delta for o in mine), ids, last.completion_tokens, last.finish_reason))  # type: ignore[arg-type]  # fmt: skip
    return result


@pytest.mark.parametrize("n", [1, 3])
async def test_outputs_waiting_together_merge_into_the_same_answer(n: int) -> None:
    async with engine() as eng:
        one_by_one = await collect(eng.generate(req("a", LONG, 60, n=n, temperature=0)), 0)
        piled = await collect(eng.generate(req("b", LONG, 60, n=n, temperature=0)), 0.3)
    # The step thread finished the answer while the loop slept: it arrives in one piece
    # per choice, and the assembled answer equals the one taken step by step.
    assert len(piled) <= 2 * n < 60 * n
    assert assemble(piled, n) == assemble(one_by_one, n)
    assert assemble(piled, n)[0][2] == 60 and assemble(piled, n)[0][3] == "length"


async def test_logprobs_requests_keep_one_output_per_step() -> None:
    async with engine() as eng:
        outs = await collect(eng.generate(req("lp", LONG, 20, logprobs=True)), 0.3)
    assert len(outs) == 20 and all(len(o.token_ids) == len(o.logprobs) == 1 for o in outs)


async def test_stop_string_cut_is_the_same_when_merged() -> None:
    async with engine() as eng:
        full = await collect(eng.generate(req("f", LONG, 40, temperature=0)), 0)
        word = "".join(o.text_delta for o in full).split()[5]
        cut = [
            await collect(eng.generate(req(f"s{k}", LONG, 40, stop=(word,))), block)
            for k, block in enumerate((0, 0.3))
        ]
    assert assemble(cut[1], 1) == assemble(cut[0], 1)
    assert cut[1][-1].finish_reason == "stop" and word not in assemble(cut[1], 1)[0][0]
