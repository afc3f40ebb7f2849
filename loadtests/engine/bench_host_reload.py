"""Engine on CPU: reloading N cached tokens from the host tier vs prefilling them again.

Two engines on the same random-weight model (tiny_model's `bench` preset: hidden 512,
8 layers), the same small device pool, one with a host tier and one without. Per run:
prompt A (N tokens + a 16-token tail), then a filler prompt that pushes A off the
device pool, then A again, timed from submit to first token. With the tier A's N
tokens are loaded from host memory and only the tail is computed; without it the
whole prompt is prefilled again. Runs interleave (tier, no tier, tier, ...) so machine
noise hits both alike; medians. This is the measured basis of the simulator's load
price on one machine (a CPU: host and "device" are the same memory here; on a GPU the
load crosses PCIe, see `gpu-check`'s host-tier section).

    python -m loadtests host-reload [--tokens 512,2048] [--runs 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.runtime.load import load_engine
from worker.engine.types import EngineRequest, SamplingParams
from worker.models.tiny_model import PRESETS, make_tiny_model

TAIL = 16


def _ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(4, 1000) for _ in range(n))


def _first_token_s(engine: LLMEngine, rid: str, prompt: tuple[int, ...]) -> tuple[float, int]:
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(EngineRequest(rid, prompt_token_ids=prompt, params=params))
    while True:
        outs = engine.step()
        if outs:
            elapsed = time.perf_counter() - start
            while engine.has_work:
                engine.step()
            return elapsed, outs[0].cached_tokens


def one_run(engine: LLMEngine, n: int, seed: int) -> tuple[float, int]:
    rng = random.Random(seed)
    a = _ids(rng, n + TAIL)
    _first_token_s(engine, f"a{seed}", a)
    _first_token_s(engine, f"f{seed}", _ids(rng, n + TAIL))  # A leaves the device pool
    return _first_token_s(engine, f"again{seed}", a)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", default="512,2048", help="cached prompt lengths N")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def main(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sizes = [int(x) for x in args.tokens.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "bench-llama", **PRESETS["bench"])
        shape = PRESETS["bench"]
        print(
            f"model: random-weight Llama, hidden {shape['hidden_size']}, "
            f"{shape['num_layers']} layers, CPU, torch threads {torch.get_num_threads()}"
        )
        print("| N cached | reload (ms) | prefill (ms) | reload / prefill | cached tokens |")
        print("|---:|---:|---:|---:|---:|")
        for n in sizes:
            # The pool holds one prompt at a time; the tier holds plenty.
            common = {"kv_capacity_tokens": n + 2 * TAIL + 64, "device": "cpu",
                      "max_prefill_tokens": 8192, "evict_batch_tokens": 64}  # fmt: skip
            tier = load_engine(model_dir, EngineConfig(host_cache_tokens=8 * n, **common))
            plain = load_engine(model_dir, EngineConfig(**common))
            one_run(tier, n, 10_000)  # warm-up: first-call allocations
            one_run(plain, n, 10_000)
            reload, prefill, cached = [], [], 0
            for run in range(args.runs):
                t, cached = one_run(tier, n, run)
                reload.append(t)
                prefill.append(one_run(plain, n, run)[0])
            r, p = statistics.median(reload), statistics.median(prefill)
            print(f"| {n} | {r * 1e3:.1f} | {p * 1e3:.1f} | {r / p:.3f} | {cached} |", flush=True)
            runner = tier.runner
            bw = runner.host_load_bytes_per_s
            print(
                f"  host -> device copies: {bw / 1e9:.2f} GB/s measured "
                f"({runner.kv_bytes_per_token} bytes a token: "
                f"{runner.kv_bytes_per_token / bw * 1e6:.3f} us a token); "
                f"prefill {p / (n + TAIL) * 1e6:.1f} us a token (whole prompt, median)"
            )
    return 0
