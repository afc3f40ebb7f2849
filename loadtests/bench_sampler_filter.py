"""CPU side-by-side: top-k/top-p by a full vocabulary sort vs by thresholds.

The two implementations of the sampler's cuts (worker/engine/runtime/threshold_filter.py):
`sorted_reference` (sort, cumulative sum: the sampler's old path) and `filtered_probs`
(topk for k, a 3-pass mass-histogram radix select for top_p), on the same logits, in
alternating rounds, process CPU time with 1 torch thread (a shared machine's other
tenants disturb it far less than wall time). Half the rows use top_p 0.9, a quarter
top_k 50, the rest no cut (as a mixed serving batch). Also counts, for each, the rows
whose kept set differs from an fp64 sorted reference (fp32 sums round differently at
the top_p edge). The GPU side is gpu-check's `ops` section.

    python -m loadtests sampler-filter [--rounds 5] [--out loadtests/results/sampler-filter.md]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from loadtests.options import HelpFormatter
from worker.engine.runtime.threshold_filter import filtered_probs, sorted_reference

SHAPES = ((1, 32_000), (8, 32_000), (8, 151_936), (64, 151_936))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = HelpFormatter
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per shape")
    p.add_argument("--out", type=Path, help="write the markdown table here too")


def cpu_ms(fn) -> float:
    start = time.process_time()
    fn()
    return 1000 * (time.process_time() - start)


def one_shape(batch: int, vocab: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    logits = torch.randn(batch, vocab, generator=g) * 3
    rows = torch.arange(batch)
    temp = torch.full((batch,), 0.8)
    top_p = torch.where(rows % 2 == 0, 0.9, 1.0)
    top_k = torch.where(rows % 4 == 1, 50.0, float(vocab))
    min_p = torch.zeros(batch)

    def ref():
        return sorted_reference(logits, temp, top_k, top_p, min_p)

    def thr():
        return filtered_probs(logits, temp, top_k, top_p, None, max_k=50)

    exact = sorted_reference(logits.double(), temp.double(), top_k.double(), top_p.double(),
                             min_p.double()) > 0  # fmt: skip
    off_sort = int(((ref() > 0) ^ exact).any(dim=1).sum())
    off_thr = int(((thr() > 0) ^ exact).any(dim=1).sum())
    sort_ms, thr_ms = [], []
    for _ in range(rounds):
        sort_ms.append(cpu_ms(ref))
        thr_ms.append(cpu_ms(thr))
    s, t = statistics.median(sort_ms), statistics.median(thr_ms)
    return {"batch": batch, "vocab": vocab, "sort_ms": s, "threshold_ms": t,
            "ratio": s / t, "off_sort": off_sort, "off_thr": off_thr}  # fmt: skip


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    lines = ["| batch | vocab | sort ms | thresholds ms | sort / thresholds "
             "| rows off fp64: sort | rows off fp64: thresholds |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for batch, vocab in SHAPES:
        r = one_shape(batch, vocab, args.rounds)
        lines.append(f"| {batch} | {vocab:,} | {r['sort_ms']:.1f} | {r['threshold_ms']:.1f} "
                     f"| {r['ratio']:.2f}x | {r['off_sort']} | {r['off_thr']} |")  # fmt: skip
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0
