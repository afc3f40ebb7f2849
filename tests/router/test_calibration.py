"""Chars per token learned from the workers' answers where the router has no tokenizer."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from loadtests.load.cluster import Cluster, WorkerSpec
from router.fleet.calibration import HIGH, calibrate, chars_per_token, prompt_tokens_from
from router.fleet.workers import Breaker, Worker
from router.http.app import create_app
from router.http.state import FLEET, POLICY
from shared.config import RouterConfig
from shared.tokens.text_tokenizer import TextTokenizer
from shared.wire.registry import WorkerRecord
from tests.waiting import wait_until


def _worker() -> Worker:
    return Worker(
        "w", "http://w", "static", Breaker(3, 1.0), WorkerRecord("w", "", "sim", "sim", 0.0)
    )


def test_prompt_tokens_read_from_the_usage_not_the_details() -> None:
    body = b'{"x":"\\"prompt_tokens\\": 9","usage":{"prompt_tokens":42,"prompt_tokens_details":{"cached_tokens":7}}}'
    assert prompt_tokens_from(body) == 42
    tail = b'data: {"choices":[]}\n\ndata: {"usage":{"prompt_tokens": 17}}\n\ndata: [DONE]\n\n'
    assert prompt_tokens_from(tail) == 17
    assert prompt_tokens_from(b'{"usage":{}}') is None


def test_first_sample_replaces_the_default_then_an_ewma() -> None:
    w = _worker()
    assert chars_per_token(w, 4.0) == 4.0
    assert calibrate(w, 200, 100)
    assert chars_per_token(w, 4.0) == 2.0
    assert calibrate(w, 300, 100)
    assert chars_per_token(w, 4.0) == pytest.approx(2.2)
    assert not calibrate(w, 10, 5)  # too short to tell: ignored, not counted
    assert w.calibration_rejected_total == 0


@pytest.mark.parametrize("tokens", [0, -5, 1.5, 1e9, 2])  # 2 tokens for 200 chars: 100/token
def test_implausible_counts_are_ignored_and_counted(tokens: float) -> None:
    w = _worker()
    assert calibrate(w, 200, 100)
    assert not calibrate(w, 200, tokens)
    assert (w.chars_per_token, w.calibration_rejected_total) == (2.0, 1)
    assert HIGH < 200 / 2  # the last case is out of bounds, not just odd


@pytest.fixture(scope="module")
def fleet() -> Iterator[Cluster]:
    spec = WorkerSpec(decode_ms=0.0, cache_tokens=20_000, extra=("--log-level", "WARNING"))
    with Cluster() as f:
        f.start_worker("sim-0", spec)
        yield f


@pytest.mark.slow
async def test_sim_worker_calibrates_and_predictions_follow(fleet: Cluster) -> None:
    """The sim tokenizer splits at punctuation: "a1, b2, " is ~1.3 chars a token, far from
    the default 4. The router learns it from the answers, and its predicted cached tokens
    for a conversation's next turn then match what the worker reports."""
    assert fleet.redis is not None
    config = RouterConfig(redis_url=fleet.redis.url, discovery_interval=0.1, host="127.0.0.1")
    server = TestServer(create_app(config), host="127.0.0.1")
    await server.start_server()
    try:
        await wait_until(lambda: len(server.app[FLEET].workers) == 1, timeout=10)
        worker = server.app[FLEET].workers["sim-0"]
        history = "".join(f"x{i}, y{i}; " for i in range(150))
        true_ratio = len(history) / len(TextTokenizer().encode(history))
        assert true_ratio < 0.5 * config.tree_chars_per_token
        errors_default, errors_learned = [], []
        async with aiohttp.ClientSession() as http:
            for turn in range(8):
                history += f"turn {turn}: q{turn}, a{turn}. "
                async with http.post(
                    server.make_url("/v1/completions"),
                    json={"model": "sim", "prompt": history, "max_tokens": 1},
                ) as resp:
                    assert resp.status == 200
                    usage = (await resp.json())["usage"]
                    matched = int(resp.headers["x-radix-matched-chars"])
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                if turn and cached:
                    errors_default.append(abs(matched / config.tree_chars_per_token / cached - 1))
                    learned = chars_per_token(worker, config.tree_chars_per_token)
                    errors_learned.append(abs(matched / learned / cached - 1))
        assert worker.chars_per_token == pytest.approx(true_ratio, rel=0.1)
        assert worker.calibration_rejected_total == 0
        assert len(errors_learned) >= 6
        assert max(errors_learned) < 0.15 < 0.5 < min(errors_default)
        async with (  # where operators look
            aiohttp.ClientSession() as http,
            http.get(server.make_url("/workers")) as r,
        ):
            row = next(w for w in (await r.json())["data"] if w["worker_id"] == "sim-0")
        assert row["chars_per_token"] == worker.chars_per_token
        assert row["calibration_rejected_total"] == 0
        ratio = worker.predicted_tokens_total / worker.actual_cached_tokens_total
        assert abs(ratio - 1) < 0.15  # the dashboard's predicted / actual
        policy = server.app[POLICY]
        assert policy._chars_per_token["sim-0"] == pytest.approx(true_ratio, rel=0.1)
        assert policy._tree._cap["sim-0"] == int(20_000 * policy._chars_per_token["sim-0"])
    finally:
        await server.close()
