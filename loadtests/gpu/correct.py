"""The GPU check's correctness section: our kernels vs SDPA on the device, and host
synchronisations per engine step (`SyncCounter`, below; the CPU tests use it too).

The kernel comparison is the CPU test's (tests/worker/engine/test_attention_backends.py)
at GPU sizes: random batches mixing decodes over long contexts, prefix hits of random
lengths and fresh or chunked prefills, slots drawn at random from the pool, for GQA
ratios 1 / 4 / 7 and head dims 64 / 128, in fp32 (max abs diff <= 1e-3) and bf16
(<= 3% of the largest output).

Host syncs: count the times the host waits for the device during a block of engine work.

On CUDA this is CUDA's own account: `torch.cuda.set_sync_debug_mode("warn")` makes
every synchronising call (a device->host read, a blocking host->device copy, a
stream or device synchronize) raise a warning, and each one is counted.

On CPU nothing ever waits, so the count is of the calls that WOULD wait on a GPU:
device->host reads of a tensor (`item`, `tolist`, `numpy`, `cpu`, `bool`/`int`/
`float`/`index` of a tensor), host->device copies that are not asynchronous
(`torch.tensor`/`torch.as_tensor` with a device, `Tensor.to(device)` without
`non_blocking=True`; `Staging.upload`, which copies from pinned memory without
blocking, is the allowed way up), and explicit synchronizes. `paused()` stops
counting around work that is the device's own (a triton kernel launch, which the
interpreter runs on the host).
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.engine.batch import BatchItem
from worker.engine.runtime.attention import make_backend
from worker.engine.runtime.attention.metadata import ReqToTokenTable, Staging, build_step


def random_batch(
    rng: np.random.Generator, capacity: int, n_items: int, scale: int
) -> list[BatchItem]:
    free = rng.permutation(capacity)
    items, used = [], 0
    for _ in range(n_items):
        kind = rng.choice(["decode", "prefix_hit", "prefill"])
        if kind == "decode":
            start, n = int(rng.integers(1, 40 * scale)), 1
        elif kind == "prefix_hit":
            start, n = int(rng.integers(1, 20 * scale)), int(rng.integers(2, 10 * scale))
        else:
            start, n = 0, int(rng.integers(1, 10 * scale))
        slots = free[used : used + start + n].astype(np.int64)
        used += start + n
        items.append(BatchItem(list(rng.integers(0, 100, n)), start, slots))
    return items


def compare_once(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                 head_dim: int, seed: int, scale: int) -> float:  # fmt: skip
    """Max abs difference triton - sdpa on one random batch (relative for bf16)."""
    rng = np.random.default_rng(seed)
    capacity = 700 * scale
    batch = random_batch(rng, capacity, n_items=8, scale=scale)
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    k_buf, v_buf = rand(capacity + 1, kv_heads, head_dim), rand(capacity + 1, kv_heads, head_dim)
    kw = dict(num_heads=heads, head_dim=head_dim, sliding_window=None, device=device)
    sdpa = make_backend("sdpa", [k_buf], [v_buf], **kw)
    triton = make_backend("triton", [k_buf], [v_buf], **kw)
    table = ReqToTokenTable(4, 40 * scale + 64, device)
    inputs = build_step(batch, list(range(len(batch))), table, Staging(device))
    meta = inputs.meta
    t = inputs.input_ids.shape[0]
    q, k, v = rand(t, heads, head_dim), rand(t, kv_heads, head_dim), rand(t, kv_heads, head_dim)
    k_buf.index_copy_(0, meta.out_slots, k)
    v_buf.index_copy_(0, meta.out_slots, v)
    want = sdpa.attend(0, q, k, v, meta).float()
    got = triton.attend(0, q, k, v, meta).float()
    diff = (got - want).abs().max().item()
    return diff / want.abs().max().item() if dtype != torch.float32 else diff


def kernels_vs_sdpa(device: torch.device, quick: bool) -> dict[str, Any]:
    scale = 1 if quick or device.type != "cuda" else 40  # contexts up to ~1,600 on a GPU
    dtypes = (torch.float32,) if device.type != "cuda" else (torch.float32, torch.bfloat16)
    # (heads, kv_heads, head_dim): GQA 1, 4 and 7 (7: Qwen2.5-0.5B's 14/2), dims 64 and 128.
    full = ((4, 4, 128), (16, 4, 64), (14, 2, 64), (28, 4, 128))
    shapes = ((2, 2, 64), (8, 2, 128), (7, 1, 64)) if quick else full
    cases = []
    for dtype in dtypes:
        for heads, kv_heads, head_dim in shapes:
            diff = compare_once(device, dtype, heads, kv_heads, head_dim, seed=heads + head_dim,
                                scale=scale)  # fmt: skip
            limit = 1e-3 if dtype == torch.float32 else 3e-2
            cases.append({"dtype": str(dtype).removeprefix("torch."), "heads": heads,
                          "kv_heads": kv_heads, "head_dim": head_dim, "max_abs_diff": diff,
                          "limit": limit, "ok": diff <= limit})  # fmt: skip
    return {"cases": cases, "passed": all(c["ok"] for c in cases)}


def host_syncs(device: torch.device) -> dict[str, Any]:
    """Syncs per engine step on the tiny model (the count does not depend on size)."""
    from worker.engine.config import EngineConfig
    from worker.engine.runtime.load import load_engine
    from worker.models.tiny_model import make_tiny_model

    model_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="gpu-check-syncs-")))
    backend = "triton" if device.type == "cuda" else "sdpa"
    config = EngineConfig(device=str(device), kv_capacity_tokens=4096, max_prefill_tokens=16,
                          attention_backend=backend)  # fmt: skip
    engine = load_engine(model_dir, config)
    counter = SyncCounter(device)
    with counter:
        result = syncs_per_step(engine, counter)
    how = "CUDA sync debug mode" if device.type == "cuda" else "counted calls (CPU)"
    return result | {"how": how, "backend": backend}


def correctness_section(rec: Any, device: torch.device, quick: bool) -> None:
    rec.step("kernels", lambda: kernels_vs_sdpa(device, quick), need_s=10)
    rec.step("syncs", lambda: host_syncs(device), need_s=10)


_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


class SyncCounter:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._calls: list[str] = []  # CPU: what would synchronise, and where
        self._paused = 0
        self._undo: list[tuple[Any, str, Any]] = []
        self._warnings: Any = None
        self._log: list[warnings.WarningMessage] = []

    @property
    def events(self) -> list[str]:
        """What synchronised since the last reset, and where (file:line)."""
        cuda = [f"{w.message} at {w.filename}:{w.lineno}" for w in self._log
                if "synchroniz" in str(w.message)]  # fmt: skip
        return self._calls + cuda

    @property
    def count(self) -> int:
        return len(self.events)

    def reset(self) -> None:
        self._calls.clear()
        self._log.clear()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __enter__(self) -> SyncCounter:
        if self.device.type == "cuda":
            self._warnings = warnings.catch_warnings(record=True)
            self._log = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            # The sampler reads a step's draws after waiting on that step's copy event
            # (runtime/sampler.py `Sampled`): a wait the debug mode does not report.
            self._wrap(torch.cuda.Event, "synchronize", lambda *a, **k: True)
            return self
        for name in _READS:
            self._wrap(torch.Tensor, name, lambda *a, **k: True)
        self._wrap(torch.Tensor, "to", _is_blocking_move)
        self._wrap(torch.Tensor, "cuda", lambda *a, **k: not k.get("non_blocking"))
        for name in ("tensor", "as_tensor"):
            self._wrap(torch, name, lambda *a, **k: k.get("device") is not None)
        self._wrap(torch.cuda, "synchronize", lambda *a, **k: True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._warnings is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(*exc)
            self._warnings = None
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def _wrap(self, owner: Any, name: str, counts: Any) -> None:
        original = getattr(owner, name)
        counter = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not counter._paused and counts(*args, **kwargs):
                caller = sys._getframe(1)
                where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
                counter._calls.append(f"{name} at {where}")
            counter._paused += 1  # what it calls inside is the same event
            try:
                return original(*args, **kwargs)
            finally:
                counter._paused -= 1

        self._undo.append((owner, name, original))
        setattr(owner, name, wrapper)


def _is_blocking_move(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
    """`Tensor.to(...)` that names a device and does not ask for non_blocking."""
    target = kwargs.get("device", args[0] if args else None)
    if not isinstance(target, (torch.device, str)):
        return False
    return not kwargs.get("non_blocking", len(args) > 2 and args[2])


def syncs_per_step(engine: Any, counter: SyncCounter) -> dict[str, Any]:
    """Host synchronisations of each engine step in three scenarios, run twice: the
    first pass warms up (triton compiles, CUDA graphs are captured: those wait on
    purpose), the second is counted. Also how many steps were mixed (decodes + a
    prefill chunk). A step that samples nothing (a chunk that is not a prompt's last)
    must not synchronise at all; a step that samples must do so exactly once."""
    from worker.engine.types import EngineRequest, SamplingParams

    vocab = min(engine.vocab_size, 1000)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    fancy = SamplingParams(max_tokens=5, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05,
                           presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                           logit_bias=((5, 2.0),), logprobs=True, top_logprobs=3, seed=7,
                           ignore_eos=True)  # fmt: skip
    long_prompt = 3 * engine.config.max_prefill_tokens + 5
    scenarios = {  # name: [(prompt length, params, steps to wait before adding it)]
        "decode": [(9, greedy, 0), (17, greedy, 0), (5, greedy, 0)],
        "mixed": [(9, greedy, 0), (12, greedy, 0), (long_prompt, greedy, 2)],
        "penalties_logprobs": [(9, fancy, 0), (14, fancy, 0), (6, greedy, 0), (11, fancy, 0)],
    }
    result: dict[str, Any] = {}
    unexpected: list[str] = []  # the syncs of steps that made more than they should
    for counted in (False, True):
        for name, plan in scenarios.items():
            engine.flush_cache()
            result[name] = _run(engine, counter, plan, vocab, EngineRequest, counted, unexpected)
    per_step = {name: sorted({n for n, sampled, _ in r if sampled}) for name, r in result.items()}
    ok = all(n == (1 if sampled else 0) for r in result.values() for n, sampled, _ in r)
    mixed = sum(m for _, _, m in result["mixed"])
    return {"per_step": per_step, "steps": {k: len(v) for k, v in result.items()},
            "mixed_steps": mixed, "passed": ok and mixed > 0,
            "unexpected": unexpected[:20]}  # fmt: skip


def _run(engine: Any, counter: SyncCounter, plan: list, vocab: int, request: Any,
         counted: bool, unexpected: list[str]) -> list[tuple[int, bool, bool]]:  # fmt: skip
    steps: list[tuple[int, bool, bool]] = []
    pending = sorted(enumerate(plan), key=lambda x: x[1][2])
    step = 0
    # With overlap scheduling (worker/engine/engine.py) a step reads the draws of the
    # step launched before it, so that one's sampling is what this one waits for.
    overlap, launched_sampled = getattr(engine, "overlap", False), False
    while pending or engine.has_work:
        while pending and pending[0][1][2] <= step:
            i, (n, params, _) = pending.pop(0)
            ids = tuple(4 + (7 * j + 13 * i) % (vocab - 4) for j in range(n))
            engine.add_request(request(f"r{i}", prompt_token_ids=ids, params=params))
        counter.reset()
        engine.step()
        items = engine.last_batch.items
        lens = {len(it.input_ids) == 1 for it in items}
        sampled_now = bool(items) and bool(engine.last_batch.sampled)
        sampled = launched_sampled if overlap else sampled_now
        launched_sampled = sampled_now
        if counted and items:
            steps.append((counter.count, sampled, lens == {True, False}))
            if counter.count > sampled:
                unexpected += counter.events
        step += 1
    return steps
