"""Replay the shared prefix-cache trace through RadixCache and NoCache side by side (and
`host-reload`, HOST_RELOAD below: reloading host-tier tokens vs prefilling them).

    python -m loadtests radix-cache [--n-requests 20000] [--trace-module PATH]

The trace (`../shared/bench/radix_trace.py` next to the repository by default) is a
deterministic LLM-serving-shaped request stream; its docstring fixes the replay loop,
which `replay()` follows exactly: match, lock, evict the shortfall plus
`evict_extra_tokens` when the allocator runs short, allocate, insert, unlock.

Only the cache operations are timed: tokens are materialised in chunks of requests
outside the timed region. Throughput is requests over the summed time of the chunk
loops (which include the per-op timers, so it is slightly conservative), both in
wall-clock time and in this process's CPU time (the figure to trust on a shared,
loaded machine, where wall time includes waiting for a core). Memory is a
second, untimed replay under tracemalloc (peak traced bytes: the cache, the allocator
and one chunk of tokens). If `sglang` is importable its RadixCache is replayed too.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import importlib.util
import pstats
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from loadtests.engine.bench_engine import random_ids, ttft
from loadtests.kit import Command
from worker.engine.allocator import SlotAllocator
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.prefix_cache import NoCache
from worker.engine.radix_cache import RadixCache
from worker.engine.runtime.load import load_engine
from worker.models.tiny_model import PRESETS, make_tiny_model

DEFAULT_TRACE = Path(__file__).resolve().parents[3] / "shared" / "bench" / "radix_trace.py"
SGLANG_REFERENCE = "SGLang 0.5.23 Python RadixCache, same trace, same machine class: 11,300 req/s, match p50 22 µs, hit rate 0.9046 (DESIGN.md; not measured here)"
CHUNK = 256


def load_trace_module(path: Path) -> ModuleType:
    if not path.is_file():
        sys.exit(
            f"trace module not found: {path}\n"
            "This benchmark replays ../shared/bench/radix_trace.py (kept next to the repository, "
            "not in it). Pass --trace-module PATH to point at a copy."
        )
    spec = importlib.util.spec_from_file_location("radix_trace", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["radix_trace"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def chunks(trace, n: int) -> Iterator[list[tuple[np.ndarray, int]]]:
    """(full tokens, prompt length) per request, CHUNK requests at a time."""
    for start in range(0, n, CHUNK):
        yield [
            (trace.full_tokens(i), trace.prompt_len[i]) for i in range(start, min(n, start + CHUNK))
        ]


@dataclass
class Result:
    name: str
    seconds: float
    cpu_seconds: float
    n: int
    hit_rate: float
    match_ns: np.ndarray
    insert_ns: np.ndarray
    evict_ns: np.ndarray
    evict_tokens: int
    peak_mb: float = float("nan")

    def row(self) -> str:
        def pct(a: np.ndarray, q: float) -> str:
            return f"{np.percentile(a, q) / 1e3:.1f}" if len(a) else "-"

        return (
            f"| {self.name} | {self.n / self.seconds:,.0f} | {self.n / self.cpu_seconds:,.0f} "
            f"| {self.hit_rate:.4f} "
            f"| {pct(self.match_ns, 50)} / {pct(self.match_ns, 99)} "
            f"| {pct(self.insert_ns, 50)} / {pct(self.insert_ns, 99)} "
            f"| {len(self.evict_ns)}: {pct(self.evict_ns, 50)} / {pct(self.evict_ns, 99)} "
            f"| {self.peak_mb:.1f} |"
        )


def replay(name: str, make: Callable[[SlotAllocator], object], trace, params, n: int) -> Result:
    """The trace's reference replay loop, timing only the cache operations."""
    allocator = SlotAllocator(params.capacity_tokens)
    cache = make(allocator)
    extra = params.evict_extra_tokens
    match_ns = np.zeros(n, dtype=np.int64)
    insert_ns = np.zeros(n, dtype=np.int64)
    evict_ns: list[int] = []
    evicted = hit = prompt_total = 0
    seconds = cpu_seconds = 0.0
    clock = time.perf_counter_ns
    i = 0
    for chunk in chunks(trace, n):
        t_chunk, cpu_chunk = time.perf_counter(), time.process_time()
        for full, prompt_len in chunk:
            t0 = clock()
            m = cache.match_prefix(full[:prompt_len])
            t1 = clock()
            cache.lock(m.last_node)
            need = len(full) - m.prefix_len
            if allocator.available < need:
                t2 = clock()
                evicted += cache.evict(need - allocator.available + extra)
                evict_ns.append(clock() - t2)
            new = allocator.alloc(need)
            if new is None:
                raise RuntimeError(f"request {i}: {need} slots do not fit even after eviction")
            value = np.concatenate((m.slots, new))
            t3 = clock()
            cache.insert(full, value, cached_len=m.prefix_len)
            insert_ns[i] = clock() - t3
            cache.unlock(m.last_node)
            match_ns[i] = t1 - t0
            hit += m.prefix_len
            prompt_total += prompt_len
            i += 1
        seconds += time.perf_counter() - t_chunk
        cpu_seconds += time.process_time() - cpu_chunk
    # Untimed: the replay must leave a consistent cache and no leaked slot.
    cache.check_integrity()
    allocator.check_integrity(owned=cache.cached_slots())
    return Result(
        name,
        seconds,
        cpu_seconds,
        n,
        hit / prompt_total,
        match_ns,
        insert_ns,
        np.array(evict_ns),
        evicted,
    )


def sglang_factory() -> Callable[[SlotAllocator], object] | None:
    """SGLang's RadixCache behind our interface, when sglang is installed (it is optional)."""
    try:
        import sglang.srt.mem_cache.radix_cache as sg  # noqa: F401
    except ImportError:
        return None
    print("sglang is importable, but no adapter for its RadixCache API is written: skipped")
    return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace-module", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--n-requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--page-size", type=int, default=None, help="override the trace's page_size")
    p.add_argument("--no-memory", action="store_true", help="skip the tracemalloc replay")
    p.add_argument("--profile", action="store_true", help="cProfile the RadixCache replay")


def main(args: argparse.Namespace) -> None:

    rt = load_trace_module(args.trace_module)
    params = rt.TraceParams()
    if args.n_requests is not None:
        params = dataclasses.replace(params, n_requests=args.n_requests)
    if args.page_size is not None:
        params = dataclasses.replace(params, page_size=args.page_size)
    t = time.perf_counter()
    trace = rt.build_trace(params)
    n = len(trace)
    print(
        f"trace {args.trace_module} fingerprint {trace.fingerprint()} requests {n} built in {time.perf_counter() - t:.1f}s"
    )
    print(
        f"capacity {params.capacity_tokens:,} tokens, evict_extra {params.evict_extra_tokens:,}, page_size {params.page_size}"
    )

    impls: list[tuple[str, Callable[[SlotAllocator], object]]] = [
        ("RadixCache", lambda a: RadixCache(a, page_size=params.page_size)),
        ("NoCache", lambda a: NoCache(a, page_size=params.page_size)),
    ]
    sg = sglang_factory()
    if sg is not None:
        impls.append(("sglang RadixCache", sg))

    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(replay, *impls[0], trace, params, n)
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)

    results = [replay(name, make, trace, params, n) for name, make in impls]
    if not args.no_memory:
        for res, (name, make) in zip(results, impls, strict=True):
            tracemalloc.start()
            replay(name, make, trace, params, n)
            res.peak_mb = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()

    print()
    print(
        "| cache | requests/s (wall) | requests/s (CPU time) | token hit rate | match p50 / p99 µs | insert p50 / p99 µs | evictions: p50 / p99 µs | peak traced MB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for res in results:
        print(res.row())
    radix, none = results[0], results[1]
    wall, cpu = radix.n / radix.seconds, radix.n / radix.cpu_seconds
    print()
    print(
        f"RadixCache vs NoCache: {radix.seconds / none.seconds:.1f}x NoCache's cache-op time "
        f"(NoCache does no lookups), hit rate {radix.hit_rate:.4f} vs {none.hit_rate:.4f}; "
        f"RadixCache evicted {radix.evict_tokens:,} tokens"
    )
    print(
        f"RadixCache vs the SGLang reference figure: {wall / 11_300:.2f}x (wall), "
        f"{cpu / 11_300:.2f}x (CPU time); target 22,000 req/s = 1.95x ({SGLANG_REFERENCE})"
    )


# -- host-reload -------------------------------------------------------------------------
TAIL = 16


def one_run(engine: LLMEngine, n: int, seed: int) -> tuple[float, int]:
    rng = random.Random(seed)
    a = random_ids(rng, n + TAIL)
    ttft(engine, f"a{seed}", a)
    ttft(engine, f"f{seed}", random_ids(rng, n + TAIL))  # A leaves the device pool
    return ttft(engine, f"again{seed}", a)


def host_reload_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", default="512,2048", help="cached prompt lengths N")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def host_reload_main(args: argparse.Namespace) -> int:
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


HOST_RELOAD = Command(
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
""",
    host_reload_arguments,
    host_reload_main,
)
