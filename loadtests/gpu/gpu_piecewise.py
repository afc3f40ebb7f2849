"""GPU check step for issue 25: one mixed step (decodes + a prefill chunk) with piecewise
graphs (worker/engine/runtime/piecewise_graphs.py) and eagerly, on the preset's runner.

- `piecewise_mixed`: `decodes` sequences at `context` tokens decoding next to one
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
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from worker.engine.batch import BatchItem
from worker.engine.runtime.piecewise_graphs import PiecewiseGraphs


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
