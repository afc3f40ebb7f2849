"""Shapes for `make_tiny_model` / `radix-worker make-tiny-model --preset` (no torch
import here, so the command line can list them cheaply)."""

from __future__ import annotations

from typing import Any

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip

# make_tiny_model keywords per preset; the last three are the published models' shapes.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        intermediate_size=128,
    ),
    "bench": dict(
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=1408,
        max_position_embeddings=4096,
    ),
    "qwen2.5-0.5b": dict(
        arch="qwen2", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
        head_dim=64, intermediate_size=4864, vocab_size=151936,
        max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True,
    ),
    "llama-3.2-1b": dict(
        arch="llama", hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, intermediate_size=8192, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        arch="qwen3", hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=True,
    ),
}  # fmt: skip
ARCHS = ("llama", "qwen2", "qwen3")
