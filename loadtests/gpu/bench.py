"""Measurements for the GPU check (loadtests/gpu/check.py), one model at a time.

Imports only torch, numpy, transformers and the engine: the GPU machine has no
pydantic or redis. Every timing synchronises the device; decode steps are timed as
the engine runs them (build the step, forward, argmax, ids back to the host).

The preset sections (loadtests/gpu/sections.py) also run issue 25's steps: graphs
captured at start-up, decode with overlap scheduling on and off, and one mixed step
with piecewise graphs:

- `startup_capture`: what the runner captured before any traffic (every decode bucket
  up to its running-request limit, each one's seconds), and after the section's
  decode cells, that no graph was captured during them (`late_captures == 0`).
- `overlap_decode`: the engine itself (scheduler, sampler, postprocess) decoding
  `batch` requests of `context` prompt tokens with `overlap_schedule` on and off,
  interleaved, on the same runner: ms per decode step, tokens/s, and whether the
  greedy tokens are equal. On a GPU the overlapped engine's host work runs while the
  device computes, so its step should approach the device's own time.
- `piecewise_mixed`: one mixed step (decodes + a prefill chunk) with piecewise graphs
  (worker/engine/runtime/piecewise_graphs.py) and eagerly, on the preset's runner:
  `decodes` sequences at `context` tokens decoding next to one
  prefill chunk of `chunk` tokens, through `runner.forward` (metadata, forward,
  logits), timed side by side, interleaved: ms per step each way, the speedup, the
  seconds to capture the step's one token bucket (every piece, its warm-ups and a
  whole warm step), that no capture happened while timing, and the logits' largest
  difference (GEMMs over the padded bucket may round differently in bf16: the check
  passes when the difference is within a tolerance and nothing was captured late). On CPU (`--quick`) the graphs are emulated (run eagerly on the static
  buffers): its timings only show the path runs. `argmax_equal` is reported, not
  required: with random weights a near tie may flip in bf16.
  `host_ops`: the torch (aten) ops the host dispatches for that step, eager and with
  the pieces (a replay counts as one; on CPU the emulated pieces count as one each,
  as their replay would), views left out. Triton kernels (the attention, and the fused
  ops with the triton backend) are not aten ops: not counted either way.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from worker.engine.allocator import SlotAllocator
from worker.engine.batch import BatchItem
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.runtime.load import load_engine
from worker.engine.runtime.piecewise_graphs import PiecewiseGraphs
from worker.engine.runtime.runner import ModelRunner
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


def startup_capture(runner: Any) -> dict[str, Any]:
    graphs = runner.graphs
    if graphs is None:
        return {"graphs": "none (eager runner)", "seconds": 0.0}
    return {"seconds": round(runner.graph_capture_s, 3), "captures": graphs.captures,
            "buckets_s": {str(b): round(s, 3) for b, s in graphs.capture_seconds.items()}}  # fmt: skip


def no_capture_in_traffic(runner: Any) -> dict[str, Any]:
    graphs = runner.graphs
    late = graphs.late_captures if graphs is not None else 0
    replays = graphs.replays if graphs is not None else 0
    return {"late_captures": late, "replays": replays, "passed": late == 0}


def overlap_decode(runner: Any, model_dir: Path, batch: int, context: int, steps: int,
                   rounds: int = 2) -> dict[str, Any]:  # fmt: skip
    from shared.tokens.tokenizer import Tokenizer
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine
    from worker.engine.runtime.sampler import TorchSampler
    from worker.engine.types import EngineRequest, SamplingParams

    device = runner.device
    tokenizer = Tokenizer.from_dir(model_dir)
    vocab = min(runner.config.vocab_size, 1000)

    def one(overlap: bool, tag: str) -> tuple[float, list[list[int]]]:
        config = EngineConfig(device=str(device), max_running_requests=batch,
                              max_prefill_tokens=max(8192, context), overlap_schedule=overlap,
                              debug_checks=False)  # fmt: skip
        engine = LLMEngine(runner, tokenizer, config, TorchSampler(device))
        params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
        for i in range(batch):
            ids = [4 + (i * 131 + j * 7) % (vocab - 4) for j in range(context)]
            engine.add_request(EngineRequest(f"{tag}{i}", prompt_token_ids=ids, params=params))
        tokens: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(batch)}

        def step() -> None:
            for out in engine.step():
                tokens[out.request_id] += out.token_ids

        while not (len(engine.last_batch.items) == batch
                   and all(len(it.input_ids) == 1 for it in engine.last_batch.items)):  # fmt: skip
            step()
        step()  # the first all-decode step: in steady state from here
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ms = (time.perf_counter() - start) * 1e3 / steps
        while engine.has_work:
            step()
        return ms, [tokens[f"{tag}{i}"] for i in range(batch)]

    runs: dict[bool, list[float]] = {True: [], False: []}
    outputs: dict[bool, list[list[int]]] = {}
    for r in range(rounds):
        for overlap in (False, True):
            ms, outputs[overlap] = one(overlap, f"{r}{int(overlap)}-")
            runs[overlap].append(ms)
    on, off = statistics.median(runs[True]), statistics.median(runs[False])
    return {"batch": batch, "context": context, "steps": steps,
            "overlap_ms": round(on, 3), "in_order_ms": round(off, 3),
            "overlap_tokens_s": round(batch * 1e3 / on, 1),
            "in_order_tokens_s": round(batch * 1e3 / off, 1),
            "speedup": round(off / on, 3), "greedy_equal": outputs[True] == outputs[False],
            "passed": outputs[True] == outputs[False]}  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _CountOps(TorchDispatchMode):
    """Counts the non-view aten ops dispatched while active (`paused`: not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.paused and not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def host_ops(runner: Any, batch: list[BatchItem], pieces: PiecewiseGraphs | None) -> int:
    """aten ops one `runner.forward(batch)` dispatches (module docstring)."""
    counter = _CountOps()
    saved = {}
    if pieces is not None and pieces.emulate:  # each emulated piece stands for one replay
        for bucket in pieces._buckets.values():
            saved[bucket] = bucket.pieces
            bucket.pieces = [_as_one(counter, piece) for piece in bucket.pieces]
    before, runner.piecewise = runner.piecewise, pieces
    try:
        with counter:
            runner.forward(batch)
    finally:
        runner.piecewise = before
        for bucket, fns in saved.items():
            bucket.pieces = fns
    # A real replay is no aten op: one each, as the emulated ones count.
    replays = pieces.num_layers + 1 if pieces is not None and not pieces.emulate else 0
    return counter.count + replays


def _as_one(counter: _CountOps, piece: Any) -> Any:
    def run() -> None:
        counter.count += 1
        counter.paused = True
        try:
            piece()
        finally:
            counter.paused = False

    return run


def mixed_batch(decodes: int, context: int, chunk: int, vocab: int) -> list[BatchItem]:
    """`decodes` one-token items over `context` cached tokens and one `chunk`-token
    prefill over a 16-token prefix; every slot distinct. No seq_id: each step uploads
    its rows whole, the same work both ways."""
    rng = np.random.default_rng(0)
    items, slot = [], 0
    for start, n in [(context, 1)] * decodes + [(16, chunk)]:
        ids = rng.integers(4, vocab, n).tolist()
        items.append(BatchItem(ids, start, np.arange(slot, slot + start + n)))
        slot += start + n
    return items


def piecewise_mixed(runner: Any, decodes: int, context: int, chunk: int,
                    reps: int) -> dict[str, Any]:  # fmt: skip
    device = runner.device
    tokens = decodes + chunk
    if runner.pool.capacity < decodes * (context + 1) + 16 + chunk:
        raise RuntimeError("pool too small for the mixed step")
    batch = mixed_batch(decodes, context, chunk, min(runner.config.vocab_size, 1000))
    emulate = device.type != "cuda"
    pieces = PiecewiseGraphs(runner.model, runner.pool, runner.backend, runner.table, tokens,
                             emulate=emulate, buckets=(tokens,))  # fmt: skip
    capture_s = pieces.capture_all()
    before = runner.piecewise
    times: dict[bool, list[float]] = {True: [], False: []}
    logits: dict[bool, torch.Tensor] = {}
    warm = 2 if device.type == "cuda" else 0  # the eager path's compiles; none on CPU
    try:
        for rep in range(reps + warm):
            for on in (True, False):
                runner.piecewise = pieces if on else None
                _sync(device)
                start = time.perf_counter()
                logits[on] = runner.forward(batch)
                _sync(device)
                if rep >= warm:
                    times[on].append(time.perf_counter() - start)
    finally:
        runner.piecewise = before
    on_ms, off_ms = (1e3 * statistics.median(times[k]) for k in (True, False))
    ops = {"eager": host_ops(runner, batch, None), "piecewise": host_ops(runner, batch, pieces)}
    diff = (logits[True] - logits[False]).abs().max().item()
    argmax_equal = bool(torch.equal(logits[True].argmax(-1), logits[False].argmax(-1)))
    tolerance = 1e-4 if runner.dtype == torch.float32 else 0.25  # bf16 logits, random weights
    return {"decodes": decodes, "context": context, "chunk": chunk, "tokens": tokens,
            "graphs": "emulated" if emulate else "cuda", "capture_s": round(capture_s, 3),
            "pieces": pieces.num_layers + 1, "piecewise_ms": round(on_ms, 3),
            "eager_ms": round(off_ms, 3), "speedup": round(off_ms / on_ms, 3),
            "host_ops": ops, "replays": pieces.replays, "late_captures": pieces.late_captures,
            "max_abs_diff": diff, "argmax_equal": argmax_equal,
            "passed": pieces.late_captures == 0 and diff <= tolerance}  # fmt: skip
