"""`gpu-check --dry-run`: the driver's CUDA paths with the device stubbed (issue 32).

The first GPU run crashed in the driver, not on the device: a section with no time cap
raised KeyError on CUDA only, after three sections had spent the loan. A dry run takes
every branch the driver takes on `--device cuda` (the caps, the budget, the order, the
report's JSON and markdown after every section) with each section's process replaced
by `stub_section`, which returns rows shaped as a GPU run writes them, CUDA-only keys
included (device name and capability, peak memory, profiled kernel names). Nothing is
started and no device is touched; the markdown is built strictly (`check_report`), so
a key the writer expects and a section lacks fails here instead of being swallowed.
"""

from __future__ import annotations

import copy
from typing import Any

from loadtests.gpu.gpu_report import to_markdown

# fmt: off
_BW = {"device": "NVIDIA H100 80GB HBM3", "spec_bytes_s": 3.35e12,
       "measured_copy_bytes_s": 3.0e12, "used_bytes_s": 3.35e12}
_CELL = {"ms": 3.2, "roofline_ms": 1.4, "roofline_ratio": 2.29, "measured_floor_ms": 1.56,
         "measured_ratio": 2.05, "fragmented_ms": 3.5, "fragmented_ratio": 2.5,
         "fragmented_over_contiguous": 1.09}
_BASELINE_ROW = {"items": 64, "new": 1, "tokens": 2048, "ours_us": 100.0, "floor_us": 45.0,
                 "ours_over_floor": 2.22, "rel_diff_vs_sdpa": 4e-3, "passed": True,
                 "baselines": {"sdpa": {"us": 90.0, "ours_over_it": 1.11},
                               "sdpa+gather": {"us": 300.0, "ours_over_it": 0.33},
                               "flashinfer": {"skipped": "not importable on this machine"},
                               "vllm": {"skipped": "not importable on this machine"}},
                 "sdpa_kernels": {"flash_attention": {"us": 90.0, "ours_over_it": 1.11},
                                  "efficient_attention": {"skipped": "No available kernel"},
                                  "cudnn_attention": {"us": 95.0, "ours_over_it": 1.05},
                                  "math": {"us": 900.0, "ours_over_it": 0.11}}}
SAMPLES: dict[str, dict[str, Any]] = {
    "env": {"versions": {"python": "3.12.3", "torch": "2.11.0", "triton": "3.6.0",
                         "torch_cuda": "13.0"},
            "device": {"name": "NVIDIA H100 80GB HBM3", "capability": "9.0",
                       "memory_gib": 79.2, "multiprocessors": 132},
            "bandwidth": _BW},
    "correctness": {
        "kernels": {"cases": [{"dtype": "bfloat16", "max_abs_diff": 4e-3, "ok": True}],
                    "passed": True},
        "syncs": {"per_step": {"decode": 1, "mixed": 1}, "how": "CUDA sync debug mode",
                  "unexpected": [], "passed": True},
    },
    "ops": {
        "bandwidth": _BW,
        "decode": {"batch": 64, "context": 2048, "dtype": "bfloat16", "fp8_vs": "bf16",
                   "fp8_speedup": 1.6,
                   "bf16": {"us_per_layer": 100.0, "floor_us": 45.0, "ratio": 2.22,
                            "kv_bytes": 1 << 27, "rel_diff_vs_sdpa": 4e-3, "passed": True},
                   "fp8_e4m3": {"us_per_layer": 62.0, "floor_us": 22.5, "ratio": 2.76,
                                "kv_bytes": 1 << 26, "rel_diff_vs_sdpa": 2e-2, "passed": True}},
        "baseline": {"dtype": "bfloat16", "passed": True,
                     "rows": [_BASELINE_ROW | {"kind": "decode"},
                              _BASELINE_ROW | {"kind": "extend", "items": 4, "new": 512,
                                               "tokens": 1536}]},
        "table": {"fastest_row": {"head_dim": 64, "element_size": 2, "decode_block_n": 64}},
        "fused": {"tokens": 64, "dtype": "bfloat16",
                  "add_rmsnorm": {"eager_us": 30.0, "fused_us": 10.0, "speedup": 3.0,
                                  "rel_diff": 1e-3, "passed": True}},
        "sampler": {"batch": 64, "vocab": 128256, "sort_ms": 2.0, "threshold_ms": 0.5,
                    "speedup": 4.0, "rows_whose_kept_set_differs": 0, "rows_off_fp64_sort": 0,
                    "rows_off_fp64_threshold": 0, "passed": True},
    },
    "host_tier": {
        "load_bandwidth": {"tokens": 16384, "page": 16, "bytes": 2 << 30, "load_bytes_s": 2e10,
                           "write_back_bytes_s": 2e10, "plain_h2d_bytes_s": 2.5e10,
                           "load_over_plain": 0.8, "passed": True,
                           "pinning": "registered", "host_bytes": 8 << 30,
                           "host_bytes_if_pin_memory": 8 << 30},
        "no_host_sync": {"how": "CUDA sync debug mode", "passed": True},
        "greedy_equal": {"passed": True, "cached_tokens": 48, "prefix": 48, "host_loaded": 48},
    },
    "preset": {
        "model": "/tmp/model",
        "runner": {"dtype": "bfloat16", "attention_backend": "triton", "weight_bytes": 2_471_000_000,
                   "kv_bytes_per_token": 32768, "bandwidth": _BW},
        "startup_capture": {"seconds": 4.0, "captures": 20},
        "decode": [{"batch": 64, "context": 2048} | _CELL, {"batch": 1, "context": 2048} | _CELL],
        "kernels": ["_decode_split_kernel", "_extend_kernel"],
        "no_capture_in_traffic": {"late_captures": 0, "replays": 40, "passed": True},
        "eager_point": {"batch": 64, "context": 2048, "ms": 9.0},
        "piecewise_mixed": {"decodes": 32, "context": 1024, "chunk": 512, "tokens": 544,
                            "graphs": "cuda", "piecewise_ms": 8.0, "eager_ms": 11.0,
                            "speedup": 1.38, "capture_s": 1.2, "late_captures": 0,
                            "max_abs_diff": 0.01, "passed": True},
        "overlap_decode": {"batch": 64, "context": 2048, "overlap_ms": 4.0, "in_order_ms": 4.6,
                           "speedup": 1.15, "greedy_equal": True},
        "graph_replays": 300,
        "prefill_tokens_s": 40000.0,
        "ttft": {"uncached_ms": 120.0, "cached_ms": 9.0, "ratio": 0.075, "cached_tokens": 4096,
                 "prefix_tokens": 4096},
        "peak_memory_gib": 12.5,
        "greedy": {"equal": [True, True, True], "all_equal": True, "first_difference": [None] * 3,
                   "graph_replays": 40},
    },
    "pytest": {"passed": True, "exit_code": 0, "command": "pytest -q -m gpu tests/gpu",
               "tail": "8 passed"},
}
# fmt: on


def stub_section(name: str, allowed: float) -> dict[str, Any]:
    """What section `name` would write on a GPU, with the seconds it was allowed."""
    kind = name.split(":")[0]
    if kind not in SAMPLES:
        raise KeyError(f"gpu-check --dry-run: no sample rows for section {name!r}")
    return copy.deepcopy(SAMPLES[kind]) | {"seconds": 0.0, "allowed_s": round(allowed, 1)}


def check_report(report: dict[str, Any]) -> str:
    """The markdown, built without the writer's safety net (errors propagate)."""
    return to_markdown(report)
