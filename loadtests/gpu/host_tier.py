"""The GPU check's `host_tier` section: the host KV tier on the device.

- `load_bandwidth`: one step's load of N tokens (host slots in page runs, scattered
  device slots) through `HostKVPool.copy`, timed with CUDA events, against a plain
  pinned host -> device copy of the same bytes (what PCIe gives one stream) and the
  write-back direction; the ratio says how much of the link the batched copy uses.
- `no_host_sync`: the copy under `torch.cuda.set_sync_debug_mode("error")`: any
  synchronizing call in it (a pageable copy, `.item()`, a synchronize) raises.
- `greedy_equal`: the engine with a small device pool and a host tier serves prompt A,
  fillers that push it off the device, then A again: cached tokens >= A's prefix and
  greedy tokens equal to an engine whose pool never evicts.

On CPU (the test suite's quick run) the same steps run on plain tensors.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.engine.host_tier import KVCopies
from worker.engine.runtime.host_memory import Pinning, tier_host_bytes
from worker.engine.runtime.host_pool import HostKVPool
from worker.engine.runtime.kv_pool import KVPool


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copies(n: int, page: int, capacity: int, host_capacity: int, seed: int) -> KVCopies:
    rng = np.random.default_rng(seed)
    host_pages = rng.permutation(host_capacity // page)[: n // page]
    host = (host_pages[:, None] * page + np.arange(page)).reshape(-1).astype(np.int64)
    device = rng.permutation(capacity)[:n].astype(np.int64)
    empty = np.empty(0, dtype=np.int64)
    return KVCopies(empty, empty, host, device)


def load_bandwidth(device: torch.device, quick: bool) -> dict[str, Any]:
    cuda = device.type == "cuda"
    layers, heads, dim = (2, 2, 16) if quick else (32, 8, 128)  # an 8B model's KV shape
    capacity, host_capacity, n, page = (256, 512, 128, 16) if quick else (32768, 65536, 16384, 16)
    dtype = torch.bfloat16 if cuda else torch.float32
    pool = KVPool(layers, heads, dim, capacity, dtype, device)
    host = HostKVPool(pool, host_capacity)
    load = _copies(n, page, capacity, host_capacity, 0)
    write = KVCopies(load.load_device, load.load_host, load.write_device, load.write_host)
    nbytes = n * host.bytes_per_token
    host.copy(load)  # warm-up: allocations, pinned index buffers
    _sync(device)
    out: dict[str, Any] = {"tokens": n, "page": page, "bytes": nbytes,
                           "pinning": host.pinning.value, "host_bytes": host.host_bytes,
                           "host_bytes_if_pin_memory": tier_host_bytes(
                               host_capacity, host.bytes_per_token, Pinning.CACHING)}  # fmt: skip
    for name, plan in (("load", load), ("write_back", write)):
        times = []
        for _ in range(3 if quick else 10):
            start = time.perf_counter()
            host.copy(plan)
            _sync(device)
            times.append(time.perf_counter() - start)
        out[f"{name}_bytes_s"] = nbytes / float(np.median(times))
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(3 if quick else 10):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        _sync(device)
        times.append(time.perf_counter() - start)
    out["plain_h2d_bytes_s"] = nbytes / float(np.median(times))
    out["load_over_plain"] = out["load_bytes_s"] / out["plain_h2d_bytes_s"]
    out["event_timed_load_bytes_s"] = host.load_bytes_per_s
    out["passed"] = out["load_bytes_s"] > 0
    return out


def no_host_sync(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"passed": True, "how": "not run: CUDA only"}
    pool = KVPool(2, 2, 64, 1024, torch.bfloat16, device)
    host = HostKVPool(pool, 2048)
    plan = _copies(512, 16, 1024, 2048, 1)
    host.copy(plan)  # warm-up outside the check: first-call allocations
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        host.copy(plan)
        both = KVCopies(plan.load_device, plan.load_host, plan.load_host, plan.load_device)
        host.copy(both)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"passed": True, "how": 'torch.cuda.set_sync_debug_mode("error")'}


def greedy_equal(device: torch.device, quick: bool) -> dict[str, Any]:
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine
    from worker.engine.runtime.load import load_engine
    from worker.engine.types import EngineRequest, SamplingParams
    from worker.models.tiny_model import PRESETS, make_tiny_model

    cuda = device.type == "cuda"
    model_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="gpu-host-tier-")), **PRESETS["tiny"],
                                device=str(device), dtype="bfloat16" if cuda else "float32")  # fmt: skip
    page, n = 16, (150 if quick else 1000)
    common = {"device": str(device), "page_size": page, "evict_batch_tokens": 16}
    tiered = load_engine(model_dir, EngineConfig(
        kv_capacity_tokens=n + 100, host_cache_tokens=8 * n, **common))  # fmt: skip
    unbounded = load_engine(model_dir, EngineConfig(kv_capacity_tokens=8 * n, **common))
    rng = random.Random(3)
    a = tuple(rng.randrange(4, 500) for _ in range(n))
    fillers = [tuple(rng.randrange(4, 500) for _ in range(n)) for _ in range(2)]

    def run(engine: LLMEngine, rid: str, ids: tuple[int, ...]) -> tuple[list[int], int]:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        engine.add_request(EngineRequest(rid, prompt_token_ids=ids, params=params))
        toks, cached = [], 0
        while engine.has_work:
            for out in engine.step():
                toks += out.token_ids
                cached = out.cached_tokens
            engine.check_integrity()
        return toks, cached

    first, _ = run(tiered, "a", a)
    for i, f in enumerate(fillers):
        run(tiered, f"f{i}", f)
    again, cached = run(tiered, "a2", a)
    want_first, _ = run(unbounded, "a", a)
    want_again, _ = run(unbounded, "a2", a)
    prefix = (n - 1) // page * page
    ok = first == want_first and again == want_again and cached >= prefix
    return {"passed": ok, "cached_tokens": cached, "prefix": prefix,
            "host_loaded": tiered.stats().host_load_tokens_total}  # fmt: skip


def host_tier_section(rec: Any, device: torch.device, quick: bool) -> None:
    rec.step("load_bandwidth", lambda: load_bandwidth(device, quick))
    rec.step("no_host_sync", lambda: no_host_sync(device))
    rec.step("greedy_equal", lambda: greedy_equal(device, quick))


def to_markdown(r: dict[str, Any]) -> list[str]:
    lines = ["## Host KV tier", ""]
    bw = r.get("load_bandwidth")
    if isinstance(bw, dict) and "load_bytes_s" in bw:
        lines.append(
            f"- one step's load of {bw['tokens']} tokens ({bw['bytes'] / 2**20:.0f} MiB, pages "
            f"of {bw['page']}): {bw['load_bytes_s'] / 1e9:.2f} GB/s; write-back "
            f"{bw['write_back_bytes_s'] / 1e9:.2f} GB/s; one plain pinned host -> device copy "
            f"of the same bytes {bw['plain_h2d_bytes_s'] / 1e9:.2f} GB/s (load / plain "
            f"{bw['load_over_plain']:.2f}); host buffers {bw['host_bytes'] / 2**20:.0f} MiB "
            f"({bw['pinning']}; pin_memory would take {bw['host_bytes_if_pin_memory'] / 2**20:.0f})"
        )
    sync = r.get("no_host_sync")
    if isinstance(sync, dict) and "how" in sync:
        lines.append(f"- host syncs in a step's copies ({sync['how']}): "
                     f"{'none' if sync.get('passed') else 'SOME'}")  # fmt: skip
    g = r.get("greedy_equal")
    if isinstance(g, dict) and "cached_tokens" in g:
        lines.append(f"- prompt pushed off the device and reloaded: cached {g['cached_tokens']} "
                     f"(prefix {g['prefix']}), greedy tokens "
                     f"{'equal' if g['passed'] else 'DIFFERENT'} to an unbounded pool")  # fmt: skip
    return [*lines, ""]
