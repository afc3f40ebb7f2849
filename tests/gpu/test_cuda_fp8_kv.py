"""FP8 KV cache on CUDA (runs only where a GPU is: `pytest -m gpu`, gpu-check's pytest
section; not run yet, no GPU has been lent). The CPU tests (tests/worker/engine/
test_kv_fp8.py) state the tolerance and why; here the triton kernels and the fused
RoPE+KV store read and write the fp8 pool on the device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.test_cuda_engine import mixed_steps
from worker.engine.runtime.runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_fp8_kv_on_cuda_within_tolerance(tiny_model_dir: Path) -> None:
    def runner(**kw: object) -> ModelRunner:
        return ModelRunner(tiny_model_dir, device="cuda", dtype="float32",
                           kv_capacity_tokens=1024, **kw)  # fmt: skip

    full, fp8, fp8_sdpa = (
        runner(),
        runner(kv_cache_dtype="fp8_e4m3"),
        runner(kv_cache_dtype="fp8_e4m3", attention_backend="sdpa"),
    )
    assert fp8.pool.k_buffer.dtype == torch.float8_e4m3fn and fp8.model.ops.name == "triton"
    assert fp8.pool.nbytes * 4 == full.pool.nbytes  # fp32 activations: a quarter
    _, want = mixed_steps(full, seed=5)
    _, got = mixed_steps(fp8, seed=5)
    _, ref = mixed_steps(fp8_sdpa, seed=5)
    assert (got - ref).abs().max().item() < 2e-3  # the same fp8 values, kernels vs sdpa
    worst = ((got - want).abs().max(dim=1).values / want.std(dim=1)).max().item()
    assert 1e-4 < worst <= 0.25
