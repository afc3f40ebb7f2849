"""The GPU check's `ops` section: issue 25's kernels, fused ops, sampler and FP8 KV
cache, each timed on the device next to its reference, with its correctness check.

    baseline    our decode and extend kernels beside torch's SDPA over the same pages
                (and FlashInfer's / vLLM's where importable), with the bandwidth floor
                (loadtests/gpu/kernels.py)
    decode      the decode attention kernel at batch 64 x context 2,048 (Llama-3.2-1B's
                attention: 32 heads, 8 KV heads, dim 64), bf16 and fp8 pools: us per
                layer against the floor = the K/V bytes it must read / the measured
                copy bandwidth; and equal to SDPA over the same pool
    table       block sizes timed around the kernel table's entry for head dim 64
                (decode and extend); the fastest are printed as RADIX_KERNEL_TABLE
                rows (worker/engine/runtime/attention/kernel_table.py)
    fused       add+RMSNorm, RoPE+KV store, SiLU*mul at a decode batch's shapes:
                eager torch vs the triton kernel, us each, and their max difference
    sampler     top-k/top-p over Llama 3's vocabulary (128,256) at batch 64: the full
                sort (the old path) vs the thresholds, ms each, and the kept sets

`--quick` (CPU, the kernels in triton's interpreter) runs it all at toy sizes.
Imports only torch, triton, numpy and the engine (what the GPU machine has).
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import torch

from loadtests.gpu.kernels import baseline_step, make_batch, random_pool, time_us
from worker.engine.runtime.attention import kernel_table, make_backend, triton_kernels
from worker.engine.runtime.fused_kernels import TritonOps
from worker.engine.runtime.fused_ops import TorchOps
from worker.engine.runtime.kv_pool import KVPool
from worker.engine.runtime.threshold_filter import filtered_probs, sorted_reference

FULL = dict(batch=64, context=2048, heads=32, kv_heads=8, dim=64, hidden=2048, inter=8192,
            vocab=128_256, extend=(4, 512, 1024), reps=20)  # fmt: skip
QUICK = dict(batch=3, context=40, heads=4, kv_heads=2, dim=32, hidden=64, inter=128,
             vocab=1000, extend=(2, 20, 10), reps=1)  # fmt: skip
FP8 = torch.float8_e4m3fn


def decode_step(device: torch.device, s: dict, bandwidth: float) -> dict[str, Any]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, ctx = s["batch"], s["context"]
    capacity = b * ctx + 1
    meta = make_batch(device, s, [(ctx - 1, 1)] * b, capacity)
    q = torch.randn(b, s["heads"], s["dim"], device=device, dtype=dtype)
    out: dict[str, Any] = {"batch": b, "context": ctx, "dtype": str(dtype).removeprefix("torch.")}
    for name, kv_dtype in (
        ("bf16" if dtype == torch.bfloat16 else "fp32", None),
        ("fp8_e4m3", FP8),
    ):
        pool = random_pool(device, s, capacity, kv_dtype, dtype)
        kw = dict(num_heads=s["heads"], head_dim=s["dim"], sliding_window=None, device=device,
                  kv_scales=pool.all_scales())  # fmt: skip
        triton = make_backend("triton", pool.k, pool.v, **kw)
        sdpa = make_backend("sdpa", pool.k, pool.v, **kw)
        k_new = pool.read(0, meta.out_slots)[0]
        got = triton.attend(0, q, k_new, k_new, meta)
        want = sdpa.attend(0, q, k_new, k_new, meta)
        diff = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        us = time_us(lambda t=triton, k=k_new: t.attend(0, q, k, k, meta), device, s["reps"])
        kv_bytes = b * ctx * s["kv_heads"] * s["dim"] * 2 * pool.k_buffer.element_size()
        floor = 1e6 * kv_bytes / bandwidth
        out[name] = {"us_per_layer": round(us, 1), "floor_us": round(floor, 1),
                     "ratio": round(us / floor, 2), "kv_bytes": kv_bytes,
                     "rel_diff_vs_sdpa": diff, "passed": diff <= 3e-2}  # fmt: skip
    names = [k for k in out if isinstance(out[k], dict)]
    out["fp8_speedup"] = round(out[names[0]]["us_per_layer"] / out[names[1]]["us_per_layer"], 2)
    out["fp8_vs"] = names[0]
    return out


def _candidates(quick: bool) -> tuple[list[dict], list[dict]]:
    decode = [dict(decode_block_n=n, decode_stages=st, decode_warps=w, min_split_len=m)
              for n, st, w, m in ((32, 2, 4, 256), (64, 3, 4, 256), (64, 4, 4, 256),
                                  (128, 3, 8, 256), (64, 3, 4, 128), (64, 3, 4, 512))]  # fmt: skip
    extend = [dict(extend_rows=r, extend_block_n=n, extend_stages=st, extend_warps=w)
              for r, n, st, w in ((64, 64, 2, 4), (128, 64, 2, 8), (64, 32, 3, 4),
                                  (128, 32, 3, 8))]  # fmt: skip
    return (decode[:1], extend[:1]) if quick else (decode, extend)


def table_step(device: torch.device, s: dict, quick: bool) -> dict[str, Any]:
    """Time candidate block sizes for this head dim and dtype; the winners as a row."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size = torch.empty((), dtype=dtype).element_size()
    base = kernel_table.blocks_for(s["dim"], size)
    b, ctx = s["batch"], s["context"]
    n_ext, new, prefix = s["extend"]
    capacity = max(b * ctx, n_ext * (prefix + new)) + 1
    pool = random_pool(device, s, capacity, None, dtype)
    backend = make_backend("triton", pool.k, pool.v, num_heads=s["heads"], head_dim=s["dim"],
                           sliding_window=None, device=device)  # fmt: skip
    dec_meta = make_batch(device, s, [(ctx - 1, 1)] * b, capacity)
    ext_meta = make_batch(device, s, [(prefix, new)] * n_ext, capacity)
    original = triton_kernels._blocks
    timings: dict[str, list] = {"decode": [], "extend": []}
    best = base
    try:
        for kind, meta in (("decode", dec_meta), ("extend", ext_meta)):
            t = meta.out_slots.shape[0]
            q = torch.randn(t, s["heads"], s["dim"], device=device, dtype=dtype)
            kv = pool.read(0, meta.out_slots)[0]
            for fields in _candidates(quick)[0 if kind == "decode" else 1]:
                blocks = replace(best, **fields)
                triton_kernels._blocks = lambda _q, b=blocks: b  # type: ignore[assignment]
                us = time_us(lambda q=q, kv=kv, m=meta: backend.attend(0, q, kv, kv, m),
                             device, s["reps"])  # fmt: skip
                timings[kind].append(fields | {"us": round(us, 1)})
            winner = min(timings[kind], key=lambda r: r["us"])
            best = replace(best, **{k: v for k, v in winner.items() if k != "us"})
    finally:
        triton_kernels._blocks = original
    row = {"head_dim": s["dim"], "element_size": size, **asdict(best)}
    return {"table_entry_now": asdict(base), "timings": timings, "fastest_row": row}


def fused_step(device: torch.device, s: dict) -> dict[str, Any]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t, hidden, inter = s["batch"], s["hidden"], s["inter"]
    heads, kv_heads, dim = s["heads"], s["kv_heads"], s["dim"]
    g = torch.Generator(device=device).manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    x, res, w = rand(t, hidden), rand(t, hidden), rand(hidden)
    gate_up = rand(t, 2 * inter)
    gate, up = gate_up.chunk(2, dim=-1)
    qkv = rand(t, (heads + 2 * kv_heads) * dim)
    freqs = torch.rand(t, 1, dim // 2, generator=g, device=device) * 100
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    slots = torch.randperm(4 * t, device=device)[:t]
    pool = KVPool(1, kv_heads, dim, 4 * t, dtype, device)
    split = (heads + kv_heads) * dim

    def rope(ops: Any) -> tuple[torch.Tensor, torch.Tensor]:
        y = qkv.clone()
        qk = y[:, :split].view(t, heads + kv_heads, dim)
        ops.rope_store(qk, y[:, split:].view(t, kv_heads, dim), cos, sin, pool, 0, slots, heads)
        return qk, pool.k_buffer[0, slots]

    cases = {
        "add_rmsnorm": lambda ops: ops.add_rmsnorm(x, res, w, 1e-5)[0],
        "silu_mul": lambda ops: ops.silu_mul(gate, up),
        "rope_store": lambda ops: torch.cat([a.reshape(t, -1) for a in rope(ops)], dim=1),
    }
    eager, fused = TorchOps(), TritonOps()
    out: dict[str, Any] = {"tokens": t, "dtype": str(dtype).removeprefix("torch.")}
    for name, fn in cases.items():
        want, got = fn(eager).float(), fn(fused).float()
        diff = float((got - want).abs().max() / want.abs().max())
        e_us = time_us(lambda f=fn: f(eager), device, s["reps"])
        f_us = time_us(lambda f=fn: f(fused), device, s["reps"])
        out[name] = {"eager_us": round(e_us, 1), "fused_us": round(f_us, 1),
                     "speedup": round(e_us / f_us, 2), "rel_diff": diff,
                     "passed": diff <= (2e-2 if dtype == torch.bfloat16 else 1e-4)}  # fmt: skip
    return out


def sampler_step(device: torch.device, s: dict) -> dict[str, Any]:
    b, vocab = s["batch"], s["vocab"]
    g = torch.Generator(device=device).manual_seed(2)
    logits = torch.randn(b, vocab, generator=g, device=device) * 3
    temp = torch.full((b,), 0.8, device=device)
    top_p = torch.where(torch.arange(b, device=device) % 2 == 0, 0.9, 1.0)
    top_k = torch.where(torch.arange(b, device=device) % 4 == 1, 50.0, float(vocab))
    min_p = torch.zeros(b, device=device)
    ref = lambda: sorted_reference(logits, temp, top_k, top_p, min_p)  # noqa: E731
    thr = lambda: filtered_probs(logits, temp, top_k, top_p, None, max_k=50)  # noqa: E731
    kept_ref, kept_thr = ref() > 0, thr() > 0
    exact = sorted_reference(logits.double(), temp.double(), top_k.double(), top_p.double(),
                             min_p.double()) > 0  # fmt: skip
    off_sort = int((kept_ref ^ exact).any(dim=1).sum())
    off_thr = int((kept_thr ^ exact).any(dim=1).sum())
    sort_ms = time_us(ref, device, s["reps"]) / 1000
    thr_ms = time_us(thr, device, s["reps"]) / 1000
    # Both sum fp32 probabilities (in another order): at the top_p edge either may be
    # off by a token against fp64; the thresholds must be no worse than the sort.
    return {"batch": b, "vocab": vocab, "sort_ms": round(sort_ms, 3),
            "threshold_ms": round(thr_ms, 3), "speedup": round(sort_ms / thr_ms, 2),
            "rows_whose_kept_set_differs": int((kept_ref ^ kept_thr).any(dim=1).sum()),
            "rows_off_fp64_sort": off_sort, "rows_off_fp64_threshold": off_thr,
            "passed": off_thr <= off_sort}  # fmt: skip


def ops_section(rec: Any, device: torch.device, quick: bool) -> None:
    from loadtests.gpu import bench as gb

    s = QUICK if quick else FULL
    bw = rec.step("bandwidth", lambda: gb.bandwidth(device))
    measured = bw["measured_copy_bytes_s"] if isinstance(bw, dict) and "error" not in bw else 1e12
    rec.step("decode", lambda: decode_step(device, s, measured), need_s=10)
    rec.step("baseline", lambda: baseline_step(device, s, measured), need_s=10)
    rec.step("table", lambda: table_step(device, s, quick), need_s=20)
    rec.step("fused", lambda: fused_step(device, s), need_s=10)
    rec.step("sampler", lambda: sampler_step(device, s), need_s=5)
