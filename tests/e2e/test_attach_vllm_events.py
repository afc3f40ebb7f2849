"""A real `vllm serve` (CPU build, prefix caching, KV events over ZMQ) behind
`radix-worker attach --kv-events`: the router's index (router/holdings/kv_feed.py, reading the
worker's Redis stream) holds the blocks vLLM reports, predicts the next request's
`cached_tokens` within one block, and drops the blocks vLLM evicts from its small pool.
The same engine serves a LoRA adapter made here (`--enable-lora --lora-modules`): a real
router keys the adapter's requests apart from the base model's on that one worker.

Runs in the vLLM virtualenv (`.ci/vllm-tests`); skipped elsewhere. Prompts are token ids,
so the test and vLLM agree on the tokens without a tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from redis.asyncio import Redis  # noqa: E402

from loadtests.load.cluster import Child, Cluster  # noqa: E402
from router.holdings.kv_feed import FeedMember, KvEventFeed  # noqa: E402
from shared.procs import free_port, http_json, wait_until  # noqa: E402
from shared.wire.kv_events import BlockStored, parse_entry  # noqa: E402
from shared.wire.registry import Registry  # noqa: E402
from worker.models.tiny_model import make_tiny_lora  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "tiny-vllm-events"
BLOCKS = 24  # vLLM's KV pool, in blocks (--num-gpu-blocks-override): evicts soon
ADAPTER = "tiny-lora-a"  # a LoRA adapter vLLM serves beside MODEL (--lora-modules)


@pytest.fixture(scope="module")
def fleet(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Cluster, str]]:
    lora = make_tiny_lora(tiny_model_dir, tmp_path_factory.mktemp("tiny-lora"), rank=8)
    with Cluster() as f:
        port, pub, replay = free_port(), free_port(), free_port()
        upstream = f"http://127.0.0.1:{port}"
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}  # fmt: skip
        engine = Child(
            "vllm",
            ["vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir),
             "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL,
             "--max-model-len", "1024", "--enforce-eager", "--enable-prefix-caching",
             "--enable-prompt-tokens-details", "--max-num-seqs", "4", "--dtype", "float32",
             "--num-gpu-blocks-override", str(BLOCKS), "--kv-events-config", json.dumps(events),
             # A LoRA adapter beside the base model (test_an_adapter_is_keyed_apart...).
             "--enable-lora", "--lora-modules", f"{ADAPTER}={lora}", "--max-lora-rank", "8",
             "--max-loras", "1"],
            upstream, f.log_dir / "vllm.log",
        )  # fmt: skip
        f.adopt(engine.start())
        wait_until(lambda: _up(upstream + "/v1/models"), 300, engine, poll_s=1.0)
        assert f.redis is not None
        sidecar = Child(
            "attach",
            ["worker", "attach", "--upstream", upstream, "--engine", "vllm", "--redis-url",
             # 0.5 s: expiry after 1.5 s (0.2 s expired the record under load: 0.6 s).
             f.redis.url, "--worker-id", "vllm-ev", "--interval", "0.5",
             "--kv-events", f"tcp://127.0.0.1:{pub}",
             "--kv-events-replay", f"tcp://127.0.0.1:{replay}"],
            upstream, f.log_dir / "attach.log",
        ).start()  # fmt: skip
        f.adopt(sidecar)
        yield f, upstream


def _up(url: str) -> bool:
    try:
        return http_json(url, timeout=2.0)[0] == 200
    except OSError:
        return False


def test_index_holds_predicts_and_drops_what_vllm_reports(fleet: tuple[Cluster, str]) -> None:
    f, upstream = fleet
    assert f.redis is not None
    client = openai.AsyncOpenAI(base_url=upstream + "/v1", api_key="unused", max_retries=0)

    async def cached(prompt: list[int]) -> int:
        r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        return r.usage.prompt_tokens_details.cached_tokens or 0  # type: ignore[union-attr]

    async def main() -> None:
        redis = Redis.from_url(f.redis.url)
        registry = Registry(redis)
        fleet_ = await registry.read_fleet()
        for _ in range(100):
            if "vllm-ev" in fleet_:
                break
            await asyncio.sleep(0.2)
            fleet_ = await registry.read_fleet()
        feed = KvEventFeed(registry)

        async def settle(cond) -> None:
            # By the clock, not a count of polls: until the heartbeat names a block size
            # a poll reads nothing and returns at once (300 of them took ~1 s, before the
            # engine's first events on a busy machine).
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                # The sidecar's heartbeat names the block size once its engine's first
                # events have (until then the router does not read the stream).
                record = (await registry.read_fleet()).get("vllm-ev")
                if record is not None:  # (a heartbeat late on a busy machine: expired)
                    feed.follow([FeedMember("vllm-ev", MODEL, record.epoch,
                                            block_size=record.kv_block_size)])  # fmt: skip
                    await feed.poll(block_ms=50)
                if cond():
                    return
                await asyncio.sleep(0.02)
            raise AssertionError(f"never got there: {feed.streams}, {feed.dropped}")

        prompt = [(7 * i) % 500 + 3 for i in range(700)]
        first = await cached(prompt)
        await settle(lambda: feed.match(MODEL, prompt).get("vllm-ev", 0) > 0)
        index = feed.indexes[MODEL]
        held = feed.match(MODEL, prompt)["vllm-ev"]
        assert held == len(prompt) // index.block_size * index.block_size, (held, index.block_size)
        follow_up = [*prompt, 11, 12, 13]
        predicted = feed.match(MODEL, follow_up)["vllm-ev"]
        actual = await cached(follow_up)
        assert abs(predicted - actual) <= index.block_size, (predicted, actual, first)
        print(f"vLLM block {index.block_size}: held {held}, predicted {predicted}, actual {actual}")
        # Other prompts through the small pool: vLLM evicts the first, the index follows.
        for k in range(6):
            await cached([k + 3, *((k * 37 + i * 11) % 400 + 5 for i in range(699))])
        await settle(lambda: feed.match(MODEL, prompt).get("vllm-ev", 0) < held)
        assert feed.trusted("vllm-ev") and not feed.dropped, feed.dropped
        await redis.aclose()

    asyncio.run(main())


def test_cache_salt_keeps_vllm_blocks_apart_and_reaches_the_stream(
    fleet: tuple[Cluster, str],
) -> None:
    """vLLM's `cache_salt` (its OpenAI server's field: the salt mixed into the first
    block's hash): the same prompt under another salt gets no cached tokens, under its
    own salt it does; the sidecar forwards the events with their `extra_keys` (vLLM puts
    the salt in the first block's entry) where this vLLM writes them."""
    f, upstream = fleet
    assert f.redis is not None
    client = openai.AsyncOpenAI(base_url=upstream + "/v1", api_key="unused", max_retries=0)
    prompt = [(13 * i) % 300 + 9 for i in range(400)]  # 3 of vLLM CPU's 128-token blocks

    async def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else None
        r = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra
        )
        return r.usage.prompt_tokens_details.cached_tokens or 0  # type: ignore[union-attr]

    async def main() -> None:
        assert await cached("tenant-a") == 0
        assert await cached("tenant-a") > 0  # its own salt: its blocks
        assert await cached("tenant-b") == 0  # another salt: none
        assert await cached(None) == 0  # no salt: none either
        redis = Redis.from_url(f.redis.url)
        salts = set()
        for _ in range(100):  # the forwarder writes within a fraction of a second
            entries = await redis.xrange(Registry(redis).kv_events_key("vllm-ev"))
            for _, fields in entries:
                for e in parse_entry("vllm-ev", fields).batch.events:
                    if isinstance(e, BlockStored) and e.extra_keys and e.extra_keys[0]:
                        salts.update(k for k in e.extra_keys[0] if isinstance(k, str))
            if {"tenant-a", "tenant-b"} <= salts:
                break
            await asyncio.sleep(0.1)
        await redis.aclose()
        print(f"salts in vLLM's forwarded extra_keys: {sorted(salts)}")
        from vllm.distributed.kv_events import BlockStored as VllmStored

        if "extra_keys" in VllmStored.__struct_fields__:
            assert {"tenant-a", "tenant-b"} <= salts, salts

    asyncio.run(main())


def test_an_adapter_is_keyed_apart_from_its_base_model_on_one_worker(
    fleet: tuple[Cluster, str], tiny_model_dir: Path
) -> None:
    """vLLM's CPU build serves the adapter and keeps its blocks apart from the base
    model's (its name is in every block's hash). The sidecar advertises it
    (`adapters` in the heartbeat, from vLLM's /v1/models), so a real router (tokenizer
    and KV events on) routes it to this worker, and keys it apart: the same prompt is
    predicted no hit across base and adapter, from the tree or from the KV index, in
    either order, and vLLM's `cached_tokens` agrees; within each, hits are predicted and
    served. The adapter's blocks reach the stream with their `lora_name` and the router
    keeps them out of the base model's index. An adapter no worker serves: 404."""
    f, upstream = fleet
    assert f.redis is not None
    f.start_router({"tokenizer": str(tiny_model_dir), "kv_events": True}, want_workers=1)
    assert f.router_workers()["vllm-ev"]["adapters"] == [ADAPTER]
    listed = {m["id"]: m["parent"] for m in http_json(f.router_url + "/v1/models")[1]["data"]}
    assert listed == {MODEL: None, ADAPTER: MODEL}, listed  # as vLLM lists them
    client = openai.OpenAI(base_url=f.router_url + "/v1", api_key="unused", max_retries=0)

    def ask(model: str, prompt: list[int]) -> tuple[int, int]:
        """(tokens the router predicted held, tokens vLLM reports cached)."""
        raw = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=1)
        assert raw.headers["x-radix-worker"] == "vllm-ev"
        usage = raw.parse().usage
        cached = usage.prompt_tokens_details.cached_tokens or 0  # type: ignore[union-attr]
        return int(raw.headers["x-radix-matched-chars"]), cached

    base_first = [901 + (31 * i) % 100 for i in range(400)]  # 3 of vLLM CPU's blocks
    adapter_first = [801 + (17 * i) % 90 for i in range(400)]
    assert ask(MODEL, base_first) == (0, 0)
    # The router's index holds the base model's blocks of it (trusted: its status ok).
    wait_until(lambda: _metric(f, "radix_router_kv_index_blocks", MODEL) >= 3, 60)
    wait_until(lambda: _metric(f, "radix_router_kv_events_status", 'status="ok"') == 1, 60)
    assert ask(ADAPTER, base_first) == (0, 0)  # nothing predicted across, nothing served
    predicted, cached = ask(ADAPTER, base_first)
    assert predicted >= cached > 0, (predicted, cached)  # its own blocks
    # The other way: the adapter's blocks first; the router reads them and drops them.
    dropped = _metric(f, "radix_router_kv_events_dropped_total", "namespace")
    assert ask(ADAPTER, adapter_first) == (0, 0)
    wait_until(
        lambda: _metric(f, "radix_router_kv_events_dropped_total", "namespace") > dropped, 60
    )
    assert ask(MODEL, adapter_first) == (0, 0)
    predicted, cached = ask(MODEL, adapter_first)
    assert predicted >= cached > 0, (predicted, cached)
    with pytest.raises(openai.NotFoundError) as missing:  # no worker serves it: the router's 404
        client.completions.create(model="tiny-lora-absent", prompt=[5, 6], max_tokens=1)
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    direct = openai.OpenAI(base_url=upstream + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):  # vLLM's own answer: 404 too
        direct.completions.create(model="tiny-lora-absent", prompt=[5, 6], max_tokens=1)

    async def adapters_in_stream() -> set[object]:
        redis = Redis.from_url(f.redis.url)
        entries = await redis.xrange(Registry(redis).kv_events_key("vllm-ev"))
        await redis.aclose()
        return {
            e.lora for _, fields in entries for e in parse_entry("vllm-ev", fields).batch.events
            if isinstance(e, BlockStored) and e.lora is not None
        }  # fmt: skip

    assert asyncio.run(adapters_in_stream()) == {ADAPTER}


def _metric(f: Cluster, name: str, label: str) -> float:
    """A sample of the router's /metrics whose labels hold `label` (0 if none)."""
    with urllib.request.urlopen(f.router_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
        if line.startswith(name + "{") and label in line
    )  # fmt: skip
