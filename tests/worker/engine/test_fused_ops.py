"""The fused triton ops (run here in triton's interpreter, TRITON_INTERPRET=1 from
tests/conftest.py) equal the eager reference ops, in fp32 and bf16, and the model
gives the same logits with either set."""

from __future__ import annotations

import pytest
import torch

from worker.engine.runtime.fused_kernels import TritonOps
from worker.engine.runtime.fused_ops import TorchOps
from worker.engine.runtime.kv_pool import KVPool
from worker.engine.runtime.runner import ops_for

pytest.importorskip("triton")

REF, FUSED = TorchOps(), TritonOps()
CPU = torch.device("cpu")
# bf16: the kernels round once where the eager ops may round twice, and triton's
# interpreter casts to bf16 by truncation (the GPU rounds to nearest): a bf16 step or two.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}
ONE_STEP = {torch.float32: dict(atol=0, rtol=0), torch.bfloat16: dict(atol=0, rtol=2**-7)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm(dtype: torch.dtype, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 80, generator=g).to(dtype)
    residual = torch.randn(7, 80, generator=g).to(dtype) if with_residual else None
    weight = (torch.rand(80, generator=g) + 0.5).to(dtype)
    want_h, want_r = REF.add_rmsnorm(x, residual, weight, 1e-6)
    got_h, got_r = FUSED.add_rmsnorm(x, residual, weight, 1e-6)
    torch.testing.assert_close(got_r, want_r, **ONE_STEP[dtype])  # the sum, rounded once
    torch.testing.assert_close(got_h, want_h, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_on_views_of_one_projection(dtype: torch.dtype) -> None:
    gate_up = (torch.randn(5, 2 * 300, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)  # strided views, as the fused gate/up gives them
    torch.testing.assert_close(FUSED.silu_mul(gate, up), REF.silu_mul(gate, up), **TOL[dtype])


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 32), (7, 1, 80), (2, 2, 128)])
def test_rope_store(heads: int, kv_heads: int, dim: int, kv_dtype: torch.dtype | None) -> None:
    g = torch.Generator().manual_seed(heads * dim)
    t = 6
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g)  # the fused projection
    pos = torch.randint(0, 500, (t,), generator=g).float()
    freqs = pos[:, None] * (1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))[None, :]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    slots = torch.randperm(40, generator=g)[:t]
    results = []
    for ops in (REF, FUSED):
        pool = KVPool(1, kv_heads, dim, 40, torch.float32, CPU, kv_dtype=kv_dtype)
        if kv_dtype is not None:
            pool.set_scales([0.01], [0.02])  # values / scale land in e4m3's range
        x = qkv.clone()
        qk = x[:, : (heads + kv_heads) * dim].view(t, heads + kv_heads, dim)
        v = x[:, (heads + kv_heads) * dim :].view(t, kv_heads, dim)
        ops.rope_store(qk, v, cos, sin, pool, 0, slots, heads)
        results.append((qk.clone(), pool.k_buffer.float(), pool.v_buffer.float()))
    (qk_ref, k_ref, v_ref), (qk_got, k_got, v_got) = results
    torch.testing.assert_close(qk_got, qk_ref, atol=1e-5, rtol=1e-5)
    assert not torch.equal(qk_ref, qkv[:, : (heads + kv_heads) * dim].view_as(qk_ref))  # rotated
    if kv_dtype is None:
        torch.testing.assert_close(k_got, k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_got, v_ref, atol=0, rtol=0)
    else:  # fp8: the same e4m3 codes (k within fp32 rounding of RoPE: rare one-step moves)
        assert (k_got != k_ref).float().mean() < 0.01
        torch.testing.assert_close(k_got, k_ref, atol=2**-9, rtol=2**-3)
        assert torch.equal(v_got, v_ref)
        assert k_ref.abs().max() > 10  # the scales put the values well inside e4m3's range
    assert k_ref[0, slots].abs().sum() > 0 and k_ref.abs().sum() == k_ref[0, slots].abs().sum()


def test_ops_follow_the_attention_backend() -> None:
    assert ops_for("triton").name == "triton"
    assert ops_for("sdpa").name == "torch"


def test_model_logits_equal_with_fused_ops(tiny_model_dir) -> None:
    """The whole tiny model (fp32, merged projections) on a mixed batch: the fused
    kernels give the eager ops' logits."""
    import numpy as np

    from worker.engine.batch import BatchItem
    from worker.engine.runtime.runner import ModelRunner

    logits = []
    for backend in ("sdpa", "triton"):
        runner = ModelRunner(tiny_model_dir, device="cpu", kv_capacity_tokens=64,
                             attention_backend=backend)  # fmt: skip
        for layer in runner.model.model.layers:  # CPU keeps gate/up apart: merge them
            layer.mlp.fuse()
        batch = [BatchItem([5, 6, 7, 8], 0, np.arange(4), seq_id=1),
                 BatchItem([9, 10], 0, np.arange(10, 12), seq_id=2)]  # fmt: skip
        first = runner.forward(batch)
        step = [BatchItem([11], 4, np.arange(5), seq_id=1)]
        logits.append((first, runner.forward(step)))
        assert runner.model.ops.name == ("triton" if backend == "triton" else "torch")
    for a, b in zip(logits[0], logits[1], strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_the_engine_runs_without_triton_installed(tiny_model_dir) -> None:
    """The fused kernels are imported only with the triton backend: with triton gone,
    the engine imports and the sdpa runner uses the eager ops."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None\n"
            "from worker.engine.runtime.runner import ModelRunner\n"
            f"r = ModelRunner({str(tiny_model_dir)!r}, device='cpu', kv_capacity_tokens=16)\n"
            "assert r.model.ops.name == 'torch'\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
