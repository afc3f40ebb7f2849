"""The runner's side of the seam: the device request->token table, what moves each
step, and the CUDA-graph buckets (their padding is tested in test_attention_backends)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.worker.engine.slots import allocator_for
from worker.engine.runtime.cuda_graphs import BUCKETS, bucket_for
from worker.engine.runtime.runner import BatchItem, ModelRunner


class WatchedSlots(np.ndarray):
    """A slot array that records the lowest index the runner read."""

    lowest: int

    def __getitem__(self, key):  # type: ignore[override]
        start = key.start or 0 if isinstance(key, slice) else int(key)
        self.lowest = min(getattr(self, "lowest", 1 << 30), start)
        return np.asarray(self).__getitem__(key)


def watched(a: np.ndarray) -> WatchedSlots:
    return np.asarray(a, dtype=np.int64).view(WatchedSlots)


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    return ModelRunner(
        tiny_model_dir, device="cpu", kv_capacity_tokens=2048, max_running_requests=2
    )


def ids(n: int, seed: int) -> list[int]:
    return [4 + (seed * 31 + 7 * i) % 900 for i in range(n)]


def decode_steps(runner: ModelRunner, context: int, steps: int = 3) -> list[int]:
    """Prefill 3 sequences to `context` tokens, then decode `steps` tokens each, every
    step sending only the new slot (dirty_from = start_pos); the host->device int64
    count of each decode step."""
    allocator_for(runner).reset()
    reqs = {sid: ids(context, sid) for sid in (1, 2, 3)}
    slots = {sid: allocator_for(runner).alloc(context + steps) for sid in reqs}
    runner.forward([BatchItem(s, 0, slots[i][:context], seq_id=i) for i, s in reqs.items()])
    moved = []
    for step in range(steps):
        pos = context + step
        batch = [BatchItem([5 + i], pos, watched(slots[i][: pos + 1]), seq_id=i,
                              dirty_from=pos) for i in reqs]  # fmt: skip
        runner.forward(batch)
        assert all(item.slots.lowest >= pos for item in batch)  # the prefix was never read
        moved.append(runner.host_elements_last_step)
    for i in reqs:
        runner.release(i)
    return moved


def test_host_work_per_decode_step_does_not_grow_with_context(runner: ModelRunner) -> None:
    short, long = decode_steps(runner, 20), decode_steps(runner, 600)
    assert short == long
    # ids, positions, new slots, table values + indices: 5 per sequence; 5 per-item
    # fields; decode/extend index; one sample row each.
    assert short[0] == 3 * 5 + 3 * 5 + 3 + 3
    assert runner.table.num_rows == 0


def test_stable_rows_give_the_same_logits_as_full_slot_lists(runner: ModelRunner) -> None:
    allocator_for(runner).reset()
    req = ids(40, 9)
    slots = allocator_for(runner).alloc(41)
    runner.forward([BatchItem(req[:30], 0, slots[:30], seq_id=7)])
    runner.forward([BatchItem(req[30:40], 30, slots[:40], seq_id=7, dirty_from=30)])
    got = runner.forward([BatchItem([11], 40, slots, seq_id=7, dirty_from=40)])
    want = runner.forward([BatchItem([11], 40, slots)])  # a one-step row: all slots
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    runner.release(7)


def test_dirty_prefix_slots_are_rewritten(runner: ModelRunner) -> None:
    """The scheduler re-points prefix slots (e.g. a radix insert kept another copy of
    the same tokens): the runner reads the new slots from dirty_from on."""
    allocator_for(runner).reset()
    req = ids(30, 4)
    slots = allocator_for(runner).alloc(31)
    runner.forward([BatchItem(req, 0, slots[:30], seq_id=3)])
    before = runner.forward([BatchItem([9], 30, slots, seq_id=3, dirty_from=30)])
    # Move positions 10..29 to fresh slots holding the same K/V; the old ones are zeroed.
    moved = allocator_for(runner).alloc(20)
    for layer in range(runner.config.num_hidden_layers):
        for buf in (runner.pool.k[layer], runner.pool.v[layer]):
            buf[moved] = buf[slots[10:30]]
            buf[slots[10:30]] = 0
    new_slots = np.concatenate([slots[:10], moved, slots[30:]])
    # Position 30 is recomputed (its K/V rewritten at the same slot).
    after = runner.forward([BatchItem([9], 30, new_slots, seq_id=3, dirty_from=10)])
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)
    stale = runner.forward([BatchItem([9], 30, new_slots, seq_id=3, dirty_from=30)])
    assert torch.equal(stale, after)  # the table kept the rewritten prefix
    runner.release(3)


def test_bad_dirty_from_is_a_clear_error(runner: ModelRunner) -> None:
    allocator_for(runner).reset()
    slots = allocator_for(runner).alloc(12)
    with pytest.raises(ValueError, match="new to the runner"):
        runner.forward([BatchItem(ids(2, 1), 10, slots, seq_id=50, dirty_from=10)])
    runner.forward([BatchItem(ids(5, 1), 0, slots[:5], seq_id=51)])
    with pytest.raises(ValueError, match="past the 5 positions"):
        runner.forward([BatchItem(ids(2, 1), 10, slots, seq_id=51, dirty_from=7)])
    with pytest.raises(ValueError, match="dirty_from"):
        runner.forward([BatchItem(ids(2, 1), 10, slots, seq_id=51, dirty_from=11)])
    runner.release(51)
    runner.release(51)  # unknown ids are a no-op


def test_table_grows_past_its_initial_rows(runner: ModelRunner) -> None:
    allocator_for(runner).reset()
    generation = runner.table.generation
    batch = [BatchItem(ids(4, i), 0, allocator_for(runner).alloc(4), seq_id=100 + i)
             for i in range(5)]  # fmt: skip
    first = runner.forward(batch)
    assert runner.table.num_rows == 5 and runner.table.generation > generation
    again = runner.forward([BatchItem(ids(4, i), 0, b.slots) for i, b in enumerate(batch)])
    torch.testing.assert_close(first, again, atol=1e-6, rtol=0)
    for i in range(5):
        runner.release(100 + i)


def test_graph_buckets() -> None:
    assert bucket_for(1) == 1 and bucket_for(3) == 4 and bucket_for(33) == 48
    assert bucket_for(BUCKETS[-1]) == BUCKETS[-1] and bucket_for(BUCKETS[-1] + 1) is None
    assert list(BUCKETS) == sorted(set(BUCKETS))
    assert bucket_for(5, (2, 8)) == 8


def test_decode_split_count_depends_on_the_batch_only() -> None:
    """A CUDA graph captured for a batch size must stay valid at any context length."""
    from worker.engine.runtime.attention.triton_backend import MAX_SPLITS, splits_for

    assert splits_for(1, 2) == MAX_SPLITS  # one sequence: spread its context wide
    assert splits_for(128, 8) == 1  # enough programs already
    counts = [splits_for(b, 2) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert counts == sorted(counts, reverse=True)
    assert all(c & (c - 1) == 0 for c in counts)  # powers of two
