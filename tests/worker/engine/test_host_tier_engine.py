"""The host KV tier on the tiny model (CPU, real copies between two torch pools).

Prompt A, then enough other prompts to push A off the device pool, then A again: with
the tier A's prefix (to the page) is a cached hit, loaded from host memory, and the
greedy output equals a run whose device pool never evicts; without the tier, 0."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.worker.engine.test_engine import make_engine, rand_ids, req, run, tokens
from worker.engine.config import EngineConfig
from worker.engine.runtime.host_pool import check_host_memory
from worker.engine.runtime.kv_pool import cpu_available_bytes


@pytest.mark.parametrize(("page_size", "host", "policy"), [
    (1, 2048, "write_back"), (16, 2048, "write_back"), (16, 2048, "write_through"), (16, 0, ""),
])  # fmt: skip
def test_prompt_evicted_to_host_comes_back_cached_and_exact(
    tiny_model_dir: Path, page_size: int, host: int, policy: str
) -> None:
    rng = random.Random(7)
    a = rand_ids(rng, 150)
    others = [rand_ids(rng, 150) for _ in range(4)]
    tiered = make_engine(
        tiny_model_dir, kv_capacity_tokens=256, page_size=page_size, host_cache_tokens=host,
        host_write_policy=policy or "write_back", evict_batch_tokens=16,
    )  # fmt: skip
    unbounded = make_engine(tiny_model_dir, kv_capacity_tokens=4096, page_size=page_size)
    first = run(tiered, req("a", a, max_tokens=6))["a"]
    for i, o in enumerate(others):
        run(tiered, req(f"o{i}", o, max_tokens=6))
    assert tiered.cache.match_prefix(a[:-1], record=False).prefix_len == 0  # off the device
    again = run(tiered, req("a2", a, max_tokens=6))["a2"]

    want = run(unbounded, req("a", a, max_tokens=6), req("a2", a, max_tokens=6))
    assert tokens(first) == tokens(want["a"])
    assert tokens(again) == tokens(want["a2"])
    prefix = (len(a) - 1) // page_size * page_size
    stats = tiered.stats()
    if host:
        assert again[-1].cached_tokens >= prefix
        assert stats.host_cached_tokens_total >= prefix
        assert stats.host_kv_capacity_tokens == host and stats.host_load_tokens_total >= prefix
        assert stats.host_load_bytes_per_s > 0
        assert stats.kv_bytes_per_token == tiered.runner.kv_bytes_per_token > 0
    else:
        assert again[-1].cached_tokens == 0
        assert stats.host_kv_capacity_tokens == 0 and stats.host_cached_tokens_total == 0
    tiered.flush_cache()
    tiered.check_integrity()
    assert tiered.allocator.available == tiered.allocator.capacity
    assert tiered.stats().host_kv_used_tokens == 0


def test_host_tier_larger_than_host_memory_is_refused_with_the_number(
    tiny_model_dir: Path,
) -> None:
    huge = cpu_available_bytes() + 1  # tokens: at least a byte each, so never fits
    with pytest.raises(ValueError, match=rf"host_cache_tokens {huge} needs [\d,]+ bytes"):
        make_engine(tiny_model_dir, host_cache_tokens=huge)
    with pytest.raises(ValueError, match=r"but 1,000 are available; at most 7 tokens fit"):
        check_host_memory(100, 128, available=1000)


@pytest.mark.parametrize("bad", [-1, 1.5, "8", True])
def test_engine_config_refuses_a_bad_host_size_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match="host_cache_tokens"):
        EngineConfig(host_cache_tokens=bad)  # type: ignore[arg-type]


def test_engine_config_refuses_an_unknown_write_policy() -> None:
    with pytest.raises(ValueError, match="host_write_policy"):
        EngineConfig(host_write_policy="write_around")  # type: ignore[arg-type]


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_host_pool_round_trip_restores_the_exact_rows(kv_dtype: str | None) -> None:
    """Write-back then load into other device slots: the rows come back bit for bit
    (an fp8 pool moves as its bytes)."""
    import numpy as np
    import torch

    from worker.engine.runtime.host_pool import HostKVPool
    from worker.engine.runtime.kv_pool import KVPool
    from worker.engine.types import KVCopies

    dtype = getattr(torch, kv_dtype) if kv_dtype else None
    pool = KVPool(2, 2, 8, 64, torch.float32, torch.device("cpu"), kv_dtype=dtype)
    torch.manual_seed(0)
    for buf in (pool.k_buffer, pool.v_buffer):
        buf.copy_(torch.randn(buf.shape).clamp(-4, 4).to(buf.dtype))
    host = HostKVPool(pool, 32)
    src, hs, dst = np.arange(3, 13), np.array([20, 21, 22, 5, 6, 7, 8, 0, 1, 31]), np.arange(40, 50)
    empty = np.empty(0, dtype=np.int64)
    host.copy(KVCopies(src, hs, empty, empty))
    host.copy(KVCopies(empty, empty, hs, dst))
    for buf in (pool.k_buffer, pool.v_buffer):
        a, b = buf[:, src].view(torch.uint8), buf[:, dst].view(torch.uint8)
        assert torch.equal(a, b)
