"""No request through the router makes a reference cycle (issue 34).

What a request allocates must be freed by reference counting as it ends: a cycle waits
for the garbage collector, whose passes cost the router CPU on every request
(shared/serving/gc_policy.py). A real router app on uvloop (the loop `run_router`
installs) over loopback, in front of a real zero-cost worker: the project's sim worker
(echoes `x-request-id`: pooled connections) and a stock-like one that does not echo (a
fresh upstream connection per request). After a warm-up, each kind of request runs `N`
times with `gc.DEBUG_SAVEALL` on; every object a collection then finds unreachable was
in a cycle. The count must be 0 for every kind, errors included.

The client is a raw socket with prepared bytes, so the client makes no cycles of its own
to count. Last, a served router process (`python -m router serve`, the start-up freeze
and thresholds of shared/serving/gc_policy.py) seen through its `/metrics`.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import uvloop

from loadtests.load.cluster import Cluster, WorkerSpec, serve, serve_router
from loadtests.router import zero_worker
from router.http.app import create_app, serving_protocol, serving_runner
from shared.config import RouterConfig
from shared.procs import free_port, wait_until
from shared.serving.http_server import bind

pytestmark = pytest.mark.slow  # starts two worker processes

N = 200
PROMPT = "You are a helpful assistant. Answer briefly. " * 20


def _post(path: str, payload: dict | bytes) -> Callable[[int], bytes]:
    def make(i: int) -> bytes:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        body = body.replace(b"#", str(i).encode())
        return (
            b"POST %s HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
        )

    return make


COMPLETION = _post("/v1/completions", {"prompt": PROMPT + "question #", "max_tokens": 4})
CHAT_STREAM = _post(
    "/v1/chat/completions",
    {"messages": [{"role": "user", "content": PROMPT + "#"}], "max_tokens": 4, "stream": True},
)
BAD_JSON = _post("/v1/completions", b'{"prompt": #')
BAD_FIELD = _post("/v1/completions", {"prompt": PROMPT, "max_tokens": "#"})
UNKNOWN_MODEL = _post("/v1/completions", {"model": "no-such-model-#", "prompt": PROMPT})


async def _answer(reader: asyncio.StreamReader) -> int:
    """Read one answer (Content-Length or chunked); its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    fields = head.lower()
    mark = fields.find(b"\r\ncontent-length: ")
    if mark >= 0:
        start = mark + len(b"\r\ncontent-length: ")
        await reader.readexactly(int(fields[start : fields.index(b"\r\n", start)]))
    else:
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
            await reader.readexactly(size + 2)
        await reader.readexactly(2)
    return int(head.split(b" ", 2)[1])


def _cycles(
    worker_url: str, kinds: dict[str, Callable[[int], bytes]], fast: bool
) -> dict[str, object]:
    """Per kind: its last status and the types of the objects found in cycles."""

    async def scenario() -> dict[str, object]:
        config = RouterConfig(
            worker_urls=(worker_url,), host="127.0.0.1", access_log=False, fast_hot_paths=fast
        )
        runner = await serving_runner(create_app(config))  # as `serve()` serves it
        port = free_port()
        protocol = serving_protocol(runner, config)
        await bind(runner, "127.0.0.1", port, header_read_timeout=10, protocol=protocol)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        out: dict[str, object] = {}
        try:
            for kind, make in kinds.items():
                for i in range(20):  # warm-up: pooled connections, the tree, lazy imports
                    writer.write(make(i))
                    await _answer(reader)
                gc.collect()
                gc.set_debug(gc.DEBUG_SAVEALL)
                try:
                    for i in range(N):
                        writer.write(make(1000 + i))
                        status = await _answer(reader)
                    gc.collect()
                finally:
                    gc.set_debug(0)
                found = collections.Counter(type(o).__qualname__ for o in gc.garbage)
                gc.garbage.clear()
                out[kind] = (status, dict(found))
        finally:
            writer.close()
            await runner.cleanup()
        return out

    loop = uvloop.new_event_loop()
    try:
        return loop.run_until_complete(scenario())
    finally:
        loop.close()


@pytest.fixture(scope="module")
def sim_worker() -> Iterator[str]:
    with Cluster(redis=False) as fleet:
        spec = WorkerSpec(decode_ms=0.0, extra=("--log-level", "WARNING"))
        yield fleet.start_worker("sim-0", spec).url


@pytest.fixture(scope="module")
def no_echo_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The zero-cost worker as a stock engine without its echo switch."""
    logs, port = Path(tmp_path_factory.mktemp("no-echo")), free_port()
    child = serve("no-echo", [zero_worker.__name__, str(port), "--no-echo"], port, logs)
    try:
        yield child.url
    finally:
        child.stop()


# fast: the simplest inference requests through router/http/fast_server.py
FAST = pytest.mark.parametrize("fast", [False, True], ids=["aiohttp", "fast"])


@FAST
def test_no_cycles_per_request_echoing_worker(sim_worker: str, fast: bool) -> None:
    kinds = {
        "completion": COMPLETION, "chat stream": CHAT_STREAM, "bad JSON": BAD_JSON,
        "bad field": BAD_FIELD, "unknown model": UNKNOWN_MODEL,
    }  # fmt: skip
    found = _cycles(sim_worker, kinds, fast)
    assert {k: v[0] for k, v in found.items()} == {  # type: ignore[index]
        "completion": 200, "chat stream": 200, "bad JSON": 400, "bad field": 400,
        "unknown model": 404,
    }  # fmt: skip
    assert {k: v[1] for k, v in found.items()} == {key: {} for key in kinds}  # type: ignore[index]


@FAST
def test_no_cycles_per_request_worker_without_echo(no_echo_worker: str, fast: bool) -> None:
    """A fresh upstream connection per request: opened, used once, closed, all freed."""
    found = _cycles(no_echo_worker, {"completion": COMPLETION}, fast)
    assert found == {"completion": (200, {})}


def _gc_samples(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("python_gc_collections_total", "python_gc_frozen_objects")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_a_served_router_freezes_start_up_and_collects_seldom(tmp_path: Path) -> None:
    """`radix-router serve` (router/http/app.py `serve`): start-up frozen, and 300 requests
    run no full collection and at most one young one (the interpreter's defaults ran
    one every ~100 requests, shared/serving/gc_policy.py)."""
    wport, rport = free_port(), free_port()
    worker = serve("w", [zero_worker.__name__, str(wport)], wport, tmp_path)
    router = None
    try:
        router = serve_router("r", rport, tmp_path, ["--worker-url", worker.url])
        url = router.url
        wait_until(lambda: _gc_samples(url)["python_gc_frozen_objects"] > 10_000, 10)
        before = _gc_samples(url)

        async def load() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", rport)
            for i in range(300):
                writer.write(COMPLETION(i))
                assert await _answer(reader) == 200
            writer.close()

        asyncio.run(load())
        after = _gc_samples(url)
    finally:
        for child in (router, worker):
            if child is not None:
                child.stop()
    young, full = (
        'python_gc_collections_total{generation="0"}',
        'python_gc_collections_total{generation="2"}',
    )
    assert after[full] == before[full]
    assert after[young] - before[young] <= 1
