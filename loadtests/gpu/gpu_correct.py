"""The GPU check's correctness section: our kernels vs SDPA on the device, and host
synchronisations per engine step (loadtests/gpu/gpu_syncs.py).

The kernel comparison is the CPU test's (tests/worker/engine/test_attention_backends.py)
at GPU sizes: random batches mixing decodes over long contexts, prefix hits of random
lengths and fresh or chunked prefills, slots drawn at random from the pool, for GQA
ratios 1 / 4 / 7 and head dims 64 / 128, in fp32 (max abs diff <= 1e-3) and bf16
(<= 3% of the largest output).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.engine.batch import BatchItem
from worker.engine.runtime.attention import make_backend
from worker.engine.runtime.attention.metadata import ReqToTokenTable, Staging, build_step


def random_batch(
    rng: np.random.Generator, capacity: int, n_items: int, scale: int
) -> list[BatchItem]:
    free = rng.permutation(capacity)
    items, used = [], 0
    for _ in range(n_items):
        kind = rng.choice(["decode", "prefix_hit", "prefill"])
        if kind == "decode":
            start, n = int(rng.integers(1, 40 * scale)), 1
        elif kind == "prefix_hit":
            start, n = int(rng.integers(1, 20 * scale)), int(rng.integers(2, 10 * scale))
        else:
            start, n = 0, int(rng.integers(1, 10 * scale))
        slots = free[used : used + start + n].astype(np.int64)
        used += start + n
        items.append(BatchItem(list(rng.integers(0, 100, n)), start, slots))
    return items


def compare_once(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                 head_dim: int, seed: int, scale: int) -> float:  # fmt: skip
    """Max abs difference triton - sdpa on one random batch (relative for bf16)."""
    rng = np.random.default_rng(seed)
    capacity = 700 * scale
    batch = random_batch(rng, capacity, n_items=8, scale=scale)
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    k_buf, v_buf = rand(capacity + 1, kv_heads, head_dim), rand(capacity + 1, kv_heads, head_dim)
    kw = dict(num_heads=heads, head_dim=head_dim, sliding_window=None, device=device)
    sdpa = make_backend("sdpa", [k_buf], [v_buf], **kw)
    triton = make_backend("triton", [k_buf], [v_buf], **kw)
    table = ReqToTokenTable(4, 40 * scale + 64, device)
    inputs = build_step(batch, list(range(len(batch))), table, Staging(device))
    meta = inputs.meta
    t = inputs.input_ids.shape[0]
    q, k, v = rand(t, heads, head_dim), rand(t, kv_heads, head_dim), rand(t, kv_heads, head_dim)
    k_buf.index_copy_(0, meta.out_slots, k)
    v_buf.index_copy_(0, meta.out_slots, v)
    want = sdpa.attend(0, q, k, v, meta).float()
    got = triton.attend(0, q, k, v, meta).float()
    diff = (got - want).abs().max().item()
    return diff / want.abs().max().item() if dtype != torch.float32 else diff


def kernels_vs_sdpa(device: torch.device, quick: bool) -> dict[str, Any]:
    scale = 1 if quick or device.type != "cuda" else 40  # contexts up to ~1,600 on a GPU
    dtypes = (torch.float32,) if device.type != "cuda" else (torch.float32, torch.bfloat16)
    # (heads, kv_heads, head_dim): GQA 1, 4 and 7 (7: Qwen2.5-0.5B's 14/2), dims 64 and 128.
    full = ((4, 4, 128), (16, 4, 64), (14, 2, 64), (28, 4, 128))
    shapes = ((2, 2, 64), (8, 2, 128), (7, 1, 64)) if quick else full
    cases = []
    for dtype in dtypes:
        for heads, kv_heads, head_dim in shapes:
            diff = compare_once(device, dtype, heads, kv_heads, head_dim, seed=heads + head_dim,
                                scale=scale)  # fmt: skip
            limit = 1e-3 if dtype == torch.float32 else 3e-2
            cases.append({"dtype": str(dtype).removeprefix("torch."), "heads": heads,
                          "kv_heads": kv_heads, "head_dim": head_dim, "max_abs_diff": diff,
                          "limit": limit, "ok": diff <= limit})  # fmt: skip
    return {"cases": cases, "passed": all(c["ok"] for c in cases)}


def host_syncs(device: torch.device) -> dict[str, Any]:
    """Syncs per engine step on the tiny model (the count does not depend on size)."""
    from loadtests.gpu.gpu_syncs import SyncCounter, syncs_per_step
    from worker.engine.config import EngineConfig
    from worker.engine.runtime.load import load_engine
    from worker.models.tiny_model import make_tiny_model

    model_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="gpu-check-syncs-")))
    backend = "triton" if device.type == "cuda" else "sdpa"
    config = EngineConfig(device=str(device), kv_capacity_tokens=4096, max_prefill_tokens=16,
                          attention_backend=backend)  # fmt: skip
    engine = load_engine(model_dir, config)
    counter = SyncCounter(device)
    with counter:
        result = syncs_per_step(engine, counter)
    how = "CUDA sync debug mode" if device.type == "cuda" else "counted calls (CPU)"
    return result | {"how": how, "backend": backend}


def correctness_section(rec: Any, device: torch.device, quick: bool) -> None:
    rec.step("kernels", lambda: kernels_vs_sdpa(device, quick), need_s=10)
    rec.step("syncs", lambda: host_syncs(device), need_s=10)
