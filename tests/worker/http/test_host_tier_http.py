"""The host KV tier seen from outside a worker: the official `openai` client's usage,
/metrics and the heartbeat record (sim engine, and the radix engine on the tiny model)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.worker.conftest import WorkerThread, sim_config
from worker.http.app import make_record
from worker.http.state import STATE

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
]


def prompt(i: int) -> str:
    return " ".join(WORDS[(i + j) % len(WORDS)] + str(i) for j in range(30))


@pytest.fixture(params=["sim", "radix"])
def worker(request: pytest.FixtureRequest) -> Iterator[WorkerThread]:
    common = {"cache_tokens": 400, "host_cache_tokens": 4000, "max_model_len": 300}
    if request.param == "sim":
        config = sim_config(**common)
    else:
        model_dir: Path = request.getfixturevalue("tiny_model_dir")
        config = sim_config(engine="radix", model=str(model_dir), device="cpu", **common)
    with WorkerThread(config) as w:
        yield w


def metrics(worker: WorkerThread) -> dict[str, float]:
    text = urllib.request.urlopen(worker.url + "/metrics").read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_host_hits_count_as_cached_tokens_and_are_reported(worker: WorkerThread) -> None:
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)
    model = worker.engine.model_name

    def complete(i: int) -> openai.types.Completion:
        return client.completions.create(model=model, prompt=prompt(i), max_tokens=4, temperature=0)

    first = complete(0)
    for i in range(1, 8):  # push prompt 0 off the 400-token device pool
        complete(i)
    again = complete(0)
    assert first.usage is not None and again.usage is not None
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1 - 15

    m = metrics(worker)
    host_hits = m['radix_worker_cached_tokens_by_tier_total{tier="host"}']
    # All but a start every prompt shares (BOS; on the device, hot) came from the host.
    assert host_hits >= again.usage.prompt_tokens_details.cached_tokens - 4
    device_hits = m['radix_worker_cached_tokens_by_tier_total{tier="device"}']
    assert device_hits + host_hits == m["radix_worker_cached_tokens_total"]
    assert m["radix_worker_host_kv_capacity_tokens"] == 4000
    assert 0 < m["radix_worker_host_kv_used_tokens"] <= 4000
    assert m["radix_worker_host_load_tokens_total"] >= host_hits
    assert m["radix_worker_host_load_bytes_per_second"] > 0
    assert m["radix_worker_kv_bytes_per_token"] > 0

    record = worker.run(lambda: make_record(worker.config, worker.engine, worker.app[STATE]))
    assert record.host_kv_capacity_tokens == 4000 and record.host_kv_used_tokens > 0
    assert record.host_cached_tokens_total == host_hits and record.kv_bytes_per_token > 0
    assert record.host_load_bytes_per_s > 0
    assert type(record).from_hash(record.to_hash()) == record  # what routers read back
