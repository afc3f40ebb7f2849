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

What is counted: `N` requests in rounds, a turn of every conversation (a first turn,
a new conversation's system prompt, among them as in the bench's rounds), and the feed's
reading and applying each round's events before the next; not the waits between (the
clock's work). The feed's reads are the test's (`own_calls` says why), so the count does
not move with the machine's speed. A change that adds work to every request fails here; raise `BUDGET` only with the reason in the commit and the
measured price in loadtests/results/router_cpu.md.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvloop
from redis.asyncio import Redis

from loadtests.load.cluster import Cluster, WorkerSpec
from loadtests.load.workloads import NATO_WORDS as WORDS
from router.http.app import create_app, serving_protocol, serving_runner
from router.http.state import FLEET, KV_FEED
from shared.config import RouterConfig
from shared.procs import free_port
from shared.serving.aio import stop_task
from shared.serving.http_server import bind
from tests.router.test_gc_cycles import _answer
from tests.router.test_request_work import own_call_counter

SESSIONS = 8  # conversations measured, each `TURNS` requests, turn by turn
TURNS = 16
N = SESSIONS * TURNS
SYSTEM_WORDS = 300  # a system prompt's words
# The router's own calls a chat makes with the tokenizer and the index: 135.2-135.4
# measured (141.5-142.7 before the thirteenth pass's cuts: the request's path ~66, as a
# plain completion's; the tokenizer ~47; the index's scoring ~18; the feed's reads and
# applying ~10.5). Runs differ by ~1, by the clock: the fleet queue's ticks and the
# fleet's reads that fall in the counted spans. So ~3.5 of margin over the highest: 5
# calls more a request fail.
BUDGET = 139
PUBLISH_S = 0.1  # the worker's KV-event writes: a round's requests fit between two
PUBLISH_ENV = "RADIX_WORKER_KV_EVENTS_INTERVAL"


@pytest.fixture(scope="module")
def fleet() -> Iterator[Cluster]:
    """A Redis-protocol server and one sim worker publishing its KV events there, every
    `PUBLISH_S` (`own_calls` says why)."""
    with Cluster() as cluster:
        spec = WorkerSpec(decode_ms=0.0, heartbeat_s=1.0, extra=("--kv-events",
                          "--log-level", "WARNING"))  # fmt: skip
        os.environ[PUBLISH_ENV] = str(PUBLISH_S)  # (the child's environment: procs.Child)
        try:
            cluster.start_worker("w0", spec)
        finally:
            del os.environ[PUBLISH_ENV]
        yield cluster


def chats(seed: int, sessions: int, turns: int) -> Iterator[bytes]:
    """Each conversation's requests, turn by turn: a system prompt of its own, a question
    a turn, and the previous turns' answers (fixed here: the worker's are its own)."""
    rng = random.Random(seed)
    convs = [[{"role": "system", "content": f"Chat {seed}.{s}. " +
               " ".join(rng.choice(WORDS) for _ in range(SYSTEM_WORDS))}]
             for s in range(sessions)]  # fmt: skip
    for turn in range(turns):
        for chat in convs:
            chat.append({"role": "user", "content": f"Turn {turn}: {rng.choice(WORDS)}?"})
            body = json.dumps({"messages": chat, "max_tokens": 4}).encode()
            yield (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            chat.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=4))})


async def _until(check: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not {what} within {timeout} s"
        await asyncio.sleep(0.02)


def _entry_id(entry: bytes | str) -> tuple[int, ...]:
    """A stream entry's id, comparable ("0": the stream's start)."""
    text = entry.decode() if isinstance(entry, bytes) else entry
    return tuple(int(part) for part in text.split("-"))


def own_calls(cluster: Cluster, seed: int) -> collections.Counter[str]:
    """Calls per function into the router's own code over `N` chats and the feed's
    applying their events."""
    calls: collections.Counter[str] = collections.Counter()
    count = own_call_counter(calls)

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
        key = feed.registry.kv_events_key("w0")
        stream = Redis.from_url(redis_url)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)

        async def last_entry() -> bytes | None:
            entries = await stream.xrevrange(key, count=1)
            return entries[0][0] if entries else None

        async def published(before: bytes | None) -> bytes | None:
            """The stream's last entry once the worker has written one after `before`
            (a round that completes no block writes none: then after 1 s)."""
            deadline = time.monotonic() + 1.0
            last = await last_entry()
            while last == before and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
                last = await last_entry()
            return last

        async def apply(last: bytes | None) -> None:
            """The feed reads the stream to `last` at least (what its task does on its
            clock)."""
            state = feed.streams["w0"]
            for _ in range(100):
                if last is None or _entry_id(state.cursor) >= _entry_id(last):
                    return
                await feed.poll()
            raise AssertionError(f"the feed did not read to {last!r}: at {state.cursor!r}")

        try:
            await _until(lambda: feed.status_of("w0") == "ok", "following the worker")
            # The feed's reads are this test's from here (below): its task stopped.
            (task,) = [t for t in asyncio.all_tasks() if t.get_name() == "kv-events"]
            feed.stop()  # as the app stops it (a cancel alone can be lost in redis-py)
            await stop_task(task)
            assert task.done()
            # Warm-up: other conversations (the pooled connection, the pieces' cache,
            # lazy imports, the index's first blocks).
            for request in chats(seed + 1, 4, 4):
                writer.write(request)
                assert await _answer(reader) == 200
            last = await published(await last_entry())
            await apply(last)
            # A round is a turn of every conversation, sent just after the worker's write
            # (`published`), so that its events come in its next write, one entry, and
            # are applied before the next round: the index as fresh as a conversation's
            # next turn finds it (seconds later), and the same events and entries each
            # run. Counted: the requests and the feed's reads, not the waits (the clock's
            # work: the feed's own timed reads, stopped above, would batch the entries
            # as the run's speed falls).
            requests = chats(seed, SESSIONS, TURNS)
            for _ in range(TURNS):
                sys.setprofile(count)
                try:
                    for request in itertools.islice(requests, SESSIONS):
                        writer.write(request)
                        assert await _answer(reader) == 200
                finally:
                    sys.setprofile(None)
                last = await published(last)
                sys.setprofile(count)
                try:
                    await apply(last)
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


@pytest.fixture(scope="module")
def plain(fleet: Cluster) -> collections.Counter[str]:
    """One run's calls, as the code stands (both tests read it)."""
    return own_calls(fleet, seed=1)


def test_a_chat_with_the_kv_index_makes_at_most_the_budgeted_own_calls(
    plain: collections.Counter[str],
) -> None:
    calls = plain
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
    fleet: Cluster, plain: collections.Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The counter sees work added to every request: the routing decision's metric
    counted six times a request is five calls more each, seen over the runs' spread
    (~1 a request)."""
    from router.metrics import Metrics

    real = Metrics.decision

    def six(self: Metrics, reason: str, now: float | None = None) -> None:
        for _ in range(6):
            real(self, reason, now)  # (this file's calls are not counted)

    monkeypatch.setattr(Metrics, "decision", six)
    more = own_calls(fleet, seed=1)
    assert sum(more.values()) - sum(plain.values()) >= 3.5 * N
