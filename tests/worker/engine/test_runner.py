"""ModelRunner: the contract the scheduler relies on (slots, KV reuse, counters, errors)."""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.worker.engine.slots import allocator_for
from worker.engine.config import EngineConfig
from worker.engine.runtime.attention import make_backend
from worker.engine.runtime.device import parse_dtype, pick_device, pick_dtype
from worker.engine.runtime.load import load_engine
from worker.engine.runtime.runner import CPU_DEFAULT_KV_TOKENS, BatchItem, ModelRunner


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    return ModelRunner(tiny_model_dir, device="cpu", kv_capacity_tokens=256)


@pytest.fixture(autouse=True)
def _fresh_slots(runner: ModelRunner) -> None:
    allocator_for(runner).reset()


def ids_of(n: int, start: int = 10) -> list[int]:
    return [start + (7 * i) % 500 for i in range(n)]


def test_loads_config_device_and_pool(runner: ModelRunner) -> None:
    cfg = runner.config
    assert runner.device == torch.device("cpu")
    assert runner.dtype == torch.float32  # "auto" on CPU
    assert runner.max_model_len == cfg.max_position_embeddings == 2048
    assert runner.pool.capacity == 256
    assert len(runner.pool.k) == cfg.num_hidden_layers
    # One row past capacity: the pad slot CUDA-graph padding writes to.
    assert runner.pool.k[0].shape == (257, cfg.num_key_value_heads, cfg.head_dim)
    assert runner.pool.pad_slot == 256
    assert set(cfg.eos_token_ids) == {1, 3}  # <|end_of_text|>, <|im_end|> (generation_config)


def test_cached_prefix_is_not_recomputed(runner: ModelRunner) -> None:
    """A second request sharing a 40-token prefix runs only its suffix and gets the
    same logits as running everything from scratch."""
    alloc = allocator_for(runner)
    prompt = ids_of(48)
    first = alloc.alloc(48)
    runner.forward([BatchItem(prompt, 0, first)])
    other = [*prompt[:40], *ids_of(5, start=600)]
    slots = np.concatenate([first[:40], alloc.alloc(5)])
    before = runner.tokens_computed
    cached = runner.forward([BatchItem(other[40:], 40, slots)])
    assert runner.tokens_computed - before == 5
    fresh = runner.forward([BatchItem(other, 0, alloc.alloc(len(other)))])
    torch.testing.assert_close(cached, fresh, atol=1e-5, rtol=0)


def test_kv_is_written_to_the_given_slots(runner: ModelRunner) -> None:
    """Scattered, unordered slots work: K/V land exactly there and nowhere else."""
    slots = np.array([200, 3, 77, 150, 9, 42], dtype=np.int64)
    pool = runner.pool
    for layer in range(len(pool.k)):
        pool.k[layer].zero_()
        pool.v[layer].zero_()
    logits = runner.forward([BatchItem(ids_of(6), 0, slots)])
    written = (pool.k[0].abs().sum(dim=(1, 2)) > 0).nonzero().flatten().tolist()
    assert sorted(written) == sorted(slots.tolist())
    contiguous = runner.forward([BatchItem(ids_of(6), 0, np.arange(100, 106))])
    torch.testing.assert_close(logits, contiguous, atol=1e-5, rtol=0)
    torch.testing.assert_close(pool.k[1][slots], pool.k[1][100:106], atol=1e-6, rtol=0)


def test_tokens_computed_counts_every_new_token(runner: ModelRunner) -> None:
    alloc = allocator_for(runner)
    a, b = alloc.alloc(10), alloc.alloc(3)
    before = runner.tokens_computed
    logits = runner.forward([BatchItem(ids_of(10), 0, a), BatchItem(ids_of(3), 0, b)])
    assert logits.shape == (2, runner.config.vocab_size)
    assert runner.tokens_computed - before == 13
    runner.forward([BatchItem([5], 10, np.append(a, alloc.alloc(1)))])
    assert runner.tokens_computed - before == 14


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (BatchItem([], 0, np.zeros(0, dtype=np.int64)), "no input_ids"),
        (BatchItem([1, 2], 0, np.arange(3)), "3 slots for start_pos 0"),
        (BatchItem([1], -1, np.arange(0)), "start_pos -1"),
        (BatchItem([1, 99999], 0, np.arange(2)), "token ids must be in"),
        (BatchItem([1, -1], 0, np.arange(2)), "token ids must be in"),
        (BatchItem([1, 2], 0, np.array([0, 256])), "slots must be in"),
        (BatchItem([1], 2048, np.zeros(2049, dtype=np.int64)), "exceed max_model_len"),
    ],
)
def test_bad_items_raise_clear_errors(runner: ModelRunner, item: BatchItem, message: str) -> None:
    before = runner.tokens_computed
    with pytest.raises(ValueError, match=message):
        runner.forward([item])
    assert runner.tokens_computed == before
    # The runner is still usable afterwards.
    assert runner.forward([BatchItem([5, 6], 0, np.arange(2))]).shape[0] == 1


def test_validation_runs_in_debug_mode_only(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-step validation is a debug mode: on in tests (RADIX_ENGINE_DEBUG=1, set by
    tests/conftest.py), off in serving, where it was ~40% of a step's host work."""
    assert EngineConfig().debug_checks  # the suite's environment
    monkeypatch.setenv("RADIX_ENGINE_DEBUG", "0")
    assert not EngineConfig().debug_checks
    fast = ModelRunner(tiny_model_dir, device="cpu", kv_capacity_tokens=256, debug_checks=False)
    checked = ModelRunner(tiny_model_dir, device="cpu", kv_capacity_tokens=256, debug_checks=True)
    calls = []
    for r in (fast, checked):
        monkeypatch.setattr(r, "_check", lambda batch, r=r: calls.append(r))
        r.forward([BatchItem([5, 6], 0, np.arange(2))])
    assert calls == [checked]
    engine = load_engine(tiny_model_dir, EngineConfig(device="cpu",
                                      kv_capacity_tokens=256, debug_checks=False))  # fmt: skip
    assert not engine.runner.debug_checks


def test_empty_batch_is_an_error(runner: ModelRunner) -> None:
    with pytest.raises(ValueError, match="at least one item"):
        runner.forward([])


def test_pool_sized_from_memory_fraction(tiny_model_dir: Path) -> None:
    small = ModelRunner(tiny_model_dir, device="cpu", kv_memory_fraction=1e-6)
    assert 0 < small.pool.capacity < CPU_DEFAULT_KV_TOKENS
    assert small.capacity == small.pool.capacity
    # Half of host RAM is far more than the CPU cap.
    default = ModelRunner(tiny_model_dir, device="cpu")
    assert default.pool.capacity == CPU_DEFAULT_KV_TOKENS


def test_device_and_dtype_choice() -> None:
    cpu = torch.device("cpu")
    assert pick_device("cpu") == cpu
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_dtype("auto", "bfloat16", cpu) == torch.float32
    assert pick_dtype("auto", "bfloat16", torch.device("cuda")) == torch.bfloat16
    assert pick_dtype("auto", None, torch.device("cuda")) == torch.bfloat16
    assert pick_dtype("auto", "float32", torch.device("cuda")) == torch.bfloat16
    assert pick_dtype("fp16", "float32", cpu) == torch.float16
    assert parse_dtype("torch.bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype("float8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            pick_device("cuda")


@functools.lru_cache(maxsize=1)
def hf_model(model_dir: Path) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_schedule_matches_transformers(
    runner: ModelRunner, tiny_model_dir: Path, data: st.DataObject
) -> None:
    """Sequences of random lengths, each cut into random chunks, all advancing together
    in mixed batches (prefill chunks next to single tokens), through either backend, as
    stable sequences (table rows kept, only new slots sent) or one-step rows, some
    items not sampling: every returned row equals transformers' logits at that chunk's
    last position."""
    allocator_for(runner).reset()
    backends = {"sdpa": runner.backend}
    if importlib.util.find_spec("triton") is not None:
        backends["triton"] = triton_backend(runner)
    stable = data.draw(st.booleans(), label="stable req ids")
    lengths = data.draw(st.lists(st.integers(1, 24), min_size=1, max_size=4), label="lengths")
    reqs = [ids_of(n, start=11 * i + 4) for i, n in enumerate(lengths)]
    slots = [allocator_for(runner).alloc(n) for n in lengths]
    with torch.no_grad():
        refs = [hf_model(tiny_model_dir)(torch.tensor([s])).logits[0] for s in reqs]
    done = [0] * len(reqs)
    while any(d < len(s) for d, s in zip(done, reqs, strict=True)):
        items, expect = [], []
        for i, req in enumerate(reqs):
            if done[i] == len(req):
                continue
            n = data.draw(st.integers(1, len(req) - done[i]), label=f"chunk of req {i}")
            sample = data.draw(st.booleans(), label="sample")
            item = BatchItem(req[done[i] : done[i] + n], done[i], slots[i][: done[i] + n],
                                sample=sample)  # fmt: skip
            if stable:
                item.seq_id, item.dirty_from = 1000 + i, done[i]
            items.append(item)
            if sample:
                expect.append(refs[i][done[i] + n - 1])
            done[i] += n
        runner.backend = backends[data.draw(st.sampled_from(sorted(backends)), label="backend")]
        try:
            logits = runner.forward(items)
        finally:
            runner.backend = backends["sdpa"]
        assert logits.shape == (len(expect), runner.config.vocab_size)
        if expect:
            torch.testing.assert_close(logits, torch.stack(expect), atol=1e-4, rtol=0)
    for i in range(len(reqs)):
        runner.release(1000 + i)
    assert runner.table.num_rows == 0


def triton_backend(runner: ModelRunner):
    cfg = runner.config
    return make_backend(
        "triton", runner.pool.k, runner.pool.v, num_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim, sliding_window=None, device=runner.device,
    )  # fmt: skip
