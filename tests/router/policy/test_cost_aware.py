"""cost_aware's decisions on constructed fleets (pure: no servers, seeded randomness).

Numbers are chosen so each prediction is exact: with ``tree_chars_per_token`` 4, a
text of 4,000 chars is 1,000 tokens; at 20 µs a token its full prefill is 20 ms.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from router.policy import build_routing
from router.policy.base import Decision, FleetView, RouteRequest, WorkerView
from router.policy.cost_aware import CostAware
from router.routing import Routing
from shared.config import RouterConfig
from shared.wire.registry import WorkerRecord

PREFIX = "p" * 3_960  # with a 40-char question: 4,000 chars, 1,000 tokens


def policy(seed: int = 0, **keys: Any) -> Routing:
    p = build_routing(RouterConfig(policy="cost_aware", **keys), random.Random(seed))
    assert isinstance(p.policy, CostAware)
    HEARTBEATS[id(p)] = {}
    return p


def fleet(*loads: int) -> list[WorkerView]:
    return [WorkerView(f"w{i}", load) for i, load in enumerate(loads)]


# The table's side: each policy's workers' last heartbeats, as (record, read at). A
# heartbeat given by `beat` is read just before the next request (`ask`), as discovery
# reads the registry between requests.
HEARTBEATS: dict[int, dict[str, tuple[WorkerRecord, float | None]]] = {}


def beat(
    p: CostAware, worker_id: str, queued: int = 0, prefill_us: float = 0.0,
    decode_ms: float = 0.0, seats: int = 0, request_ms: float = 0.0, hit_rate: float = 0.0,
) -> None:  # fmt: skip
    prompt = 1_000_000 if hit_rate else 0  # hit rates here are multiples of 1e-6
    record = WorkerRecord(
        worker_id, "http://w", "m", "sim", 1.0, queued_prefill_tokens=queued,
        prefill_us_per_token=prefill_us, decode_ms_per_token=decode_ms,
        max_running_requests=seats, request_ms=request_ms, prompt_tokens_total=prompt,
        cached_tokens_total=round(hit_rate * prompt),
    )  # fmt: skip
    HEARTBEATS.setdefault(id(p), {})[worker_id] = (record, None)


def with_reports(p: CostAware, workers: list[WorkerView], now: float) -> list[WorkerView]:
    beats = HEARTBEATS.setdefault(id(p), {})
    for wid, (record, at) in beats.items():
        if at is None:
            beats[wid] = (record, now)
    out = []
    for w in workers:
        record, at = beats.get(w.worker_id, (None, 0.0))
        out.append(WorkerView(w.worker_id, w.load, w.kv_capacity_tokens, record, at or 0.0))
    return out


def ask(p: CostAware, text: str, workers: list[WorkerView], now: float = 0.0) -> Decision:
    return p.select(RouteRequest(text), with_reports(p, workers, now), now)


def question(i: int) -> str:
    return f"{i:>40}"


def report(p: CostAware, n: int, queued: dict[int, int] | None = None, us: float = 20.0) -> None:
    for i in range(n):
        beat(p, f"w{i}", (queued or {}).get(i, 0), us, 1.0)


def test_long_queue_loses_to_idle_worker_unless_the_cached_share_saves_more() -> None:
    # w0 holds the prefix (990 tokens). Its queue costs 20 µs a token like the prefill.
    for queue, expect, reason in ((5_000, "w1", "spill"), (500, "w0", "cache_hit")):
        p = policy()
        report(p, 2)
        p.holdings.observe("w0", PREFIX + question(0), now=0.0)
        report(p, 2, {0: queue})
        d = ask(p, PREFIX + question(1), fleet(0, 0), now=1.0)
        # w0: (queue + 1,000 − 999 cached) × 0.02 ms; w1: 1,000 × 0.02 ms = 20 ms.
        assert (d.worker_id, d.reason) == (expect, reason), queue


def test_break_even_is_where_the_queue_costs_what_the_cache_saves() -> None:
    # 1 ms a token (exact arithmetic), no decode term. w1 caches 25 tokens of a
    # 100-token request: w0 costs 100 ms, w1 costs (queued + 100 − 25) ms. Below 25
    # queued w1 wins, above it w0, and at exactly 25 the tie goes to the longer match.
    for queued, expect in ((24, "w1"), (25, "w1"), (26, "w0")):
        p = policy(cost_decode_weight=0.0)
        beat(p, "w0", 0, 1_000.0, 1.0)
        beat(p, "w1", queued, 1_000.0, 1.0)
        p.holdings.observe("w1", "x" * 100, now=0.0)
        assert ask(p, "x" * 400, fleet(0, 0)).worker_id == expect, queued


def test_host_tier_hits_save_their_prefill_less_their_load() -> None:
    # As above (1 ms a token, w1 caches 25 of 100 tokens), but every hit w1 reports came
    # from its host tier, at 600,000 KV bytes a token over 1 GB/s: 0.6 ms a token. A
    # cached token there saves 0.4 ms, not 1. Its hit rate is 0.5, so half its reported
    # queue counts: w1 costs queued / 2 + 100 − 25 × 0.4 = queued / 2 + 90 against w0's
    # 100. It wins at 18 queued (99) and loses at 22 (101); priced as a device hit
    # (queued / 2 + 75) it would win both.
    for queued, expect in ((18, "w1"), (22, "w0")):
        p = policy(cost_decode_weight=0.0)
        beat(p, "w0", 0, 1_000.0, 1.0)
        HEARTBEATS[id(p)]["w1"] = (WorkerRecord(
            "w1", "http://w", "m", "radix", 1.0, queued_prefill_tokens=queued,
            prefill_us_per_token=1_000.0, decode_ms_per_token=1.0, prompt_tokens_total=1000,
            cached_tokens_total=500, host_cached_tokens_total=500, host_kv_capacity_tokens=10**6,
            host_load_bytes_per_s=1e9, kv_bytes_per_token=600_000,
        ), None)  # fmt: skip
        p.holdings.observe("w1", "x" * 100, now=0.0)
        assert ask(p, "x" * 400, fleet(0, 0)).worker_id == expect, queued


def test_a_reported_queue_drains_at_the_worker_prefill_rate_until_the_next_report() -> None:
    p = policy(seed=2)
    report(p, 2)
    p.holdings.observe("w0", PREFIX + question(0), now=0.0)
    report(p, 2, {0: 5_000})  # 100 ms of prefill queued on the holder
    assert ask(p, PREFIX + question(1), fleet(0, 0), now=1.0).reason == "spill"
    # w1 now holds the prefix too; 30 requests there cost 30 ms of decode. 100 ms after
    # the report (none since) w0 has prefilled its whole queue: it wins again.
    assert ask(p, PREFIX + question(2), fleet(0, 30), now=1.1).worker_id == "w0"
    # The same figures reported again mean a full queue as of now: 100 ms > 30 ms.
    report(p, 2, {0: 5_000})
    assert ask(p, PREFIX + question(3), fleet(0, 30), now=1.11).worker_id == "w1"


def test_a_reported_queue_counts_only_what_the_worker_hit_rate_leaves_uncached() -> None:
    # w0 holds the prefix; 2,000 waiting prompt tokens reported whole (40 ms at 20 µs).
    for hit_rate, expect in ((0.0, "w1"), (0.9, "w0")):
        p = policy()
        report(p, 2)
        p.holdings.observe("w0", PREFIX + question(0), now=0.0)
        beat(p, "w0", 2_000, 20.0, 1.0, hit_rate=hit_rate)
        # 0.0: 40 + 0.02 ms against 20 ms on w1. 0.9: 4 + 0.02 ms.
        assert ask(p, PREFIX + question(1), fleet(0, 0), now=1.0).worker_id == expect


def test_decode_interference_sends_to_the_less_loaded_of_equal_holders() -> None:
    p = policy()
    report(p, 3)
    for w in ("w0", "w1"):
        p.holdings.observe(w, PREFIX + question(0), now=0.0)
    d = ask(p, PREFIX + question(1), fleet(6, 2, 0), now=1.0)
    # w1 (2 × 1 ms of decode, cached) beats w0 (6 ms, cached) and w2 (idle, 20 ms prefill).
    assert (d.worker_id, d.reason) == ("w1", "cache_hit")


def test_cold_fleet_spreads_and_a_shared_prefix_then_sticks() -> None:
    p = policy(seed=3)
    report(p, 4)
    chosen = {ask(p, chr(65 + g) + PREFIX, fleet(0, 0, 0, 0), now=g).worker_id for g in range(40)}
    assert chosen == {"w0", "w1", "w2", "w3"}
    p = policy(seed=3)
    report(p, 4)
    first = ask(p, PREFIX + question(0), fleet(0, 0, 0, 0))
    assert first.reason == "no_match"
    for i in range(1, 20):  # one request at a time (each predicted done before the next)
        d = ask(p, PREFIX + question(i), fleet(0, 0, 0, 0), now=float(i))
        assert (d.worker_id, d.reason) == (first.worker_id, "cache_hit")


def test_own_requests_since_the_heartbeat_count_until_their_predicted_first_token() -> None:
    p = policy(seed=1)
    report(p, 2)
    a = ask(p, "a" * 4_000, fleet(0, 0), now=0.0)  # 1,000 tokens: 20 ms to first token
    b = ask(p, "b" * 4_000, fleet(0, 0), now=0.001)  # the heartbeat knows nothing of `a`
    assert a.worker_id != b.worker_id
    # After a's predicted first token its tokens no longer count: w(a) is idle again.
    p2 = policy(seed=1)
    report(p2, 2)
    a = ask(p2, "a" * 4_000, fleet(0, 0), now=0.0)
    later = [ask(p2, f"{k}" + "c" * 4_000, fleet(0, 0), now=1.0 + k).worker_id for k in range(30)]
    assert a.worker_id in later


def test_reported_and_own_queues_take_the_larger_not_the_sum() -> None:
    p = policy(cost_decode_weight=0.0)
    beat(p, "w0", 0, 1_000.0, 1.0)
    beat(p, "w1", 0, 1_000.0, 1.0)
    assert ask(p, "a" * 400, fleet(0, 0), now=0.0).worker_id in ("w0", "w1")
    first = "w0" if p.policy._own.get("w0") else "w1"  # 100 own tokens pending there
    other = "w1" if first == "w0" else "w0"
    # The heartbeat now reports those same 100 tokens: still 100 queued, not 200.
    beat(p, first, 100, 1_000.0, 1.0)
    beat(p, other, 99, 1_000.0, 1.0)
    assert ask(p, "b" * 400, fleet(0, 0), now=0.01).worker_id == other


def test_hot_prefix_replicates_when_its_holder_is_busy_and_both_then_hold_it() -> None:
    p = policy(seed=5)
    report(p, 3)
    p.holdings.observe("w0", PREFIX + question(0), now=0.0)
    d = ask(p, PREFIX + question(1), fleet(40, 0, 0), now=1.0)  # w0: 40 ms of decode ahead
    assert d.reason == "spill" and d.worker_id in ("w1", "w2")
    replica = d.worker_id
    # Both holders now win over the third worker, by load.
    for k in range(2, 12):
        loads = fleet(0, 3, 3) if k % 2 else fleet(3, 3, 3)
        if replica == "w2":
            loads = [WorkerView(w.worker_id, 3 if w.worker_id == "w1" else w.load) for w in loads]
        got = ask(p, PREFIX + question(k), loads, now=float(k))
        assert got.worker_id in ("w0", replica) and got.reason == "cache_hit"


SEAT_TERMS_ONLY = {"cost_decode_weight": 0.0, "cost_stall_weight": 0.0, "cost_hold_margin": 0.0}


def test_a_worker_without_a_free_seat_costs_the_wait_for_one() -> None:
    # 4 seats, a request holds one for 80 ms: each request beyond them waits ~20 ms more.
    p = policy(**SEAT_TERMS_ONLY)
    for i in range(2):
        beat(p, f"w{i}", 0, 20.0, 1.0, 4, 80.0)
    p.holdings.observe("w0", PREFIX + question(0), now=0.0)
    text = PREFIX + question(1)  # w0 saves 990 × 0.02 = 19.8 ms of prefill
    assert ask(p, text, fleet(3, 0), now=1.0).worker_id == "w0"  # a seat is free
    p2 = policy(**SEAT_TERMS_ONLY)
    for i in range(2):
        beat(p2, f"w{i}", 0, 20.0, 1.0, 4, 80.0)
    p2.holdings.observe("w0", PREFIX + question(0), now=0.0)
    # Full (load 4): 20 ms for a seat > 19.8 ms saved.
    assert ask(p2, text, fleet(4, 0), now=1.0).worker_id == "w1"


def test_a_miss_on_a_full_worker_also_costs_the_requests_waiting_there() -> None:
    # 4 seats; a seat frees every 1 ms (request_ms 4), so the seat wait itself is small.
    # w0 holds the prefix behind 2,000 queued tokens: 0.02 × (2,000 + 10) = 40.2 ms.
    # w1 would prefill all 1,000 tokens: 20 ms while a seat is free; at 4 running the
    # request waits, and so does the one waiting there: 2 × 20 + 1 = 41 ms.
    for w1_load, expect in ((3, "w1"), (4, "w0")):
        p = policy(**SEAT_TERMS_ONLY)
        beat(p, "w0", 2_000, 20.0, 1.0, 4, 4.0)
        beat(p, "w1", 0, 20.0, 1.0, 4, 4.0)
        p.holdings.observe("w0", PREFIX + question(0), now=0.0)
        assert ask(p, PREFIX + question(1), fleet(0, w1_load), now=1.0).worker_id == expect


def seated(p: CostAware, n: int = 2) -> None:
    """Workers with 4 seats, each request holding one for 80 ms: a seat every 20 ms."""
    for i in range(n):
        beat(p, f"w{i}", 0, 20.0, 1.0, 4, 80.0)


def test_a_miss_stalls_the_requests_running_there_so_a_busy_non_holder_loses() -> None:
    # The flip measured on shared prefixes: the holder w0 is full (one request waits
    # for a seat: 20 ms), w1 has a seat free but 3 requests running. Counting only
    # this request, w1's 1,000-token miss (20 ms) beats w0's seat wait (20.4 ms); but
    # that prefill also stalls w1's 3 running requests 20 ms each: w1 costs 80 ms.
    text = PREFIX + question(1)
    for stall, expect in ((0.0, "w1"), (1.0, "w0")):
        p = policy(cost_decode_weight=0.0, cost_hold_margin=0.0, cost_stall_weight=stall)
        seated(p)
        p.holdings.observe("w0", PREFIX + question(0), now=0.0)
        assert ask(p, text, fleet(4, 3), now=1.0).worker_id == expect, stall
    # Among non-holders: w0 runs 3 requests, w1 none but has 500 tokens queued (10 ms).
    # For the request alone w0 is faster (20 against 30 ms); its stall of w0's 3 makes
    # w0 cost 80 ms.
    for stall, expect in ((0.0, "w0"), (1.0, "w1")):
        p = policy(cost_decode_weight=0.0, cost_hold_margin=0.0, cost_stall_weight=stall)
        for i, queued in enumerate((0, 500)):
            beat(p, f"w{i}", queued, 20.0, 1.0, 4, 80.0)
        assert ask(p, "n" * 4_000, fleet(3, 0), now=1.0).worker_id == expect, stall


def test_a_holder_keeps_a_request_unless_another_is_faster_by_a_seat_interval() -> None:
    # Stall and decode off: w0 holds the prefix, w1 is idle (1,000-token miss: 20 ms).
    # Load 4 on w0: one seat wait (20 ms) + 10 uncached tokens twice (0.4 ms) = 20.4 ms,
    # slower by 0.4 ms < one seat interval (20 ms): w0 keeps it. Load 5: 40.6 ms, slower
    # by 20.6 ms > 20 ms: w1 (a spill). Without the margin the 0.4 ms decides.
    text = PREFIX + question(1)
    for w0_load, margin, expect in ((4, 1.0, "w0"), (5, 1.0, "w1"), (4, 0.0, "w1")):
        p = policy(cost_decode_weight=0.0, cost_stall_weight=0.0, cost_hold_margin=margin)
        seated(p)
        p.holdings.observe("w0", PREFIX + question(0), now=0.0)
        d = ask(p, text, fleet(w0_load, 0), now=1.0)
        assert d.worker_id == expect, (w0_load, margin)
        assert d.reason == ("cache_hit" if expect == "w0" else "spill")
    # Seats unknown (a worker that reports none): no interval, no margin.
    p = policy(cost_decode_weight=0.0, cost_stall_weight=0.0)
    report(p, 2, {0: 1_010})  # w0: 20.2 + 0.2 ms against w1's 20 ms
    p.holdings.observe("w0", PREFIX + question(0), now=0.0)
    assert ask(p, text, fleet(0, 0), now=1.0).worker_id == "w1"


def test_own_tokens_count_until_the_predicted_first_token_not_the_stall_priced_in() -> None:
    # w0 runs 3 requests (no seat limit known): a 1,000-token miss there is priced at
    # 20 ms for itself + 3 × 20 ms of stall, but its own first token is due in 20 ms.
    p = policy(cost_decode_weight=0.0)
    report(p, 2)
    ask(p, "a" * 4_000, fleet(3, 9), now=0.0)  # w1 is priced at 200 ms: w0
    assert p.policy._expiry[0][0] == pytest.approx(0.020) and p.policy._expiry[0][2] == "w0"


def test_bad_reports_count_as_unknown_and_never_raise() -> None:
    p = policy(cost_prefill_us_per_token=20.0, cost_decode_ms_per_token=1.0)
    beat(p, "w0", -5, float("nan"), float("inf"))
    beat(p, "w1", 10**30, -1.0, 1e12)  # type: ignore[arg-type]
    d = ask(p, "z" * 400, fleet(0, 0))
    assert d.worker_id in ("w0", "w1")
    cols = p.policy._cols  # the inputs as priced: unknown figures took the configured defaults
    assert cols.reported_queue.tolist() == [0, 0] and sorted(cols.own_queue.tolist()) == [0, 100]
    assert cols.prefill_ms.tolist() == [0.02, 0.02] and cols.decode_ms.tolist() == [1.0, 1.0]


def test_inherits_cache_aware_bookkeeping_epochs_caps_and_fleet_views() -> None:
    p = policy(tree_chars_per_token=4.0)
    report(p, 2)
    p.holdings.observe("w0", PREFIX, now=0.0)
    beat(p, "w0", 50, 20.0, 1.0)
    p.holdings.forget("w0")  # new epoch: tree and own queue go
    assert "w0" not in p.policy._own and p.holdings.tree.tenant_size("w0") == 0
    view = FleetView(["w0", "w1"], [0, 0], [0, 250])  # w1 caches 250 tokens: 1,000 chars
    p.select(RouteRequest("r" * 100), view, 1.0)
    p.holdings.observe("w1", "q" * 4_000, now=2.0)
    assert p.holdings.tree.tenant_size("w1") <= 1_000
    d = p.select(RouteRequest("s" * 100), view, 3.0)
    assert (
        d.worker_id in ("w0", "w1") and p.holdings.worker_stats()[d.worker_id]["tree_chars"] >= 100
    )


@pytest.mark.parametrize("n", [1, 3, 16])
def test_every_decision_names_a_routable_worker(n: int) -> None:
    p = policy(seed=n)
    rng = random.Random(n)
    for k in range(200):
        workers = fleet(*(rng.randrange(5) for _ in range(n)))
        if k % 7 == 0:
            beat(p, f"w{rng.randrange(n)}", rng.randrange(3_000), 20.0, 1.0)
        text = rng.choice(("sys-a ", "sys-b ", "")) * 50 + str(rng.random())
        d = ask(p, text, workers, now=k * 0.01)
        assert d.worker_id in {w.worker_id for w in workers}
        assert 0 <= d.matched_chars <= len(text)
