"""The engine on a CUDA device (`pytest -m gpu`; skipped without one).

Kept apart from tests/worker/ so that it runs where only torch, triton, transformers
and numpy are installed (the GPU machine has no pydantic, which tests/worker's
conftest imports). `python -m loadtests gpu-check` runs these first.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.worker.engine.slots import allocator_for
from worker.engine.runtime.runner import BatchItem, ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@functools.lru_cache(maxsize=2)
def hf_model(model_dir: Path) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def hf_last_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(model_dir)(torch.tensor([ids])).logits[0, -1].float()


def sample_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 1000) for _ in range(n)]


def mixed_steps(runner: ModelRunner, seed: int = 0) -> tuple[list[list[int]], torch.Tensor]:
    """Prefill three sequences (one in two chunks), then one mixed step: two decodes and
    the second chunk. Returns the sequences and that step's logits."""
    alloc = allocator_for(runner)
    alloc.reset()
    reqs = [sample_ids(n, seed + n) for n in (7, 40, 90)]
    slots = [alloc.alloc(len(s)) for s in reqs]
    first = [BatchItem(reqs[i][:-1], 0, slots[i][:-1], seq_id=i) for i in (0, 1)]
    runner.forward([*first, BatchItem(reqs[2][:50], 0, slots[2][:50], seq_id=2)])
    logits = runner.forward([
        BatchItem(reqs[0][-1:], 6, slots[0], seq_id=0, dirty_from=6),
        BatchItem(reqs[2][50:], 50, slots[2], seq_id=2, dirty_from=50),
        BatchItem(reqs[1][-1:], 39, slots[1], seq_id=1, dirty_from=39),
    ])  # fmt: skip
    for i in range(3):
        runner.release(i)
    return [reqs[0], reqs[2], reqs[1]], logits


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_cuda_matches_transformers(tiny_model_dir: Path, backend: str) -> None:
    runner = ModelRunner(tiny_model_dir, device="cuda", dtype="float32", kv_capacity_tokens=1024,
                         attention_backend=backend)  # fmt: skip
    assert runner.pool.k[0].is_cuda and runner.backend.name == backend
    reqs, logits = mixed_steps(runner)
    for row, req in enumerate(reqs):
        want = hf_last_logits(tiny_model_dir, req)
        torch.testing.assert_close(logits[row].cpu(), want, atol=2e-3, rtol=0)


def test_cuda_graph_decode_equals_eager(tiny_model_dir: Path) -> None:
    graphs = ModelRunner(tiny_model_dir, device="cuda", dtype="float32", kv_capacity_tokens=2048)
    eager = ModelRunner(tiny_model_dir, device="cuda", dtype="float32", kv_capacity_tokens=2048,
                        cuda_graphs=False)  # fmt: skip
    assert graphs.graphs is not None and eager.graphs is None
    outs = []
    for runner in (graphs, eager):
        alloc = allocator_for(runner)
        alloc.reset()
        reqs = [sample_ids(n, n) for n in (5, 33, 70)]  # batch 3: padded to bucket 4
        slots = [alloc.alloc(len(s) + 4) for s in reqs]
        runner.forward([BatchItem(s, 0, sl[: len(s)], seq_id=i)
                        for i, (s, sl) in enumerate(zip(reqs, slots, strict=True))])  # fmt: skip
        step_logits = []
        for step in range(4):
            batch = [BatchItem([9 + step], len(s) + step, sl[: len(s) + step + 1], seq_id=i,
                                  dirty_from=len(s) + step)
                     for i, (s, sl) in enumerate(zip(reqs, slots, strict=True))]  # fmt: skip
            step_logits.append(runner.forward(batch).cpu())
        outs.append(torch.stack(step_logits))
    assert graphs.graphs.replays == 4
    torch.testing.assert_close(outs[0], outs[1], atol=1e-3, rtol=0)


def test_piecewise_graphs_mixed_steps_equal_eager(tiny_model_dir: Path) -> None:
    """Real piecewise CUDA graphs (worker/engine/runtime/piecewise_graphs.py): the two
    steps of `mixed_steps` (95 and 42 tokens: buckets 96 and 64, padded) replay the
    pieces with the triton attention eager between them; logits as the eager runner's."""
    pieces = ModelRunner(tiny_model_dir, device="cuda", dtype="float32", kv_capacity_tokens=1024,
                         piecewise_max_tokens=128)  # fmt: skip
    # --disable-cuda-graph (cuda_graphs=False) turns the piecewise graphs off too.
    eager = ModelRunner(tiny_model_dir, device="cuda", dtype="float32", kv_capacity_tokens=1024,
                        cuda_graphs=False, piecewise_max_tokens=128)  # fmt: skip
    pw = pieces.piecewise
    assert pw is not None and not pw.emulate and eager.piecewise is None
    assert pw.captures == len(pw.buckets) and set(pw.capture_seconds) == set(pw.buckets)
    replays = pw.replays
    _, got = mixed_steps(pieces)
    _, want = mixed_steps(eager)
    assert pw.replays == replays + 2 and pw.late_captures == 0
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-3, rtol=0)


def test_bf16_triton_close_to_sdpa(tiny_model_dir: Path) -> None:
    a = ModelRunner(
        tiny_model_dir, device="cuda", kv_capacity_tokens=1024, attention_backend="sdpa"
    )
    b = ModelRunner(tiny_model_dir, device="cuda", kv_capacity_tokens=1024)
    assert a.dtype == b.dtype == torch.bfloat16 and b.attention_backend == "triton"
    _, la = mixed_steps(a, seed=3)
    _, lb = mixed_steps(b, seed=3)
    assert (la - lb).abs().max().item() < 0.05 * la.abs().max().item()


def test_cuda_auto_dtype_and_pool_sizing(tiny_model_dir: Path) -> None:
    runner = ModelRunner(tiny_model_dir, kv_memory_fraction=0.01)
    assert runner.device.type == "cuda"
    assert runner.dtype == torch.bfloat16  # auto on CUDA, whatever the checkpoint says
    assert runner.attention_backend == "triton"
    assert runner.pool.capacity > 10_000
    slots = allocator_for(runner).alloc(9)
    out = runner.forward([BatchItem(sample_ids(9, 50), 0, np.asarray(slots))])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_one_host_sync_per_step_on_cuda(tiny_model_dir: Path) -> None:
    """CUDA's sync debug mode counts every synchronising call of each engine step:
    one per step that samples (the ids), none for a step that samples nothing; in
    decode-only, mixed, and penalties + logit_bias + seeds + logprobs steps."""
    from loadtests.gpu.correct import SyncCounter, syncs_per_step
    from worker.engine.config import EngineConfig
    from worker.engine.runtime.load import load_engine

    config = EngineConfig(device="cuda", kv_capacity_tokens=4096, max_prefill_tokens=16)
    engine = load_engine(tiny_model_dir, config)
    with SyncCounter("cuda") as counter:
        result = syncs_per_step(engine, counter)
    assert result["passed"], result
