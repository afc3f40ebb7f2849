"""The engine's knobs, frozen and built once at the edge (CLI / YAML), then passed down.

Nothing here is measured or written back at run time: values derived from the model
or the KV pool (the effective context length, the pool capacity) live on the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

# Set to 1 (the test suite does, tests/conftest.py) for the per-step checks below.
DEBUG_ENV = "RADIX_ENGINE_DEBUG"


def debug_from_env() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


@dataclass(frozen=True)
class EngineConfig:
    # How many requests decode together at most (the batch size of a decode step).
    max_running_requests: int = 64
    # Prefill token budget per step: long prompts are cut into chunks of at most this
    # many tokens so decoding requests keep streaming while a long prompt is prefilled.
    max_prefill_tokens: int = 2048
    # Caps the model's own context length (None: the model's max_position_embeddings).
    max_model_len: int | None = None
    # Radix tree granularity: matches and insertions are whole pages of this many tokens.
    page_size: int = 1
    # KV pool size in tokens; None: sized from kv_memory_fraction of free device memory.
    kv_capacity_tokens: int | None = None
    kv_memory_fraction: float = 0.5
    device: str = "auto"
    dtype: str = "auto"
    # auto: triton on CUDA, sdpa on CPU (worker/engine/runtime/attention/).
    attention_backend: str = "auto"
    # What the KV pool stores: auto (the activations' dtype) or fp8_e4m3 (one byte per
    # value with per-tensor scales: twice the tokens, half the KV bytes per step).
    kv_cache_dtype: str = "auto"
    # Decode-only steps replay CUDA graphs unless this is set (CUDA + triton only).
    disable_cuda_graph: bool = False
    # Steps with a prefill chunk (mixed and extend steps) of up to this many tokens
    # replay piecewise graphs, attention eager between the pieces (CUDA + triton only;
    # runtime/piecewise_graphs.py). 0: off; disable_cuda_graph turns them off too.
    piecewise_cuda_graph_max_tokens: int = 0
    # Host KV tier under the radix cache, in tokens (0: off): device pages the LRU
    # evicts are kept in host memory and loaded back on a hit. write_back copies a page
    # when it is evicted; write_through when it enters the tree (evictions then copy
    # nothing, at the price of a copy per new page).
    host_cache_tokens: int = 0
    host_write_policy: Literal["write_back", "write_through"] = "write_back"
    # Schedule step N+1 while step N runs on the device (engine.py): the host's
    # scheduling and postprocessing hide behind the forward. Off: strictly in order.
    overlap_schedule: bool = True
    # Validate every step's batch against the pool and vocabulary before it runs
    # (runner._check): a clear error instead of a CUDA index assert, for caller bugs
    # only. It was ~40% of a batch-64 step's host work, so it runs in tests and when
    # RADIX_ENGINE_DEBUG=1, not in serving.
    debug_checks: bool = field(default_factory=debug_from_env)
    # Ablation / correctness baseline: NoCache instead of RadixCache.
    disable_radix_cache: bool = False
    # Evict at least this many tokens whenever eviction is needed: evicting exactly the
    # shortfall on every allocation made SGLang's replay 4x slower (DESIGN.md).
    evict_batch_tokens: int = 256
    # Queue depth beyond the running batch: with max_running_requests + this many
    # requests in flight, new ones get `EngineOverloaded` (HTTP 503).
    max_waiting_requests: int = 4096
    # Most choices (`n`) one request may ask for: each is a running sequence.
    max_n: int = 8
    # --- scheduling (worker/engine/admission.py explains each rule) ---
    schedule_policy: Literal["fcfs", "lpm"] = "fcfs"
    lpm_max_waiting: int = 128
    max_queue_wait_steps: int = 256
    # Prefill chunks enter the radix tree while their request still runs (off: only
    # at release, the ablation for benchmarks).
    share_inflight_prefixes: bool = True
    # KV events (worker/engine/kv_blocks.py): the block size routers index; 0: off.
    kv_events_block_size: int = 0
    # --- pins across tool gaps (worker/engine/pins.py) ---
    pin_budget: float = 0.25  # fraction of the KV pool pins may hold, in [0, 1]
    pin_max_ttl_s: float = 300.0  # a longer cache_pin_ttl is clamped (and said so)
    pin_default_ttl_s: float = 0.0  # for requests with a prompt_cache_key and no TTL
    # The radix cache's second chance for reused prefixes (radix_cache.py): the share
    # of the KV pool granted second chances may hold together, in [0, 1]; 0: plain LRU.
    second_chance: float = 0.1
    inbatch_dedup_min_tokens: int = 32  # 0: off
    # SGLang's defaults: 0.7 -> 0.098 (0.7 x 0.14) over 600 decode steps; outputs
    # longer than 4,096 tokens are reserved as 4,096.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.098
    new_token_ratio_decay_steps: int = 600
    max_reserved_tokens_per_request: int = 4096

    def __post_init__(self) -> None:
        positive = {
            "max_running_requests": self.max_running_requests,
            "max_prefill_tokens": self.max_prefill_tokens,
            "page_size": self.page_size,
            "evict_batch_tokens": self.evict_batch_tokens,
            "max_waiting_requests": self.max_waiting_requests,
            "max_n": self.max_n,
            "lpm_max_waiting": self.lpm_max_waiting,
            "max_queue_wait_steps": self.max_queue_wait_steps,
            "new_token_ratio_decay_steps": self.new_token_ratio_decay_steps,
            "max_reserved_tokens_per_request": self.max_reserved_tokens_per_request,
        }
        if self.max_model_len is not None:
            positive["max_model_len"] = self.max_model_len
        if self.kv_capacity_tokens is not None:
            positive["kv_capacity_tokens"] = self.kv_capacity_tokens
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if isinstance(self.host_cache_tokens, bool) or not isinstance(self.host_cache_tokens, int):
            raise ValueError(
                f"EngineConfig.host_cache_tokens must be an integer, got {self.host_cache_tokens!r}"
            )
        if self.host_cache_tokens < 0:
            raise ValueError(
                f"EngineConfig.host_cache_tokens must be >= 0, got {self.host_cache_tokens}"
            )
        if not 0 <= self.pin_budget <= 1:  # a fraction of KV: more, or less, means nothing
            raise ValueError(f"EngineConfig.pin_budget must be in [0, 1], got {self.pin_budget}")
        if not 0 <= self.second_chance <= 1:
            raise ValueError(
                f"EngineConfig.second_chance must be in [0, 1], got {self.second_chance}"
            )
        if self.host_write_policy not in ("write_back", "write_through"):
            raise ValueError(
                "EngineConfig.host_write_policy must be write_back or write_through, "
                f"got {self.host_write_policy!r}"
            )
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(
                f"EngineConfig.schedule_policy must be fcfs or lpm, got {self.schedule_policy!r}"
            )
        if self.inbatch_dedup_min_tokens < 0:
            raise ValueError("EngineConfig.inbatch_dedup_min_tokens must be >= 0")
        if not 0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise ValueError(
                "EngineConfig needs 0 <= min_new_token_ratio <= init_new_token_ratio <= 1"
            )
        if self.attention_backend not in ("auto", "sdpa", "triton"):
            raise ValueError(
                "EngineConfig.attention_backend must be auto, sdpa or triton, "
                f"got {self.attention_backend!r}"
            )
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(
                f"EngineConfig.kv_cache_dtype must be auto or fp8_e4m3, got {self.kv_cache_dtype!r}"
            )
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(
                f"EngineConfig.kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction!r}"
            )
