"""The GPU check's kernel timings: what the `ops` section (loadtests/gpu/ops.py) and
the baseline share (a timer that synchronises the device, a batch of (cached, new) items
over permuted pool slots, a pool of random K/V), and the baseline itself (issue 32): our
triton decode and extend kernels timed in the same run, on the same pool and batch,
beside other kernels doing the same work.

    sdpa          torch's scaled_dot_product_attention (as torch picks, and with each
                  of its kernels forced: flash, memory-efficient, cuDNN, math) over the
                  same pages gathered into dense [batch, kv heads, tokens, dim] tensors
                  before the clock starts: the attention kernel alone, its best case (a
                  serving engine would pay the gather too, timed as `sdpa+gather`)
    flashinfer    BatchDecodeWithPagedKVCacheWrapper over the pool itself, viewed as
                  one-token pages (our layout), where flashinfer is importable
    vllm          named with whether it imports: its paged kernels take pages of 16+
                  tokens, this pool's are one token, so it is not timed here

Each row gives microseconds per layer, ours / that kernel, and beside them the
bandwidth floor (the K/V bytes the step must read / the measured copy rate) and ours /
floor. The extend rows are compute-bound (4 x 512 new tokens over 1,536): their floor
is loose by design. Imports only torch and the engine (what the GPU machine has).
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from worker.engine.batch import BatchItem
from worker.engine.runtime.attention import make_backend
from worker.engine.runtime.attention.metadata import ReqToTokenTable, Staging, build_step
from worker.engine.runtime.kv_pool import KVPool


def time_us(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median microseconds of `fn` (warm-up calls first: compiles, caches; one on CPU,
    where the kernels run in the interpreter and nothing is compiled)."""
    for _ in range(2 if device.type == "cuda" else 1):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def batch_slots(capacity: int, items: list[tuple[int, int]]) -> list[np.ndarray]:
    """Each (cached tokens, new tokens) item's slots, drawn from the permuted pool."""
    free, used, out = np.random.default_rng(0).permutation(capacity), 0, []
    for start, n in items:
        out.append(free[used : used + start + n].astype(np.int64))
        used += start + n
    return out


def make_batch(device: torch.device, s: dict, items: list[tuple[int, int]], capacity: int):
    """Metadata of a batch of (cached tokens, new tokens) items over permuted slots."""
    batch = [BatchItem([1] * n, start, slots)
             for (start, n), slots in zip(items, batch_slots(capacity, items), strict=True)]  # fmt: skip
    width = max(a + b for a, b in items)
    table = ReqToTokenTable(len(items), width, device)
    return build_step(batch, list(range(len(items))), table, Staging(device)).meta


def random_pool(device: torch.device, s: dict, capacity: int, kv_dtype: torch.dtype | None,
                dtype: torch.dtype) -> KVPool:  # fmt: skip
    pool = KVPool(1, s["kv_heads"], s["dim"], capacity, dtype, device, kv_dtype=kv_dtype)
    g = torch.Generator(device=device).manual_seed(0)
    shape = (capacity, s["kv_heads"], s["dim"])
    pool.write(0, torch.arange(capacity, device=device),
               torch.randn(shape, generator=g, device=device, dtype=dtype),
               torch.randn(shape, generator=g, device=device, dtype=dtype))  # fmt: skip
    return pool


UNAVAILABLE = "not importable on this machine"


def importable(name: str) -> bool:
    """Whether `name` could be imported here, without importing it (a module set to
    None in sys.modules, or refused by an import hook, is not)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _gather(buf: torch.Tensor, slots: list[np.ndarray]) -> torch.Tensor:
    """[batch, kv heads, tokens, dim] of equal-length slot lists (one index_select)."""
    idx = torch.from_numpy(np.stack(slots)).to(buf.device)
    rows = buf.index_select(0, idx.reshape(-1)).view(*idx.shape, *buf.shape[1:])
    return rows.transpose(1, 2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, new: int) -> torch.Tensor:
    """q [batch, heads, new, dim] over k/v [batch, kv heads, tokens, dim]: the last `new`
    tokens attend causally (bottom-right aligned), GQA without repeating K/V."""
    if new == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    from torch.nn.attention.bias import causal_lower_right

    try:  # lets torch pick its flash / efficient kernels
        mask = causal_lower_right(new, k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    except (TypeError, RuntimeError):  # a torch whose CausalBias lacks enable_gqa: a dense mask
        dense = torch.ones(new, k.shape[2], dtype=torch.bool, device=q.device)
        dense = dense.tril(diagonal=k.shape[2] - new)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)


def _flashinfer_decode(pool: Any, q: torch.Tensor, slots: list[np.ndarray]) -> Any:
    """A callable running FlashInfer's paged decode over the pool (page size 1)."""
    import flashinfer

    device = q.device
    work = torch.empty(128 * 2**20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(work, "NHD")
    lengths = torch.tensor([len(s) for s in slots], dtype=torch.int32)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0, dtype=torch.int32)])
    indices = torch.from_numpy(np.concatenate(slots).astype(np.int32))
    last = torch.ones(len(slots), dtype=torch.int32)
    heads, dim = q.shape[1], q.shape[2]
    wrapper.plan(indptr.to(device), indices.to(device), last.to(device), heads,
                 pool.k_buffer.shape[2], dim, 1, data_type=pool.k_buffer.dtype)  # fmt: skip
    pages = (pool.k_buffer[0].unsqueeze(1), pool.v_buffer[0].unsqueeze(1))
    return lambda: wrapper.run(q, pages)


def baseline_step(device: torch.device, s: dict, bandwidth: float) -> dict[str, Any]:
    """Decode at batch x context and extend (n x new over a prefix), ours vs baselines."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, kv_heads, dim = s["heads"], s["kv_heads"], s["dim"]
    b, ctx = s["batch"], s["context"]
    n_ext, new, prefix = s["extend"]
    capacity = max(b * ctx, n_ext * (prefix + new)) + 1
    pool = random_pool(device, s, capacity, None, dtype)
    ours = make_backend("triton", pool.k, pool.v, num_heads=heads, head_dim=dim,
                        sliding_window=None, device=device)  # fmt: skip
    out: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "rows": []}
    for kind, items in (("decode", [(ctx - 1, 1)] * b), ("extend", [(prefix, new)] * n_ext)):
        slots = batch_slots(capacity, items)
        meta = make_batch(device, s, items, capacity)
        t = meta.out_slots.shape[0]
        q = torch.randn(t, heads, dim, device=device, dtype=dtype)
        kv = pool.read(0, meta.out_slots)[0]  # the new tokens' K/V: already in the pool
        got = ours.attend(0, q, kv, kv, meta)
        n_new = items[0][1]
        q4 = q.view(len(items), n_new, heads, dim).transpose(1, 2)
        k4, v4 = _gather(pool.k_buffer[0], slots), _gather(pool.v_buffer[0], slots)
        want = _sdpa(q4, k4, v4, n_new).transpose(1, 2).reshape(t, heads, dim)
        diff = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        kv_bytes = sum(len(x) for x in slots) * kv_heads * dim * 2 * pool.k_buffer.element_size()
        floor = 1e6 * kv_bytes / bandwidth
        us = time_us(lambda q=q, kv=kv, m=meta: ours.attend(0, q, kv, kv, m), device, s["reps"])
        row: dict[str, Any] = {"kind": kind, "items": len(items), "new": n_new,
                               "tokens": len(slots[0]), "ours_us": round(us, 1),
                               "floor_us": round(floor, 1), "ours_over_floor": round(us / floor, 2),
                               "rel_diff_vs_sdpa": diff, "passed": diff <= 3e-2,
                               "baselines": {}}  # fmt: skip
        sdpa_us = time_us(lambda a=(q4, k4, v4, n_new): _sdpa(*a), device, s["reps"])

        def gathered(q4: torch.Tensor = q4, n: int = n_new, sl: list = slots) -> torch.Tensor:
            return _sdpa(q4, _gather(pool.k_buffer[0], sl), _gather(pool.v_buffer[0], sl), n)

        row["baselines"]["sdpa"] = _vs(us, sdpa_us)
        row["sdpa_kernels"] = sdpa_backends(lambda a=(q4, k4, v4, n_new): _sdpa(*a), device,
                                            s["reps"], us)  # fmt: skip
        row["baselines"]["sdpa+gather"] = _vs(us, time_us(gathered, device, s["reps"]))
        row["baselines"]["flashinfer"] = _flashinfer_row(kind, us, pool, q, slots, device, s)
        row["baselines"]["vllm"] = (
            {"skipped": "importable, not timed: its paged kernels take pages of 16+ tokens, "
                        "this pool's are one token"}
            if importable("vllm") else {"skipped": UNAVAILABLE}
        )  # fmt: skip
        out["rows"].append(row)
    out["passed"] = all(r["passed"] for r in out["rows"])
    return out


def sdpa_backends(fn: Any, device: torch.device, reps: int, ours_us: float) -> dict[str, Any]:
    """SDPA timed with each of torch's kernels forced in turn (flash, memory-efficient,
    cuDNN, math): which one the default took is not reported by torch, and ours / SDPA
    means little without it. One that refuses these inputs says why."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out: dict[str, Any] = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):

        def forced(backend: Any = getattr(SDPBackend, name)) -> Any:
            with sdpa_kernel(backend):
                return fn()

        try:
            out[name.lower()] = _vs(ours_us, time_us(forced, device, reps))
        except (RuntimeError, NotImplementedError, ValueError) as exc:  # not for these inputs
            out[name.lower()] = {"skipped": str(exc).splitlines()[0][:200]}
    return out


def _vs(ours_us: float, their_us: float) -> dict[str, Any]:
    return {"us": round(their_us, 1), "ours_over_it": round(ours_us / their_us, 2)}


def _flashinfer_row(kind: str, us: float, pool: Any, q: torch.Tensor, slots: list,
                    device: torch.device, s: dict) -> dict[str, Any]:  # fmt: skip
    if not importable("flashinfer"):
        return {"skipped": UNAVAILABLE}
    if kind != "decode" or device.type != "cuda":
        return {"skipped": "timed for decode on CUDA only"}
    try:
        return _vs(us, time_us(_flashinfer_decode(pool, q, slots), device, s["reps"]))
    except Exception as exc:  # its API moves between releases: say so, keep the table
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def baseline_markdown(r: dict[str, Any]) -> list[str]:
    if not isinstance(r, dict) or "rows" not in r:
        return []
    lines = ["", f"Baseline in the same run ({r['dtype']}, one layer; us per call; "
                 "ours / theirs < 1 is ours faster):", "",
             "| kernel | shape | ours us | floor us | ours / floor | sdpa us | ours / sdpa "
             "| sdpa+gather us | ours / (sdpa+gather) | flashinfer | vllm |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in r["rows"]:
        base = row["baselines"]
        cells = []
        for name in ("sdpa", "sdpa+gather"):
            v = base.get(name, {})
            cells += [str(v.get("us", "")), str(v.get("ours_over_it", v.get("error", "")))]
        for name in ("flashinfer", "vllm"):
            v = base.get(name, {})
            cells.append(f"{v['us']} us, ours / it {v['ours_over_it']}" if "us" in v
                         else v.get("skipped", v.get("error", "")))  # fmt: skip
        shape = f"{row['items']} x {row['new']} new over {row['tokens']}"
        lines.append(f"| {row['kind']} | {shape} | {row['ours_us']} | {row['floor_us']} "
                     f"| {row['ours_over_floor']} | " + " | ".join(cells) + " |")  # fmt: skip
    lines.append("")
    for row in r["rows"]:
        forced = row.get("sdpa_kernels", {})
        each = "; ".join(f"{k} {v['us']} us (ours / it {v['ours_over_it']})" if "us" in v
                         else f"{k} refused" for k, v in forced.items())  # fmt: skip
        lines.append(f"- SDPA with each kernel forced, {row['kind']}: {each or 'not timed'}")
    return [*lines, ""]
