"""Shared pytest fixtures. Each block below belongs to one area; keep them self-contained."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The repository root on sys.path, so `python -m pytest` works without an install.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# --- worker model: tiny random-weight model folders (worker/engine/tiny_model.py) ---
# Built once per session; nothing downloads (transformers is told to stay offline).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Without a GPU the triton attention kernels run in triton's interpreter on CPU tensors.
# Set before worker/engine/attention/triton_kernels.py is imported: @triton.jit reads it.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (untied embeddings) with a trained BPE tokenizer and chat template."""
    from worker.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (q/k/v biases, tied embeddings)."""
    from worker.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 (q_norm / k_norm, head_dim not hidden / heads, tied embeddings)."""
    from worker.engine.tiny_model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3", num_heads=4, num_kv_heads=2
    )


# --- end worker model ---
