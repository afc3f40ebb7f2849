"""GPU check steps for issue 25: graphs captured at start-up, and decode with overlap
scheduling on and off (loadtests/gpu/gpu_sections.py runs them in each preset section).

- `startup_capture`: what the runner captured before any traffic (every decode bucket
  up to its running-request limit, each one's seconds), and after the section's
  decode cells, that no graph was captured during them (`late_captures == 0`).
- `overlap_decode`: the engine itself (scheduler, sampler, postprocess) decoding
  `batch` requests of `context` prompt tokens with `overlap_schedule` on and off,
  interleaved, on the same runner: ms per decode step, tokens/s, and whether the
  greedy tokens are equal. On a GPU the overlapped engine's host work runs while the
  device computes, so its step should approach the device's own time.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch


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
