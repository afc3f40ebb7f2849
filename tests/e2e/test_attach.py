"""`radix-worker attach` in front of a stock engine, behind a real router and Redis.

SGLang has no CPU build, so the upstream here is a FAKE SGLang server: it serves
SGLang's documented metric names (`sglang:num_running_reqs`, `sglang:num_queue_reqs`,
`sglang:token_usage`, ...), `/get_server_info` with `max_total_num_tokens`, and OpenAI
answers with `cached_tokens`. The sidecar, the router and Redis are the real processes.
The same sidecar against a real `vllm serve` (CPU build) is tests/e2e/test_attach_vllm.py.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator

import pytest
import redis
from aiohttp import web

from loadtests.load.cluster import Child, Cluster
from shared.procs import free_port, http_json, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
MODEL = "fake-sglang-model"


class FakeSGLang:
    """SGLang's HTTP surface as far as the sidecar and the router use it."""

    def __init__(self) -> None:
        self.running = 0
        self.queued = 0
        self.token_usage = 0.25
        self.start_time = time.time()
        self.prompt_tokens = 0
        self.cached = 0
        self.served = 0
        self.request_ids: list[str] = []

    async def metrics(self, _: web.Request) -> web.Response:
        labels = f'{{model_name="{MODEL}"}}'
        text = "\n".join([
            "# TYPE sglang:num_running_reqs gauge", f"sglang:num_running_reqs{labels} {self.running}",
            "# TYPE sglang:num_queue_reqs gauge", f"sglang:num_queue_reqs{labels} {self.queued}",
            "# TYPE sglang:token_usage gauge", f"sglang:token_usage{labels} {self.token_usage}",
            "# TYPE sglang:prompt_tokens counter",
            f"sglang:prompt_tokens_total{labels} {self.prompt_tokens}",
            "# TYPE sglang:cached_tokens counter", f"sglang:cached_tokens_total{labels} {self.cached}",
            "# TYPE process_start_time_seconds gauge", f"process_start_time_seconds {self.start_time}",
        ]) + "\n"  # fmt: skip
        return web.Response(text=text, content_type="text/plain")

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def server_info(self, _: web.Request) -> web.Response:
        return web.json_response({"max_total_num_tokens": 40000, "model_path": MODEL})

    async def completions(self, request: web.Request) -> web.Response:
        await request.json()
        self.served += 1
        self.request_ids.append(request.headers.get("x-request-id", ""))
        self.prompt_tokens += 10
        self.cached += 6
        usage = {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11,
                 "prompt_tokens_details": {"cached_tokens": 6}}  # fmt: skip
        return web.json_response({
            "id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}], "usage": usage,
        })  # fmt: skip


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeSGLang, str]]:
    server = FakeSGLang()
    app = web.Application()
    app.router.add_get("/metrics", server.metrics)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/get_server_info", server.server_info)
    app.router.add_post("/v1/completions", server.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield server, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def _attach(fleet: Cluster, upstream: str, engine: str, worker_id: str, *extra: str) -> Child:
    assert fleet.redis is not None
    args = ["worker", "attach", "--upstream", upstream, "--engine", engine, "--redis-url",
            fleet.redis.url, "--worker-id", worker_id, "--interval", "0.2", *extra]  # fmt: skip
    child = Child(f"attach-{worker_id}", args, upstream, fleet.log_dir / f"attach-{worker_id}.log")
    return fleet.adopt(child.start())  # stopped with the fleet


async def _until(check, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)


async def test_sglang_fake_behind_attach_and_the_router(fake: tuple[FakeSGLang, str]) -> None:
    server, url = fake
    with Cluster() as fleet:
        sidecar = _attach(fleet, url, "sglang", "sgl-0", "--max-running-requests", "16")
        router = await asyncio.to_thread(fleet.start_router, None, (), 0)
        await _until(lambda: "sgl-0" in _workers(fleet))
        w = _workers(fleet)["sgl-0"]
        assert w["url"] == url and w["model"] == MODEL and w["engine"] == "sglang"
        # max_running_requests + the default spare seat (router/queue/seats.py)
        assert w["seats"] == 16 + 1
        epoch = w["epoch"]
        # Requests route to it and cached_tokens comes back through the router.
        body = {"model": MODEL, "prompt": "hello " * 20, "max_tokens": 1}
        status, answer = await asyncio.to_thread(
            http_json,
            router.url + "/v1/completions",
            "POST",
            body,
            {"x-request-id": "rid-attach-1"},
        )
        assert status == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 6
        assert server.served == 1 and server.request_ids == ["rid-attach-1"]
        # SGLang does not echo x-request-id: the router names it, with the cost, and the
        # sidecar said what to do about it (worker/attach/echo_check.py).
        echo = _workers(fleet)["sgl-0"]["request_id_echo"]
        assert echo["echoes"] is False and "new upstream connection" in echo["cost"]
        assert fleet.router_metric("radix_router_worker_unechoed_answers_total") == 1
        log = (fleet.log_dir / "attach-sgl-0.log").read_text()
        assert "does not echo x-request-id" in log and "SGLang has no switch" in log
        # Load moves: the upstream's queue and KV usage reach the router's view.
        server.running, server.queued, server.token_usage = 7, 5, 0.5
        await _until(lambda: _workers(fleet)["sgl-0"].get("waiting") == 5)
        w = _workers(fleet)["sgl-0"]
        assert w["running"] == 7 and w["load"] >= 12
        assert fleet.router_metric("radix_router_worker_kv_cache_usage_ratio") == pytest.approx(0.5)
        # The upstream restarts (new process start time): a new epoch.
        server.start_time += 100
        await _until(lambda: _workers(fleet)["sgl-0"]["epoch"] != epoch)
        # SIGTERM: the sidecar deregisters and exits 0; the router drops the worker.
        sidecar.signal(signal.SIGTERM)
        assert await asyncio.to_thread(sidecar.wait, 10) == 0
        await _until(lambda: "sgl-0" not in _workers(fleet), 10)


async def test_attach_deregisters_while_the_upstream_is_down(fake: tuple[FakeSGLang, str]) -> None:
    _, url = fake
    polls = 0

    async def hang_up(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal polls
        polls += 1  # a poll of the upstream: answered by hanging up, as a dead engine does
        writer.close()

    down = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    try:
        with Cluster() as fleet:
            _attach(fleet, f"http://127.0.0.1:{down.sockets[0].getsockname()[1]}", "sglang",
                    "sgl-dead")  # fmt: skip
            _attach(fleet, url, "sglang", "sgl-live")
            await asyncio.to_thread(fleet.start_router, None, (), 0)
            await _until(lambda: "sgl-live" in _workers(fleet))
            # The dead one has polled its upstream a few times, and holds no record: not
            # in Redis, not in the router's fleet.
            await _until(lambda: polls >= 3)
            assert fleet.redis is not None
            store = redis.Redis.from_url(fleet.redis.url)
            assert store.exists("radixrouter:worker:sgl-live") == 1  # the key as it would be
            assert store.exists("radixrouter:worker:sgl-dead") == 0
            assert "sgl-dead" not in _workers(fleet)
    finally:
        down.close()


def _workers(fleet: Cluster) -> dict[str, dict]:
    try:
        return fleet.router_workers()
    except (OSError, TypeError, KeyError):
        return {}


def test_attach_refuses_a_bad_upstream_url() -> None:
    import subprocess
    import sys

    from tests.helm.chart import ROOT

    done = subprocess.run(
        [sys.executable, "-m", "worker", "attach", "--upstream", "ftp://x", "--engine", "vllm",
         "--redis-url", "redis://127.0.0.1:1/0"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "worker URL" in done.stderr
    wait_until(lambda: True, 1)


def test_attach_refuses_an_unreadable_password_file(tmp_path) -> None:
    """The chart's attach sidecar reads its pod's Redis password from a file: a missing
    one stops it at once, naming the flag, not at the first heartbeat."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "worker", "attach", "--engine", "vllm",
            "--upstream", "http://127.0.0.1:1", "--redis-url", "redis://radix-worker-p-0@127.0.0.1:1/0",
            "--redis-password-file", str(tmp_path / "missing")]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--redis-password-file: cannot read password file" in done.stderr
