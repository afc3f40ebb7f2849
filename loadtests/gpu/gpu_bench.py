"""Measurements for the GPU check (loadtests/gpu/gpu_check.py), one model at a time.

Imports only torch, numpy, transformers and the engine: the GPU machine has no
pydantic or redis. Every timing synchronises the device; decode steps are timed as
the engine runs them (build the step, forward, argmax, ids back to the host).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.engine.allocator import SlotAllocator
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.runtime.load import load_engine
from worker.engine.runtime.runner import BatchItem, ModelRunner
from worker.engine.types import EngineRequest, SamplingParams

# Spec memory bandwidth (bytes/s) by device name; others use the measured copy rate.
SPEC_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12,
                  "H100": 3.35e12, "A100-SXM4-80GB": 2.04e12, "A100": 1.55e12,
                  "L40S": 0.864e12, "L4": 0.3e12}  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth(device: torch.device) -> dict[str, Any]:
    """Spec bandwidth when the device is known, and a measured device copy rate."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec = next((bw for key, bw in SPEC_BANDWIDTH.items() if key in name), None)
    n = (1 << 28) if device.type == "cuda" else (1 << 22)
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    sync(device)
    measured = 5 * 2 * src.nbytes / (time.perf_counter() - start)  # read + write
    return {"device": name, "spec_bytes_s": spec, "measured_copy_bytes_s": measured,
            "used_bytes_s": spec or measured}  # fmt: skip


def weight_bytes(runner: ModelRunner) -> int:
    return sum(p.numel() * p.element_size() for p in runner.model.parameters())


def kv_bytes_per_token(runner: ModelRunner) -> int:
    cfg = runner.config
    return (
        2
        * cfg.num_hidden_layers
        * cfg.num_key_value_heads
        * cfg.head_dim
        * runner.pool.k[0].element_size()
    )


def decode_ms(runner: ModelRunner, batch: int, context: int, steps: int,
              fragmented: bool = False) -> float:  # fmt: skip
    """Median ms per decode step of `batch` sequences at `context` tokens. Their K/V
    are random rows of the pool (decode time does not depend on the values).

    Contiguous: each sequence's slots are one run (a fresh pool). Fragmented: a pool in
    service, where requests of every length came and went and a sequence's slots are
    wherever the free list had them; taken at its worst, the batch's slots shuffled
    token by token, so no two neighbouring tokens share a cache line of the pool."""
    alloc = SlotAllocator(runner.pool.capacity)
    alloc.reset()
    n = context + steps + 3
    slots = [alloc.alloc(n) for _ in range(batch)]
    if any(s is None for s in slots):
        raise RuntimeError(f"pool too small for batch {batch} x context {context}")
    if fragmented:
        flat = np.random.default_rng(0).permutation(np.concatenate(slots))
        slots = [flat[i * n : (i + 1) * n] for i in range(batch)]
    for layer in range(runner.config.num_hidden_layers):
        runner.pool.k[layer].normal_()
        runner.pool.v[layer].normal_()
    times = []
    for step in range(steps + 3):
        pos = context + step
        items = [BatchItem([7 + i], pos, slots[i][: pos + 1], seq_id=i,
                              dirty_from=0 if step == 0 else pos) for i in range(batch)]  # fmt: skip
        sync(runner.device)
        start = time.perf_counter()
        runner.forward(items).argmax(-1).tolist()
        times.append(time.perf_counter() - start)
    for i in range(batch):
        runner.release(i)
    return 1000 * statistics.median(times[3:])  # the first steps compile and capture


def prefill_tokens_s(runner: ModelRunner, reqs: int, length: int) -> float:
    alloc = SlotAllocator(runner.pool.capacity)
    alloc.reset()
    rng = np.random.default_rng(0)
    rates = []
    for _ in range(3):
        items = [BatchItem(rng.integers(4, 1000, length).tolist(), 0, alloc.alloc(length))
                 for _ in range(reqs)]  # fmt: skip
        sync(runner.device)
        start = time.perf_counter()
        runner.forward(items).argmax(-1).tolist()
        rates.append(reqs * length / (time.perf_counter() - start))
        alloc.reset()
    return max(rates)


def ttft_cached_vs_uncached(engine: LLMEngine, prefix: int, question: int, runs: int) -> dict:
    rng = np.random.default_rng(1)
    pre = tuple(int(t) for t in rng.integers(4, 1000, prefix))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def one(rid: str) -> tuple[float, int]:
        ids = pre + tuple(int(t) for t in rng.integers(4, 1000, question))
        start = time.perf_counter()
        engine.add_request(EngineRequest(rid, prompt_token_ids=ids, params=params))
        while True:
            outs = engine.step()
            if outs:
                elapsed = time.perf_counter() - start
                while engine.has_work:
                    engine.step()
                return elapsed, outs[0].cached_tokens or 0

    one("warm")
    uncached, cached, hits = [], [], []
    for i in range(runs):
        engine.flush_cache()
        uncached.append(one(f"u{i}")[0])
        t, hit = one(f"c{i}")
        cached.append(t)
        hits.append(hit)
    u, c = statistics.median(uncached), statistics.median(cached)
    return {"uncached_ms": 1000 * u, "cached_ms": 1000 * c, "ratio": c / u,
            "cached_tokens": min(hits)}  # fmt: skip


def greedy_vs_transformers(model_dir: Path, device: torch.device, prompts: list[list[int]],
                           max_tokens: int, backend: str) -> dict[str, Any]:  # fmt: skip
    """Greedy tokens from our engine (fp32) and from transformers' generate (fp32)."""
    import transformers

    config = EngineConfig(device=str(device), dtype="float32", attention_backend=backend,
                          kv_capacity_tokens=16384, max_prefill_tokens=256)  # fmt: skip
    engine = load_engine(model_dir, config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ours: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), prompt_token_ids=tuple(p), params=params))
    while engine.has_work:
        for out in engine.step():
            ours[out.request_id].extend(out.token_ids)
    graphs = engine.runner.graphs.replays if engine.runner.graphs else 0
    del engine
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf = hf.to(device).eval()
    theirs = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p], device=device), max_new_tokens=max_tokens,
                              do_sample=False, min_new_tokens=max_tokens)  # fmt: skip
            theirs.append(out[0, len(p) :].tolist())
    del hf
    mine = [ours[str(i)] for i in range(len(prompts))]
    equal = [a == b for a, b in zip(mine, theirs, strict=True)]
    # Where they part (a near-tie between two tokens flips on any rounding difference).
    first_diff = [next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
                  for a, b in zip(mine, theirs, strict=True)]  # fmt: skip
    return {"equal": equal, "all_equal": all(equal), "first_difference": first_diff,
            "ours": mine, "transformers": theirs, "graph_replays": graphs}  # fmt: skip


def kernels_of_one_step(runner: ModelRunner) -> list[str]:
    """Names of the device kernels a mixed step (one decode + one prefill) launches
    that belong to attention (ours: `_decode_*` / `_extend_*`; else SDPA's)."""
    if runner.device.type != "cuda":
        return [f"{runner.attention_backend} (CPU: no kernel profile)"]
    from torch.profiler import ProfilerActivity, profile

    alloc = SlotAllocator(runner.pool.capacity)
    alloc.reset()
    a, b = alloc.alloc(65), alloc.alloc(40)
    runner.forward([BatchItem(list(range(4, 68)), 0, a[:64])])
    items = [BatchItem([9], 64, a), BatchItem(list(range(4, 44)), 0, b)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.forward(items)
        sync(runner.device)
    names = {e.key for e in prof.key_averages()}
    keep = ("_decode", "_extend", "attention", "fmha", "flash", "sdpa", "softmax")
    return sorted(n for n in names if any(k in n.lower() for k in keep))
