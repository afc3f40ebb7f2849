"""Read a stock engine's load and KV usage from its own Prometheus `/metrics`.

`radix-worker attach` heartbeats for an unmodified SGLang or vLLM server; what it
reports comes from here. Each engine names the same facts differently:

    fact                     SGLang                      vLLM (v1 engine)
    requests running         sglang:num_running_reqs     vllm:num_requests_running
    requests queued          sglang:num_queue_reqs       vllm:num_requests_waiting
    KV in use (0..1)         sglang:token_usage          vllm:kv_cache_usage_perc
                                                         (vllm:gpu_cache_usage_perc before 0.10)
    prompt tokens (total)    sglang:prompt_tokens_total  vllm:prompt_tokens_total
    prefix-cache hit tokens  sglang:cached_tokens_total  vllm:prefix_cache_hits_total
    KV capacity (tokens)     /get_server_info            vllm:cache_config_info
                             max_total_num_tokens        num_gpu_blocks × block_size

Host KV tier: SGLang's HiCache labels its hits `sglang:cached_tokens_total{cache_source=
"host"}` (sources device, host, storage_<backend>); they are reported as host hits
(still part of the cached total). Neither engine exports its host tier's size in tokens
(vLLM's CPU offloading exports blocks used and loaded, `vllm:simple_kv_offload_*`,
whose block size is not in the series), so an attached worker reports no host capacity
and the router's tree cap stays at its device capacity.

Series of one name (one per model, engine or data-parallel rank) are summed, except
the usage ratio, which is averaged. The text is untrusted: a missing or unparsable
family reads as absent, never as an exception out of the heartbeat loop.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

StockEngine = Literal["sglang", "vllm"]

_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "sglang": {
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
        "usage": ("sglang:token_usage",),
        "prompt": ("sglang:prompt_tokens",),
        "cached": ("sglang:cached_tokens",),
    },
    "vllm": {
        "running": ("vllm:num_requests_running",),
        "waiting": ("vllm:num_requests_waiting",),
        "usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "prompt": ("vllm:prompt_tokens",),
        "cached": ("vllm:prefix_cache_hits",),
    },
}
MAX_TEXT_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class UpstreamLoad:
    running: int
    waiting: int
    kv_usage: float  # 0..1
    prompt_tokens_total: int
    cached_tokens_total: int
    capacity_tokens: int | None  # from /metrics when the engine exports it (vLLM)
    start_time: float | None  # process_start_time_seconds: changes when it restarts
    host_cached_tokens_total: int = 0  # of cached_tokens_total, served from a host tier


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name (counters without `_total` too) -> [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if not math.isfinite(s.value):
                    continue
                out.setdefault(s.name, []).append((dict(s.labels), s.value))
                if s.name.endswith("_total"):
                    out.setdefault(s.name[: -len("_total")], []).append((dict(s.labels), s.value))
    except (ValueError, TypeError, IndexError):
        pass  # a malformed exposition: keep what parsed before it
    return out


def _first(samples: dict[str, list[tuple[dict[str, str], float]]], names: Iterable[str]):
    for name in names:
        if name in samples:
            return [v for _, v in samples[name]]
    return None


def _vllm_capacity(samples: dict[str, list[tuple[dict[str, str], float]]]) -> int | None:
    for labels, _ in samples.get("vllm:cache_config_info", []):
        try:
            return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        except (KeyError, ValueError):
            continue
    return None


def parse_load(engine: StockEngine, text: str) -> UpstreamLoad | None:
    """The engine's load from its exposition text; None when it reports no load at all
    (not the engine named, or not up yet)."""
    names = _NAMES[engine]
    samples = _samples(text[:MAX_TEXT_BYTES])
    running, waiting = _first(samples, names["running"]), _first(samples, names["waiting"])
    if running is None and waiting is None:
        return None
    usage = _first(samples, names["usage"]) or [0.0]
    start = _first(samples, ("process_start_time_seconds",))
    return UpstreamLoad(
        running=max(0, int(sum(running or []))),
        waiting=max(0, int(sum(waiting or []))),
        kv_usage=min(1.0, max(0.0, sum(usage) / len(usage))),
        prompt_tokens_total=max(0, int(sum(_first(samples, names["prompt"]) or []))),
        cached_tokens_total=max(0, int(sum(_first(samples, names["cached"]) or []))),
        capacity_tokens=_vllm_capacity(samples) if engine == "vllm" else None,
        start_time=min(start) if start else None,
        host_cached_tokens_total=_host_hits(samples) if engine == "sglang" else 0,
    )


def _host_hits(samples: dict[str, list[tuple[dict[str, str], float]]]) -> int:
    hits = (
        v
        for labels, v in samples.get("sglang:cached_tokens", [])
        if labels.get("cache_source") == "host"
    )
    return max(0, int(sum(hits)))
