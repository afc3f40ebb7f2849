"""Piecewise graphs for steps with a prefill chunk (worker/engine/runtime/piecewise_graphs.py),
on CPU's emulated path: the same static buffers, token padding, capture at start-up and
replay piece by piece with attention eager between, each piece run eagerly instead of
replayed (no CUDA here; a GPU run is still owed, loadtests/results/gpu.md)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.config import WorkerConfig
from shared.tokens.tokenizer import Tokenizer
from tests.worker.engine.test_overlap import TIGHT, _drive
from worker.backends import engine_config
from worker.engine.batch import BatchItem
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.runtime.load import load_engine
from worker.engine.runtime.piecewise_graphs import token_buckets
from worker.engine.runtime.runner import ModelRunner
from worker.engine.runtime.sampler import TorchSampler

# TIGHT's steps hold up to 24 prefill tokens + 8 decodes: every mixed step has a bucket.
MAX_TOKENS = 40
# fp32 logits of a padded step against the eager one: GEMMs over 16 rows instead of 3
# take another CPU kernel path and may round differently (seen: 1.3e-6 once in 1,024).
CLOSE = dict(rtol=1e-5, atol=1e-5)


def _engine(model_dir: Path, piecewise: int, overlap: bool = True) -> LLMEngine:
    cfg = EngineConfig(**TIGHT, overlap_schedule=overlap)  # type: ignore[arg-type]
    runner = ModelRunner(
        model_dir, device="cpu", dtype="float32", kv_capacity_tokens=cfg.kv_capacity_tokens,
        attention_backend="sdpa", max_running_requests=cfg.max_running_requests,
        emulate_cuda_graphs=piecewise > 0, piecewise_max_tokens=piecewise,
    )  # fmt: skip
    return LLMEngine(runner, Tokenizer.from_dir(model_dir), cfg, TorchSampler(runner.device))


@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_outputs_equal_with_piecewise_graphs_on_and_off(
    tiny_model_dir: Path, overlap: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Arrivals, aborts, preemptions, chunked prefill (24-token chunks) and mixed steps:
    the same tokens and finish reasons, every bucket captured before the first step and
    none after; check_integrity() after every step (_drive)."""
    with caplog.at_level(logging.INFO, logger="worker.engine.runtime.piecewise_graphs"):
        on = _engine(tiny_model_dir, MAX_TOKENS, overlap)
    pieces = on.runner.piecewise
    assert pieces is not None and pieces.emulate and pieces.buckets == (16, 32, 40)
    assert sorted(pieces.capture_seconds) == [16, 32, 40] and pieces.captures == 3
    assert on.runner.graph_capture_s >= sum(pieces.capture_seconds.values()) > 0
    assert any("captured 3 piecewise emulated graphs" in r.message for r in caplog.records)
    warm_replays = pieces.replays  # the start-up step through each bucket

    off = _engine(tiny_model_dir, 0, overlap)
    assert off.runner.piecewise is None and off.runner.graphs is None
    got_on, aborted_on, _ = _drive(on, seed=0)
    got_off, aborted_off, _ = _drive(off, seed=0)
    assert on.scheduler.num_preemptions > 0 and aborted_on
    assert pieces.replays - warm_replays >= 20  # mixed steps went through the pieces
    assert pieces.captures == 3 and pieces.late_captures == 0  # none during traffic
    assert on.runner.graphs is not None and on.runner.graphs.late_captures == 0
    assert aborted_on == aborted_off
    assert got_on == got_off


def _runner(model_dir: Path, piecewise: int, backend: str = "sdpa") -> ModelRunner:
    return ModelRunner(
        model_dir, device="cpu", dtype="float32", kv_capacity_tokens=256,
        attention_backend=backend, max_running_requests=8,
        emulate_cuda_graphs=piecewise > 0, piecewise_max_tokens=piecewise,
    )  # fmt: skip


def _mixed_batch(seed: int) -> list[BatchItem]:
    """Two prefill chunks (one over a cached prefix) and three decodes: 19 tokens."""
    rng = np.random.default_rng(seed)
    items, slot = [], 0
    for i, (start, n) in enumerate([(0, 9), (5, 7), (12, 1), (3, 1), (20, 1)]):
        slots = np.arange(slot, slot + start + n)
        slot += start + n
        items.append(BatchItem(rng.integers(4, 500, n).tolist(), start, slots, seq_id=i))
    return items


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_padded_bucket_logits_equal_the_eager_step_for_the_real_rows(
    tiny_model_dir: Path, backend: str
) -> None:
    """triton: the fused ops inside the pieces and the triton attention kernels between
    them, as on a GPU (here in triton's interpreter, TRITON_INTERPRET=1 from conftest)."""
    if backend == "triton":
        pytest.importorskip("triton")
    pw, eager = _runner(tiny_model_dir, 32, backend), _runner(tiny_model_dir, 0, backend)
    assert pw.model.ops.name == ("triton" if backend == "triton" else "torch")
    assert pw.piecewise is not None and pw.piecewise.bucket_for(19) == 32
    pad = pw.pool.pad_slot
    pw.pool.k_buffer[:, pad].zero_()  # the start-up warm-ups wrote it
    pool_before = pw.pool.k_buffer.clone()
    batch = _mixed_batch(0)
    replays = pw.piecewise.replays
    got, want = pw.forward(batch), eager.forward(batch)
    assert pw.piecewise.replays == replays + 1  # this step ran padded to 32 tokens
    # One row per item, each item's last token: equal to float rounding (CLOSE).
    torch.testing.assert_close(got, want, **CLOSE)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # The K/V of the real tokens are the eager step's; the 13 padding tokens wrote only
    # the pad slot, no other slot moved.
    written = np.concatenate([it.slots[it.start_pos :] for it in batch])
    torch.testing.assert_close(pw.pool.k_buffer[:, written], eager.pool.k_buffer[:, written])
    torch.testing.assert_close(pw.pool.v_buffer[:, written], eager.pool.v_buffer[:, written])
    untouched = np.setdiff1d(np.arange(pad), written)
    assert torch.equal(pw.pool.k_buffer[:, untouched], pool_before[:, untouched])
    assert not torch.equal(pw.pool.k_buffer[:, pad], pool_before[:, pad])


def test_steps_past_the_largest_bucket_run_eagerly_and_a_late_capture_is_counted(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pw, eager = _runner(tiny_model_dir, 16), _runner(tiny_model_dir, 0)
    pieces = pw.piecewise
    assert pieces is not None and pieces.buckets == (16,)
    replays = pieces.replays
    batch = _mixed_batch(1)  # 19 tokens: no bucket
    torch.testing.assert_close(pw.forward(batch), eager.forward(batch), **CLOSE)
    assert pieces.replays == replays
    # A bucket lost after start-up is captured when first used, and counted.
    del pieces._buckets[16]
    small = [BatchItem([7, 8, 9], 0, np.arange(100, 103), seq_id=9)]
    with caplog.at_level(logging.WARNING, logger="worker.engine.runtime.piecewise_graphs"):
        torch.testing.assert_close(pw.forward(small), eager.forward(small), **CLOSE)
    assert pieces.late_captures == 1 and pieces.captures == 2
    assert any("captured during traffic" in r.message for r in caplog.records)


def test_max_tokens_setting_reaches_the_runner_and_cuda_graphs_off_turns_it_off(
    tiny_model_dir: Path,
) -> None:
    config = WorkerConfig(model=str(tiny_model_dir), piecewise_cuda_graph_max_tokens=512)
    assert engine_config(config).piecewise_cuda_graph_max_tokens == 512
    assert WorkerConfig(model=str(tiny_model_dir)).piecewise_cuda_graph_max_tokens == 0
    assert token_buckets(512)[-1] == 512 and token_buckets(100) == (16, 32, 64, 96, 100)
    # On CPU there are no CUDA graphs (only the tests' emulation): nothing is captured,
    # as with --disable-cuda-graph on CUDA, and steps run eagerly.
    engine = load_engine(
        tiny_model_dir,
        EngineConfig(device="cpu", kv_capacity_tokens=256, piecewise_cuda_graph_max_tokens=64),
    )
    assert engine.runner.piecewise is None and engine.runner.graph_capture_s == 0.0
    runner = ModelRunner(tiny_model_dir, device="cpu", kv_capacity_tokens=256, cuda_graphs=False,
                         piecewise_max_tokens=64)  # fmt: skip
    assert runner.piecewise is None
