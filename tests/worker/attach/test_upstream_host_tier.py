"""What `attach` reads of a stock engine's host KV tier from its /metrics text."""

from __future__ import annotations

from worker.attach.upstream_metrics import parse_load

SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 2
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 0
# TYPE sglang:cached_tokens counter
sglang:cached_tokens_total{model_name="m",cache_source="device"} 700
sglang:cached_tokens_total{model_name="m",cache_source="host"} 300
sglang:cached_tokens_total{model_name="m",cache_source="storage_file"} 5
"""

VLLM = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{model_name="m"} 64
# TYPE vllm:simple_kv_offload_used_blocks gauge
vllm:simple_kv_offload_used_blocks{model_name="m"} 12
"""


def test_sglang_host_hits_are_the_host_labelled_cached_tokens() -> None:
    load = parse_load("sglang", SGLANG)
    assert load is not None
    assert load.cached_tokens_total == 1005 and load.host_cached_tokens_total == 300


def test_sglang_without_a_host_tier_and_vllm_report_no_host_hits() -> None:
    plain = parse_load("sglang", SGLANG.replace('cache_source="host"', 'cache_source="device"'))
    assert plain is not None and plain.host_cached_tokens_total == 0
    vllm = parse_load("vllm", VLLM)
    assert vllm is not None and vllm.cached_tokens_total == 64
    assert vllm.host_cached_tokens_total == 0  # its offload metrics are blocks, not tokens
