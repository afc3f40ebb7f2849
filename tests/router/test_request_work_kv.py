"""A tokenized chat's work with the KV-event index: the router's own Python calls a
request, within a budget (issue 34).

tests/router/test_request_work.py holds the plain completion's calls; this holds the
router's most expensive configuration (`tokenizer` + `kv_events`, the `on` router of
`python -m loadtests router-tokens`): each chat rendered and tokenized, scored against
the index, and the worker's KV events of it read and applied. As there, a count is what
is held, not a time: each call into the project's own code (router/, shared/; a coroutine
or generator counts once more each time it resumes) while a real router app on uvloop
serves multi-turn chats over loopback. Its parts are real: a Redis-protocol server, the
sim worker in its own process publishing its KV events there (its cache and evictions
make the stream), the router discovering it, following its stream and applying it.

What is counted: `N` requests (new conversations among them, as the bench's rounds
start theirs), then the feed until it has applied the worker's stream to its last entry,
so a request's events count wherever the feed's batching falls. A change that adds work
to every request fails here; raise `BUDGET` only with the reason in the commit and the
measured price in loadtests/results/router_cpu.md.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import uvloop
from redis.asyncio import Redis

from loadtests.load.cluster import Cluster, WorkerSpec
from router.http.app import create_app, serving_protocol, serving_runner
from router.http.state import FLEET, KV_FEED
from shared.config import RouterConfig
from shared.procs import free_port
from shared.serving.http_server import bind
from tests.router.test_gc_cycles import _answer

SESSIONS = 8  # conversations measured, each `TURNS` requests, turn by turn
TURNS = 20
N = SESSIONS * TURNS
WORDS = 300  # a system prompt's words (~900 sim tokens)
# The router's own calls a chat makes with the tokenizer and the index: 143.8-145.8
# measured (the request's path ~67, as a plain completion's; the tokenizer ~52; the
# index's scoring ~19; the feed ~7). Runs differ by up to ~2: how fresh the index is when a turn arrives (the
# feed reads every 0.2 s) decides whether its scoring runs whole; the fleet queue's
# ticks are timed, not a request's. So 4 of margin over the highest.
BUDGET = 150
ROOT = Path(__file__).resolve().parents[2]
OWN = (str(ROOT / "router") + "/", str(ROOT / "shared") + "/")
NATO = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


@pytest.fixture(scope="module")
def fleet() -> Iterator[Cluster]:
    """A Redis-protocol server and one sim worker publishing its KV events there."""
    with Cluster() as cluster:
        spec = WorkerSpec(decode_ms=0.0, heartbeat_s=1.0, extra=("--kv-events",
                          "--log-level", "WARNING"))  # fmt: skip
        cluster.start_worker("w0", spec)
        yield cluster


def chats(seed: int, sessions: int, turns: int) -> Iterator[bytes]:
    """Each conversation's requests, turn by turn: a system prompt of its own, a question
    a turn, and the previous turns' answers (fixed here: the worker's are its own)."""
    rng = random.Random(seed)
    convs = [[{"role": "system", "content": f"Chat {seed}.{s}. " +
               " ".join(rng.choice(NATO) for _ in range(WORDS))}]
             for s in range(sessions)]  # fmt: skip
    for turn in range(turns):
        for chat in convs:
            chat.append({"role": "user", "content": f"Turn {turn}: {rng.choice(NATO)}?"})
            body = json.dumps({"messages": chat, "max_tokens": 4}).encode()
            yield (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            chat.append({"role": "assistant", "content": " ".join(rng.choices(NATO, k=4))})


async def _until(check: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not {what} within {timeout} s"
        await asyncio.sleep(0.02)


def own_calls(cluster: Cluster, seed: int) -> collections.Counter[str]:
    """Calls per function into the router's own code over `N` chats (and the feed's
    applying their events)."""
    calls: collections.Counter[str] = collections.Counter()

    def count(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(OWN):
                calls[f"{code.co_filename[len(str(ROOT)) + 1 :]}:{code.co_name}"] += 1

    assert cluster.redis is not None
    redis_url = cluster.redis.url
    cluster.flush()  # every run meets an empty cache: the same events

    async def scenario() -> None:
        config = RouterConfig(redis_url=redis_url, tokenizer="sim", kv_events=True,
                              host="127.0.0.1", access_log=False)  # fmt: skip
        app = create_app(config)
        runner = await serving_runner(app)  # as `serve()` serves it
        port = free_port()
        await bind(runner, "127.0.0.1", port, header_read_timeout=10,
                   protocol=serving_protocol(runner, config))  # fmt: skip
        feed = app[KV_FEED]
        stream = Redis.from_url(redis_url)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)

        async def applied() -> None:
            """Until the feed has read the worker's stream to its last entry."""
            await asyncio.sleep(0.1)  # the worker publishes every 50 ms
            last = (await stream.xrevrange(feed.registry.kv_events_key("w0"), count=1))[0][0]
            state = feed.streams["w0"]
            await _until(lambda: state.cursor == last, "applied")

        try:
            await _until(lambda: feed.status_of("w0") == "ok", "following the worker")
            # Warm-up: other conversations (the pooled connection, the pieces' cache,
            # lazy imports, the index's first blocks).
            for request in chats(seed + 1, 4, 4):
                writer.write(request)
                assert await _answer(reader) == 200
            await applied()
            requests = list(chats(seed, SESSIONS, TURNS))
            sys.setprofile(count)
            try:
                for request in requests:
                    writer.write(request)
                    assert await _answer(reader) == 200
                await applied()
            finally:
                sys.setprofile(None)
            assert feed.status_of("w0") == "ok"
            assert len(app[FLEET].workers) == 1
        finally:
            writer.close()
            await stream.aclose()
            await runner.cleanup()

    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
    return calls


def test_a_chat_with_the_kv_index_makes_at_most_the_budgeted_own_calls(fleet: Cluster) -> None:
    calls = own_calls(fleet, seed=1)
    per_request = sum(calls.values()) / N
    top = ", ".join(f"{name} {n / N:.1f}" for name, n in calls.most_common(16))
    # The counter saw each part: the tokenizer's, the index's scoring and the feed's.
    for part in ("prompt_tokens.py:chat", "merge.py:correct", "kv_index.py:_stored"):
        assert any(name.endswith(part) for name in calls), f"no {part}: {top}"
    assert per_request <= BUDGET, (
        f"a chat with the tokenizer and the KV index makes {per_request:.1f} calls into the "
        f"router's own code, over the budget of {BUDGET}; the most called: {top}"
    )


def test_the_counter_sees_work_added_to_every_chat(
    fleet: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard can fail: the routing decision's metric counted six times a request is
    five calls more each, over the runs' spread (the index's freshness when each turn
    arrives moves its scoring's calls: ~1.7 a request between runs)."""
    from router.metrics import Metrics

    plain = own_calls(fleet, seed=1)
    real = Metrics.decision

    def six(self: Metrics, reason: str, now: float | None = None) -> None:
        for _ in range(6):
            real(self, reason, now)  # (this file's calls are not counted)

    monkeypatch.setattr(Metrics, "decision", six)
    more = own_calls(fleet, seed=1)
    assert sum(more.values()) - sum(plain.values()) >= 3 * N
