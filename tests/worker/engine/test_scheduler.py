"""Scheduler units over a real SlotAllocator and RadixCache/NoCache, with a fake runner.

The fake runner's "KV" of a slot is the token id written there, and its next token is
a pure function of the whole sequence it reads back through the slot list. Like a
runner with a device-side slot table, it keeps each sequence's slots from earlier
steps and copies only `slots[dirty_from:]`. A slot that is stale, shared or freed too
early, or a wrong `dirty_from`, therefore changes the outputs, which are compared with
the same function applied to the true token sequence.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from worker.engine.allocator import SlotAllocator
from worker.engine.batch import Batch, BatchItem
from worker.engine.config import EngineConfig
from worker.engine.prefix_cache import NoCache
from worker.engine.radix_cache import RadixCache
from worker.engine.req import Req, ReqStatus
from worker.engine.scheduler import Scheduler
from worker.engine.types import SamplingParams

VOCAB = 97


def next_token(tokens: np.ndarray) -> int:
    """The fake model: depends on every token and its position."""
    weights = np.arange(1, len(tokens) + 1, dtype=np.int64)
    return int((tokens.astype(np.int64) * weights).sum() * 7 + len(tokens)) % VOCAB


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(np.array(tokens)))
    return tokens[len(prompt) :]


class FakeRunner:
    def __init__(self, capacity: int) -> None:
        self.kv = np.full(capacity, -1, dtype=np.int64)
        self.tokens_computed = 0
        self.tables: dict[int, np.ndarray] = {}  # seq_id -> the slots it was given
        self.released: list[int] = []

    def forward(self, items: list[BatchItem]) -> list[int]:
        out = []
        for item in items:
            end = item.end_pos
            assert len(item.slots) == end and item.dirty_from <= item.start_pos
            old = self.tables.get(item.seq_id, np.empty(0, dtype=np.int64))
            assert item.dirty_from <= len(old)
            table = np.concatenate([old[: item.dirty_from], item.slots[item.dirty_from :]])
            self.tables[item.seq_id] = table
            self.kv[table[item.start_pos :]] = item.input_ids
            self.tokens_computed += len(item.input_ids)
            if item.sample:
                out.append(next_token(self.kv[table]))
        return out

    def release(self, seq_id: int) -> None:
        self.tables.pop(seq_id, None)
        self.released.append(seq_id)


class _NoText:
    def push(self, token_id: int) -> str:
        return ""


class Harness:
    """Drives a Scheduler the way LLMEngine does, checking integrity after every step."""

    def __init__(self, capacity: int, cache: str = "radix", **cfg: object) -> None:
        self.config = EngineConfig(**cfg)  # type: ignore[arg-type]
        self.allocator = SlotAllocator(capacity)
        cache_cls = RadixCache if cache == "radix" else NoCache
        self.cache = cache_cls(self.allocator, page_size=self.config.page_size)
        self.runner = FakeRunner(capacity)
        self.sched = Scheduler(self.config, self.allocator, self.cache, self.runner.release)
        self.schedules: list[Batch] = []
        self._ids = 0

    def add(self, prompt: list[int], max_tokens: int, priority: int = 0) -> Req:
        req = Req(
            request_id=f"r{self._ids}",
            prompt_ids=list(prompt),
            params=SamplingParams(max_tokens=max_tokens, temperature=0),
            detokenizer=_NoText(),
            seq_id=self._ids,
            priority=priority,
        )
        self._ids += 1
        self.sched.add(req)
        return req

    def step(self) -> Batch:
        batch = self.sched.schedule()
        tokens = self.runner.forward(batch.items)
        self.sched.advance(batch)
        for req, tok in zip(batch.sampled, tokens, strict=True):
            req.append_token(tok, max_model_len=10**9)
            if req.finish_reason is not None:
                self.sched.finish(req)
        self.sched.check_integrity()
        self.schedules.append(batch)
        return batch

    def drive_random(
        self,
        rng: random.Random,
        stems: list[list[int]],
        *,
        steps: int,
        arrive_until: int,
        p_arrive: float,
        p_abort: float,
        max_suffix: int,
        max_tokens: int,
    ) -> list[Req]:
        """Random arrivals (a stem plus a random suffix) and aborts for `steps` steps, then
        run to the end; every request that was not aborted must equal the reference."""
        reqs, aborted = [], set()
        for step in range(steps):
            if step < arrive_until and rng.random() < p_arrive:
                suffix = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, max_suffix))]
                reqs.append(
                    self.add(rng.choice(stems) + suffix, max_tokens=rng.randrange(1, max_tokens))
                )
            live = [s for s in reqs if s.status is not ReqStatus.FINISHED]
            if live and rng.random() < p_abort:
                victim = rng.choice(live)
                self.sched.abort(victim)
                aborted.add(victim.seq_id)
                self.sched.check_integrity()
            if self.sched.has_work:
                self.step()
        self.run()
        for req in reqs:
            if req.seq_id not in aborted:
                assert req.output_ids == reference(req.prompt_ids, req.params.max_tokens)
        return reqs

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work:
                return
            self.step()
        raise AssertionError("scheduler made no progress")


def test_chunked_prefill_stays_under_the_budget() -> None:
    h = Harness(1000, max_prefill_tokens=32)
    a = h.add(list(range(1, 101)), max_tokens=3)
    b = h.add(list(range(200, 240)), max_tokens=3)
    h.run()
    prefill = [
        [
            (r.request_id, len(i.input_ids))
            for r, i in zip(s.reqs, s.items, strict=True)
            if len(i.input_ids) > 1
        ]
        for s in h.schedules
    ]
    # a: 100 tokens in chunks of 32; b starts in the budget a leaves over.
    assert prefill[:4] == [[("r0", 32)], [("r0", 32)], [("r0", 32)], [("r0", 4), ("r1", 28)]]
    assert all(sum(n for _, n in step) <= 32 for step in prefill)
    assert a.output_ids == reference(a.prompt_ids, 3)
    assert b.output_ids == reference(b.prompt_ids, 3)
    assert h.runner.tokens_computed == 100 + 40 + 2 * 2  # prompts + 2 decodes each


def test_running_requests_decode_together() -> None:
    h = Harness(1000)
    reqs = [h.add([i + 1] * 5, max_tokens=4) for i in range(3)]
    h.step()  # all three admitted and prefilled, each samples its first token
    for _ in range(3):
        s = h.step()
        assert [(r, len(i.input_ids)) for r, i in zip(s.reqs, s.items, strict=True)] == [
            (q, 1) for q in reqs
        ]
    assert not h.sched.has_work
    assert all(q.output_ids == reference(q.prompt_ids, 4) for q in reqs)


def test_max_running_requests_caps_the_batch() -> None:
    h = Harness(1000, max_running_requests=2)
    reqs = [h.add([i + 1] * 4, max_tokens=3) for i in range(5)]
    while h.sched.has_work:
        h.step()
        assert len(h.sched.running) <= 2
    assert all(q.output_ids == reference(q.prompt_ids, 3) for q in reqs)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_waiting_requests_are_admitted_by_priority_then_prefix(policy: str) -> None:
    """Lower priority first (the router's interactive class is -1, batch 1); among equal
    priorities the policy's own order: lpm takes the cached prefix first."""
    h = Harness(1000, max_running_requests=1, schedule_policy=policy)
    stem = list(range(1, 33))
    h.add(stem, max_tokens=2)
    h.run()  # stem is cached now
    batch = h.add([90] * 8, max_tokens=2, priority=1)
    cold = h.add([91] * 8, max_tokens=2)
    warm = h.add(stem + [92] * 8, max_tokens=2)
    urgent = h.add([93] * 8, max_tokens=2, priority=-1)
    admitted: list[Req] = []
    while h.sched.has_work:
        for req in h.step().reqs:
            if req not in admitted:
                admitted.append(req)
    expected = [urgent, warm, cold, batch] if policy == "lpm" else [urgent, cold, warm, batch]
    assert admitted == expected


@pytest.mark.parametrize(("page_size", "expected"), [(1, 40), (8, 40), (16, 32)])
def test_shared_prefix_is_matched_and_only_the_suffix_runs(page_size: int, expected: int) -> None:
    h = Harness(1000, page_size=page_size)
    rng = random.Random(0)
    prefix = [rng.randrange(1, VOCAB) for _ in range(40)]
    a = h.add([*prefix, 1, 2, 3], max_tokens=2)
    h.run()
    computed = h.runner.tokens_computed
    b = h.add([*prefix, 5, 6, 7, 8], max_tokens=2)
    h.run()
    assert a.cached_tokens == 0
    assert b.cached_tokens == expected
    assert h.runner.tokens_computed - computed == (44 - expected) + 1
    assert b.output_ids == reference(b.prompt_ids, 2)


def test_finished_sequence_is_inserted_into_the_cache() -> None:
    h = Harness(1000)
    a = h.add([3, 1, 4, 1, 5, 9, 2, 6], max_tokens=4)
    h.run()
    # Prompt + output, minus the last sampled token (it never ran through the model).
    with_kv = a.all_ids[:-1]
    assert h.cache.total_size == len(with_kv) == h.allocator.capacity - h.allocator.available
    assert h.cache.match_prefix(a.all_ids).prefix_len == len(with_kv)
    assert h.cache.protected_size == 0  # unlocked: evictable
    h.cache.reset()
    assert h.allocator.available == h.allocator.capacity


def test_full_pool_preempts_and_outputs_stay_exact() -> None:
    rng = random.Random(1)
    prefix = [rng.randrange(1, VOCAB) for _ in range(24)]
    prompts = [
        [*prefix, *(rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 20)))]
        for _ in range(12)
    ]
    # 120 slots for 12 requests of up to 44 + 30 tokens: eviction and preemption.
    h = Harness(120, max_prefill_tokens=40, evict_batch_tokens=16)
    reqs = [h.add(p, max_tokens=30) for p in prompts]
    h.run()
    assert h.sched.num_preemptions > 0
    assert any(s.preempted for s in h.schedules)
    for req in reqs:
        assert req.status is ReqStatus.FINISHED
        assert req.output_ids == reference(req.prompt_ids, 30)
    h.cache.reset()
    assert h.allocator.available == h.allocator.capacity


def test_lone_request_as_large_as_the_pool_completes() -> None:
    h = Harness(64, cache="none")
    req = h.add(list(range(1, 41)), max_tokens=24)  # 64 tokens, 63 with KV
    h.run()
    assert req.output_ids == reference(req.prompt_ids, 24)
    assert h.allocator.available == 64


def test_abort_frees_everything_in_every_state() -> None:
    h = Harness(200, max_prefill_tokens=16)
    decoding = h.add(list(range(1, 11)), max_tokens=50)
    prefilling = h.add(list(range(20, 60)), max_tokens=5)
    waiting = h.add(list(range(60, 70)), max_tokens=5)
    h.step()
    h.step()
    assert decoding.output_ids and prefilling.is_prefilling
    assert waiting.status is ReqStatus.WAITING or waiting.is_prefilling
    for req in (prefilling, waiting, decoding):
        h.sched.abort(req)
        h.sched.check_integrity()
        assert req.status is ReqStatus.FINISHED and len(req.slots) == 0
    assert not h.sched.has_work
    h.cache.reset()
    assert h.allocator.available == h.allocator.capacity


@pytest.mark.parametrize("seed", range(6))
def test_random_load_with_aborts_keeps_integrity(seed: int) -> None:
    rng = random.Random(seed)
    stems = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 30))] for _ in range(3)]
    h = Harness(
        rng.randrange(90, 200),
        cache=rng.choice(["radix", "none"]),
        page_size=rng.choice([1, 4]),
        max_prefill_tokens=rng.randrange(8, 64),
        max_running_requests=rng.randrange(2, 8),
        evict_batch_tokens=rng.randrange(1, 32),
    )
    h.drive_random(
        rng, stems, steps=400, arrive_until=150, p_arrive=0.3, p_abort=0.05, max_suffix=20,
        max_tokens=25,
    )  # fmt: skip
    h.cache.reset()
    assert h.allocator.available == h.allocator.capacity


def test_request_that_could_never_fit_is_rejected_at_submit() -> None:
    from types import SimpleNamespace

    from worker.engine.engine import LLMEngine
    from worker.engine.types import EngineError, EngineRequest

    runner = SimpleNamespace(
        capacity=64,
        config=SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=4096, eos_token_ids=()),
        release=lambda seq_id: None,
    )
    tokenizer = SimpleNamespace(eos_token_ids=(), detokenizer=_NoText)
    engine = LLMEngine(runner, tokenizer, EngineConfig(), sampler=None)
    assert engine.max_model_len == 64  # capped by the pool, not the model's 4096
    cfg = EngineConfig(max_model_len=32)
    assert LLMEngine(runner, tokenizer, cfg, sampler=None).max_model_len == 32
    runner.capacity = 10_000
    cfg = EngineConfig(max_model_len=9000)
    assert LLMEngine(runner, tokenizer, cfg, sampler=None).max_model_len == 4096
    runner.capacity = 64

    def submit(n: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens)
        engine.add_request(
            EngineRequest(f"n{n}-{max_tokens}", prompt_token_ids=(1,) * n, params=params)
        )

    submit(40, 24)  # exactly fits
    with pytest.raises(EngineError) as err:
        submit(64, 1)  # longer than the whole pool
    assert err.value.param == "prompt" and err.value.code == "context_length_exceeded"
    with pytest.raises(EngineError) as err:
        submit(40, 25)
    assert err.value.param == "max_tokens"
    assert len(engine.scheduler.waiting) == 1  # nothing of the rejected ones was queued


def test_decode_slots_grow_in_place_and_earlier_views_hold() -> None:
    """Decoding appends each slot into a buffer that doubles when full (`_grow`): 300
    tokens cross several doublings, every batch item still reads the slots it was given,
    and the buffers go with their sequences; outputs stay exact."""
    h = Harness(1000)
    a = h.add(list(range(1, 21)), max_tokens=300)
    b = h.add(list(range(30, 45)), max_tokens=150)
    views = []
    while h.sched.has_work:
        views += [(item.slots, item.slots.copy()) for item in h.step().items]
    assert all((view == seen).all() for view, seen in views)
    assert a.output_ids == reference(a.prompt_ids, 300)
    assert b.output_ids == reference(b.prompt_ids, 150)
    assert not h.sched._slot_buffers  # released with their sequences


def test_ids_between_positions_equal_the_slice_of_all_ids() -> None:
    h = Harness(100)
    req = h.add([11, 12, 13, 14], max_tokens=3)
    req.output_ids = [21, 22, 23]
    whole = req.all_ids
    assert all(req.ids(a, b) == whole[a:b] for a in range(8) for b in range(a, 8))
