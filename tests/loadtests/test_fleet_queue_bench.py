"""The fleet-queue benchmark (loadtests/load/fleet_queue.py): fair shares, Jain's index,
a schedule that is the same for both routers, and its client's retries (openai-python's
rule) against a real aiohttp server over loopback."""

from __future__ import annotations

import argparse
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from loadtests.load.fleet_queue import (
    Sent,
    add_arguments,
    defaults,
    drive,
    fair_shares,
    jain,
    retry_delay,
    router_config,
    schedule,
    this_tree_sides,
)
from shared.procs import free_port


def test_fair_shares_cap_each_tenant_at_what_it_sent() -> None:
    # 3 tenants share 9: the small one gets all it sent, the rest split what is left.
    assert fair_shares({"a": 2, "b": 10, "c": 10}, 9) == {"a": 2, "b": 3.5, "c": 3.5}
    assert fair_shares({"a": 5, "b": 5}, 20) == {"a": 5, "b": 5}


def test_jain() -> None:
    assert jain([1, 1, 1, 1]) == pytest.approx(1.0)
    assert jain([1, 0, 0, 0]) == pytest.approx(0.25)


def test_the_flooder_sends_its_multiple_and_the_schedule_is_seeded() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--seconds", "200", "--tenants", "4", "--flood", "10"])
    plan = schedule(args, rate=13.0)  # a share of 1 req/s: t0 at 10, the others at 1
    counts = {t: sum(s.tenant == t for s in plan) for t in ("t0", "t1", "t2", "t3")}
    assert 1700 < counts["t0"] < 2300 and all(150 < counts[t] < 250 for t in ("t1", "t2", "t3"))
    assert [(s.at, s.prompt) for s in schedule(args, 13.0)] == [(s.at, s.prompt) for s in plan]
    assert {s.klass for s in plan} == {"interactive", "standard", "batch"}


def test_spare_seats_run_this_tree_once_per_count_in_order() -> None:
    args = defaults()
    sides = this_tree_sides(args)
    assert [(n, a.spare_seats) for n, a in sides] == [("this tree", None)]
    # Not given: the router's own default, not a value the bench picked.
    assert "queue_spare_seats" not in router_config(sides[0][1], new=True, sync=False)
    args.spare_seats_list = "1,0"
    sides = this_tree_sides(args)
    assert [n for n, _ in sides] == ["spare 1", "spare 0"]
    # Each side's router gets its own count; the namespace it came from is not changed.
    configs = [router_config(a, new=True, sync=False) for _, a in sides]
    assert [c["queue_spare_seats"] for c in configs] == [1, 0]
    assert args.spare_seats is None


def test_the_retry_delay_is_openai_pythons() -> None:
    rng = random.Random(0)
    assert retry_delay({"Retry-After": "5"}, 0, rng) == 5.0  # honoured up to 120 s
    for headers in ({}, {"Retry-After": "300"}, {"Retry-After": "soon"}, {"Retry-After": "0"}):
        assert 0.375 <= retry_delay(headers, 0, rng) <= 0.5  # 0.5 s less 0-25% jitter
    assert 0.75 <= retry_delay({}, 1, rng) <= 1.0 and 6 <= retry_delay({}, 9, rng) <= 8


Answering = Callable[[list[int]], Awaitable[tuple[str, list[int]]]]


@pytest.fixture
async def answering() -> AsyncIterator[Answering]:
    """A server answering each try with the next status of a script (then 200): 429s
    carry Retry-After 0.2, a 200 is a stream of one event."""
    runners: list[web.AppRunner] = []

    async def start(script: list[int]) -> tuple[str, list[int]]:
        seen: list[int] = []

        async def completions(request: web.Request) -> web.StreamResponse:
            await request.read()
            status = script[len(seen)] if len(seen) < len(script) else 200
            seen.append(status)
            if status != 200:
                return web.json_response({}, status=status, headers={"Retry-After": "0.2"})
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(b'data: {"choices": []}\n\n')
            return response

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        runners.append(runner)
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}", seen

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_the_client_retries_a_429_after_its_retry_after(answering: Answering) -> None:
    url, seen = await answering([429, 429])
    plan = [Sent(0.0, "t0", "batch", "hello")]
    await drive([url], plan, classes=True, drain_s=30, retries=2)
    [s] = plan
    assert seen == [429, 429, 200] and (s.status, s.tries, s.answered_429) == (200, 3, 2)
    # TTFT runs from the first try's send: both waits of Retry-After (0.2 s) are in it.
    assert s.ttft is not None and s.ttft >= 0.4


async def test_the_client_gives_up_after_its_retries_and_never_retries_a_400(
    answering: Answering,
) -> None:
    url, seen = await answering([429, 429, 429, 429])
    plan = [Sent(0.0, "t0", "batch", "hello")]
    await drive([url], plan, classes=True, drain_s=30, retries=2)
    assert (plan[0].status, plan[0].tries, plan[0].ttft, len(seen)) == (429, 3, None, 3)
    url, seen = await answering([429])
    plan = [Sent(0.0, "t0", "batch", "hello")]
    await drive([url], plan, classes=True, drain_s=30, retries=0)  # the old open-loop drop
    assert (plan[0].status, plan[0].tries, seen) == (429, 1, [429])
    url, seen = await answering([400, 503])
    plan = [Sent(0.0, "t0", "batch", "hello")]
    await drive([url], plan, classes=True, drain_s=30, retries=2)
    assert (plan[0].status, plan[0].tries, seen) == (400, 1, [400])
    url, seen = await answering([503])
    plan = [Sent(0.0, "t0", "batch", "hello")]
    await drive([url], plan, classes=True, drain_s=30, retries=2)
    # A 503 is retried as the SDK does, and still counted: no 503 from load is allowed.
    assert (plan[0].status, plan[0].answered_503, seen) == (200, 1, [503, 200])
