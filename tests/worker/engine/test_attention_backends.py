"""The triton kernels equal the SDPA reference on random mixed batches.

On a machine without a GPU the kernels run in triton's interpreter on CPU tensors
(TRITON_INTERPRET=1, set by tests/conftest.py); sizes stay small so that stays fast.
Each batch mixes decodes (one token over a long context), prefix hits of random
lengths (a suffix over cached slots) and fresh or chunked prefills, with slots drawn
at random from the pool (so nothing is contiguous), for GQA ratios 1, 4 and 7 and
head dims 32, 80 (not a power of two: masked lanes) and 128.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.engine.batch import BatchItem
from worker.engine.runtime.attention import make_backend, resolve_backend
from worker.engine.runtime.attention.metadata import ReqToTokenTable, Staging, build_step

pytest.importorskip("triton")

CPU = torch.device("cpu")
CAPACITY = 700


def random_batch(rng: np.random.Generator, n_items: int) -> list[BatchItem]:
    free = rng.permutation(CAPACITY)
    items, used = [], 0
    for _ in range(n_items):
        kind = rng.choice(["decode", "prefix_hit", "prefill"])
        if kind == "decode":
            start, n = int(rng.integers(1, 160)), 1
        elif kind == "prefix_hit":
            start, n = int(rng.integers(1, 90)), int(rng.integers(2, 40))
        else:
            start, n = 0, int(rng.integers(1, 40))
        slots = free[used : used + start + n].astype(np.int64)
        used += start + n
        items.append(BatchItem(list(rng.integers(0, 100, n)), start, slots))
    return items


def backends(heads: int, kv_heads: int, head_dim: int, window: int = 0, splits: int = 3):
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    k = [torch.randn(CAPACITY + 1, kv_heads, head_dim, generator=g)]
    v = [torch.randn(CAPACITY + 1, kv_heads, head_dim, generator=g)]
    sdpa = make_backend("sdpa", k, v, num_heads=heads, head_dim=head_dim,
                        sliding_window=window, device=CPU)  # fmt: skip
    triton = make_backend("triton", k, v, num_heads=heads, head_dim=head_dim,
                          sliding_window=window, device=CPU)  # fmt: skip
    triton.num_splits = splits
    return sdpa, triton, k[0], v[0]


def run_both(batch: list[BatchItem], heads: int, kv_heads: int, head_dim: int, **kw):
    sdpa, triton, k_buf, v_buf = backends(heads, kv_heads, head_dim, **kw)
    table = ReqToTokenTable(4, 256, CPU)  # fewer rows than items: the table grows
    inputs = build_step(batch, list(range(len(batch))), table, Staging(CPU))
    meta = inputs.meta
    t = inputs.input_ids.shape[0]
    g = torch.Generator().manual_seed(t)
    q = torch.randn(t, heads, head_dim, generator=g)
    k = torch.randn(t, kv_heads, head_dim, generator=g)
    v = torch.randn(t, kv_heads, head_dim, generator=g)
    k_buf.index_copy_(0, meta.out_slots, k)  # what the model does before attending
    v_buf.index_copy_(0, meta.out_slots, v)
    return sdpa.attend(0, q, k, v, meta), triton.attend(0, q, k, v, meta), meta


@pytest.mark.parametrize("head_dim", [32, 80, 128])
@pytest.mark.parametrize("group", [1, 4, 7])
def test_triton_equals_sdpa_on_mixed_batches(group: int, head_dim: int) -> None:
    kv_heads = 1 if group == 7 else 2
    rng = np.random.default_rng(group * 1000 + head_dim)
    batch = random_batch(rng, n_items=6)
    want, got, meta = run_both(batch, group * kv_heads, kv_heads, head_dim)
    assert meta.decode_idx.numel() + meta.extend_idx.numel() == len(batch)
    assert (got - want).abs().max().item() <= 1e-3


@pytest.mark.parametrize("splits", [1, 4, 16])
def test_decode_splits_longer_and_shorter_than_the_context(splits: int) -> None:
    """Flash-decoding merges the pieces exactly, also when most pieces are empty."""
    rng = np.random.default_rng(splits)
    free = rng.permutation(CAPACITY)
    batch = [BatchItem([1], n - 1, free[o : o + n].astype(np.int64))
             for n, o in ((3, 0), (200, 3), (57, 203))]  # fmt: skip
    want, got, meta = run_both(batch, 8, 2, 64, splits=splits)
    assert meta.extend_idx.numel() == 0
    assert (got - want).abs().max().item() <= 1e-3


def test_each_sequence_uses_the_pieces_its_length_calls_for() -> None:
    """The grid has 8 pieces per sequence; a sequence uses cdiv(len, min_split_len) of
    them (at most 8; pieces are whole 32-key tiles under the interpreter): the unused
    ones end with lse = -inf and weigh nothing."""
    from worker.engine.runtime.attention.triton_kernels import decode_attention

    rng = np.random.default_rng(11)
    free = rng.permutation(CAPACITY)
    lens = (3, 256, 57, 32, 33)
    offsets = np.cumsum((0, *lens))
    batch = [BatchItem([1], n - 1, free[o : o + n].astype(np.int64))
             for n, o in zip(lens, offsets, strict=False)]  # fmt: skip
    sdpa, _, k_buf, v_buf = backends(8, 2, 64)
    meta = build_step(
        batch, list(range(len(batch))), ReqToTokenTable(8, 256, CPU), Staging(CPU)
    ).meta
    q = torch.randn(len(lens), 8, 64)
    out = torch.empty_like(q)
    o_part = torch.empty(len(lens), 8, 8, 64)
    lse = torch.empty(len(lens), 8, 8)
    decode_attention(q, k_buf, v_buf, out, meta.table, meta.decode_idx, meta.rows, meta.seq_lens,
                     meta.q_loc, num_splits=8, sm_scale=64**-0.5, partials=(o_part, lse),
                     min_split_len=32)  # fmt: skip
    used = torch.isfinite(lse[:, 0]).sum(dim=1).tolist()
    assert used == [1, 8, 2, 1, 2]
    want = sdpa.attend(0, q, k_buf[meta.out_slots], v_buf[meta.out_slots], meta)
    assert (out - want).abs().max().item() <= 1e-3


def test_extend_reads_kv_once_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """One extend program per (item, KV head, token block): a group's query heads share
    it, so the grid's second axis is the KV heads, not the query heads."""
    from worker.engine.runtime.attention import triton_kernels

    grids = []
    kernel = triton_kernels._extend_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_kernels, "_extend_kernel", Spy())
    batch = [BatchItem(list(range(30)), 10, np.arange(40)),
             BatchItem(list(range(5)), 0, np.arange(40, 45))]  # fmt: skip
    want, got, _ = run_both(batch, 14, 2, 32)
    assert [g[:2] for g in grids] == [(2, 2)]
    assert (got - want).abs().max().item() <= 1e-3


def test_sliding_window_in_both_kernels() -> None:
    rng = np.random.default_rng(7)
    batch = random_batch(rng, n_items=6)
    want, got, _ = run_both(batch, 4, 2, 64, window=9)
    assert (got - want).abs().max().item() <= 1e-3
    full, _, _ = run_both(batch, 4, 2, 64)
    assert (full - want).abs().max().item() > 1e-2  # the window changed something


def test_padded_decode_batch_gives_the_same_rows() -> None:
    """A CUDA-graph batch is padded to its bucket with dummy items; the real rows'
    outputs do not change and the dummies write only the pad slot."""
    sdpa, triton, k_buf, v_buf = backends(8, 2, 64)
    rng = np.random.default_rng(3)
    free = rng.permutation(CAPACITY)
    batch = [BatchItem([5], n - 1, free[o : o + n].astype(np.int64)) for n, o in ((9, 0), (70, 9))]
    table = ReqToTokenTable(4, 128, CPU)
    plain = build_step(batch, ["a", "b"], table, Staging(CPU))
    padded = build_step(batch, ["a", "b"], table, Staging(CPU), pad_to=8, pad_slot=CAPACITY)
    assert padded.input_ids.shape == (8,) and plain.input_ids.shape == (2,)
    assert padded.meta.out_slots[2:].tolist() == [CAPACITY] * 6
    assert padded.meta.rows[2:].tolist() == [table.pad_row] * 6
    assert padded.meta.seq_lens[2:].tolist() == [1] * 6
    assert torch.equal(padded.sample_rows, plain.sample_rows)
    q = torch.randn(8, 8, 64)
    for backend in (sdpa, triton):
        slots = padded.meta.out_slots
        a = backend.attend(0, q[:2], k_buf[slots[:2]], v_buf[slots[:2]], plain.meta)
        b = backend.attend(0, q, k_buf[slots], v_buf[slots], padded.meta)
        torch.testing.assert_close(a, b[:2], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="decode batch"):
        build_step([BatchItem([1, 2], 0, np.arange(2))], ["c"], table, Staging(CPU), pad_to=4)


def test_backend_choice() -> None:
    assert resolve_backend("auto", CPU) == "sdpa"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_backend("triton", CPU) == "triton"  # TRITON_INTERPRET=1 here
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("flash", CPU)


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", CPU)
