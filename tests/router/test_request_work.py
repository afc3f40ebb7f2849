"""The simplest request's work: the router's own Python calls a request, within a budget
(issue 34).

A proxy that decides nothing, in callbacks on uvloop, costs about 0.013 ms of CPU a
request on this project's machine (`python -m loadtests router-wrk --floor`: two loopback
round trips and httptools); the router costs ~10x that, and nearly all of the difference
is its own Python: how many calls a request makes, not any one slow call
(loadtests/results/router_cpu.md). So the count is what this guards, and a count, unlike
a time, is the same on every machine: each call into the project's own code
(router/, shared/; a coroutine counts once more each time it resumes) while a real
router app on uvloop serves `N` plain completions over loopback from a real zero-cost
worker (loadtests/router/zero_worker.py, in its own process). A change that adds work to
every request fails here; raise `BUDGET` only with the reason in the commit and the
measured price in router_cpu.md.
"""

from __future__ import annotations

import asyncio
import collections
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import uvloop

from loadtests.load.cluster import serve
from loadtests.router import zero_worker
from router.http.app import create_app, serving_protocol, serving_runner
from shared.config import RouterConfig
from shared.procs import free_port
from shared.serving.http_server import bind
from tests.router.test_gc_cycles import COMPLETION, _answer

N = 300
BUDGET = 70  # the router's own calls a plain completion makes: 66.4 measured (was 161, 102, 78)
ROOT = Path(__file__).resolve().parents[2]
OWN = (str(ROOT / "router") + "/", str(ROOT / "shared") + "/")


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs, port = Path(tmp_path_factory.mktemp("zero")), free_port()
    child = serve("zero", [zero_worker.__name__, str(port)], port, logs)
    try:
        yield child.url
    finally:
        child.stop()


def own_call_counter(
    calls: collections.Counter[str],
) -> Callable[[FrameType, str, Any], None]:
    """A `sys.setprofile` function counting into `calls` each call into the router's own
    code (router/, shared/), by file and function: a coroutine once more each time it
    resumes."""

    def count(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(OWN):
                calls[f"{code.co_filename[len(str(ROOT)) + 1 :]}:{code.co_name}"] += 1

    return count


def _own_calls(worker_url: str, fast: bool) -> tuple[int, collections.Counter[str]]:
    """(the last status, calls per function into the router's own code over `N` requests)."""
    calls: collections.Counter[str] = collections.Counter()
    count = own_call_counter(calls)

    async def scenario() -> int:
        config = RouterConfig(
            worker_urls=(worker_url,), host="127.0.0.1", access_log=False, fast_hot_paths=fast
        )
        runner = await serving_runner(create_app(config))  # as `serve()` serves it
        port = free_port()
        await bind(runner, "127.0.0.1", port, header_read_timeout=10,
                   protocol=serving_protocol(runner, config))  # fmt: skip
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for i in range(20):  # warm-up: the pooled connection, the tree, lazy imports
                writer.write(COMPLETION(i))
                await _answer(reader)
            sys.setprofile(count)
            try:
                for i in range(N):
                    writer.write(COMPLETION(1000 + i))
                    status = await _answer(reader)
            finally:
                sys.setprofile(None)
        finally:
            writer.close()
            await runner.cleanup()
        return status

    loop = uvloop.new_event_loop()
    try:
        return loop.run_until_complete(scenario()), calls
    finally:
        loop.close()


def test_a_plain_completion_makes_at_most_the_budgeted_own_calls(worker: str) -> None:
    status, calls = _own_calls(worker, fast=True)
    per_request = sum(calls.values()) / N
    top = ", ".join(f"{name} {n / N:.1f}" for name, n in calls.most_common(12))
    assert status == 200
    assert per_request >= 20, f"the counter saw too little to be counting the router: {top}"
    assert per_request <= BUDGET, (
        f"a plain completion makes {per_request:.1f} calls into the router's own code, over "
        f"the budget of {BUDGET}; the most called: {top}"
    )


def test_the_counter_sees_work_added_to_every_request(
    worker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard can fail: the routing decision's metric counted three times a request
    is two calls more each (a timer's task, the fleet queue's tick, may add a few either
    way)."""
    from router.metrics import Metrics

    plain = _own_calls(worker, fast=True)[1]
    real = Metrics.decision

    def thrice(self: Metrics, reason: str, now: float | None = None) -> None:
        real(self, reason, now)  # (this file's calls are not counted)
        real(self, reason, now)
        real(self, reason, now)

    monkeypatch.setattr(Metrics, "decision", thrice)
    more = _own_calls(worker, fast=True)[1]
    assert sum(more.values()) - sum(plain.values()) >= 1.5 * N
