"""The fleet simulator on a small fleet and a tiny trace: exact where the model is exact."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from loadtests.__main__ import main as cli
from loadtests.kit import WorkloadOptions
from loadtests.simulate.simulation import (
    ClosedLoop,
    SimRequest,
    Simulation,
    deep_size,
    mooncake_requests,
)
from loadtests.simulate.worker import CostModel, Job, SimWorker
from shared.config import RouterConfig

# Without the context term (tests/worker/backends/test_sim_costs.py prices it): round times.
COST = CostModel(
    prefill_us_per_token=100.0, decode_ms_per_token=2.0, max_running=1, cache_tokens=64,
    decode_us_per_1k_context=0.0,
)  # fmt: skip


def _job(rid: int, tokens: list[int], out: int = 2, arrival: float = 0.0) -> Job:
    return Job(
        rid,
        arrival,
        np.array(tokens, dtype=np.int64),
        np.arange(1000 + 10 * rid, 1000 + 10 * rid + out),
        "",
    )


def _drain(w: SimWorker, now: float) -> float:
    """Run steps until the worker is idle; the time it went idle."""
    while (end := w.start_step(now)) is not None:
        w.finish_step(end)
        now = end
    return now


def test_worker_runs_the_engine_in_virtual_time() -> None:
    w = SimWorker(0, COST)
    a, b = _job(1, list(range(10))), _job(2, [*range(10), 50, 51])
    w.submit(a)
    w.submit(b)
    assert w.load == 2
    # Each step: 2 ms (one pass over the weights) + 100 µs per prefill token.
    end = w.start_step(0.0)  # max_running 1: a alone, its 10-token prefill
    assert end is not None and np.isclose(end, 0.002 + 0.001)
    assert a.admitted == 0.0 and b.admitted < 0
    assert w.finish_step(end) == [] and np.isclose(a.first_token, 0.003)
    end2 = w.start_step(end)  # a's second (last) token
    assert end2 is not None and w.finish_step(end2) == [a] and np.isclose(a.finish, 0.005)
    assert w.load == 1
    end3 = w.start_step(end2)  # b: a's prompt is in the tree, 2 tokens to prefill
    assert end3 is not None and np.isclose(end3 - end2, 0.002 + 2 * 100e-6)
    assert b.cached == 10 and np.isclose(b.queue_delay, 0.005)
    w.finish_step(end3)
    _drain(w, end3)
    assert np.isclose(b.finish - b.admitted, 2 * 100e-6 + 0.004) and w.load == 0
    w.engine.check_integrity()
    assert w.allocator.available + w.cache.total_size == 64


def test_worker_evicts_when_full() -> None:
    w = SimWorker(0, COST)
    now = 0.0
    for rid in range(6):  # 6 × (20 + 2) tokens through a 64-token cache
        w.submit(_job(rid, [rid * 100 + i for i in range(20)]))
        now = _drain(w, now)
        w.engine.check_integrity()
    assert w.cache.total_size <= 64 and w.cached_tokens == 0


def _trace(tmp_path: Path) -> WorkloadOptions:
    lines = []
    for i in range(40):  # 4 prefixes of 2 blocks, each followed by its own block
        lines.append(
            f'{{"timestamp": {i * 50}, "input_length": 1536, "output_length": 4, '
            f'"hash_ids": [{i % 4 * 2}, {i % 4 * 2 + 1}, {100 + i}]}}'
        )
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return WorkloadOptions(workload="mooncake", trace=str(path), block_words=8)


def _run(policy: str, o: WorkloadOptions, workers: int = 4) -> Simulation:
    cost = CostModel(
        prefill_us_per_token=30, decode_ms_per_token=1, max_running=4, cache_tokens=512
    )
    sim = Simulation(RouterConfig(policy=policy, tree_chars_per_token=5.0), workers, cost)  # type: ignore[arg-type]
    sim.run(source=mooncake_requests(o, workers, workers_per_copy=4, speedup=1.0, seed=0))
    return sim


def test_cache_aware_beats_round_robin_on_a_tiny_trace(tmp_path: Path) -> None:
    o = _trace(tmp_path)
    ca, rr = _run("cache_aware", o).result("ca"), _run("round_robin", o).result("rr")
    assert ca.requests == rr.requests == 40 and ca.rejected == 0
    # cache_aware: each of the 4 prefixes misses once, then 9 hits of 16 of 24 tokens.
    assert np.isclose(ca.hit_rate, 36 * 16 / (40 * 24))
    # round robin: prefix i % 4 always goes to worker i % 4 here, so it hits too: the
    # trace is periodic with the fleet size. What differs is the spread of prefixes.
    assert ca.hit_rate >= rr.hit_rate
    assert ca.reasons["no_match"] == 4 and ca.reasons["cache_hit"] == 36
    assert ca.policy_bytes > 0 and len(ca.decision_us) == 40
    # CPU of the whole replay = the policy's part + the simulator's own, both > 0.
    assert ca.run_cpu_s * 1e6 > ca.decision_us.sum() > 0 and ca.sim_us_per_request > 0
    assert deep_size([1, "ab"]) > deep_size([])


def test_copies_scale_the_fleet_with_disjoint_prefixes(tmp_path: Path) -> None:
    o = _trace(tmp_path)
    reqs: list[SimRequest] = list(mooncake_requests(o, 8, 4, 1.0, 0))
    assert len(reqs) == 80 and all(a.arrival <= b.arrival for a, b in itertools.pairwise(reqs))
    heads = {r.tokens[:16].tobytes() for r in reqs}
    assert len(heads) == 8  # 4 prefixes per copy, 2 copies, no sharing across copies
    ca = _run("cache_aware", o, workers=8).result("ca")
    assert ca.requests == 80 and ca.reasons["no_match"] == 8


def test_closed_loop_multi_turn_hits_on_later_turns() -> None:
    o = WorkloadOptions(
        workload="multi_turn", conversations=6, turns=4, system_len=10, question_len=5, output_len=3
    )
    cost = CostModel(
        prefill_us_per_token=30, decode_ms_per_token=1, max_running=2, cache_tokens=4096
    )
    sim = Simulation(RouterConfig(policy="cache_aware", tree_chars_per_token=5.0), 3, cost)
    done = sim.run(closed=ClosedLoop(o, users=3))
    assert len(done) == 24
    r = sim.result("ca")
    assert r.hit_rate > 0.5 and r.reasons["cache_hit"] >= 18


def test_closed_loop_users_share_one_stream_of_an_open_workload() -> None:
    # Locust's shape: each user sends the stream's next request when its last finished.
    o = WorkloadOptions(
        workload="shared_prefix", groups=4, prompts_per_group=5, system_len=20,
        question_len=4, output_len=3,
    )  # fmt: skip
    cost = CostModel(
        prefill_us_per_token=30, decode_ms_per_token=1, max_running=2, cache_tokens=4096
    )
    sim = Simulation(RouterConfig(policy="cost_aware", tree_chars_per_token=5.0), 2, cost)
    done = sim.run(closed=ClosedLoop(o, users=3))
    assert len(done) == 20 and len({j.text for j in done}) == 20  # each request once
    events = sorted([(j.arrival, 1) for j in done] + [(j.finish, -1) for j in done])
    in_flight = list(itertools.accumulate(d for _, d in events))
    assert max(in_flight) == 3  # never more than the users


def test_cli_runs_compare_variants_closed_loop(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    rc = cli([
        "simulate", "--workers", "2", "--workload", "shared_prefix", "--groups", "3",
        "--prompts-per-group", "4", "--system-len", "20", "--question-len", "4", "--output-len", "2",
        "--closed", "--users-per-worker", "2", "--no-memory",
        "--policies", "cost_aware (before),cost_aware", "--out", str(tmp_path),
    ])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "| 2 | cost_aware (before) | 12 |" in out and "| 2 | cost_aware | 12 |" in out


def test_cli_writes_tables_and_plots(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    o = _trace(tmp_path)
    rc = cli([
        "simulate", "--workers", "4", "--workload", "mooncake", "--trace", o.trace, "--block-words", "8",
        "--cache-tokens", "512", "--sweep-at", "4", "--thresholds", "0.3,0.9",
        "--no-match", "least_load,smallest_tree", "--balance-mode", "fleet,per_request",
        "--out", str(tmp_path / "o"),
    ])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "| 4 | cache_aware | 40 |" in out
    assert "| 4 | 0.9 / 64 / least_load / fleet | 40 |" in out
    assert "| 4 | 0.3 / 64 / smallest_tree / per_request | 40 |" in out
    for name in ("simulation.json", "sim_scale.png", "sim_ttft_cdf.png", "sim_thresholds.png"):
        assert (tmp_path / "o" / name).stat().st_size > 0


def test_a_one_token_job_finishes_in_its_admission_step() -> None:
    w = SimWorker(0, COST)
    job = _job(1, list(range(10)), out=1)
    w.submit(job)
    end = w.start_step(0.0)
    assert end is not None and job.admitted == 0.0 and job.cached == 0
    assert w.finish_step(end) == [job] and job.finish == end and w.load == 0


def test_host_tier_hit_costs_its_load_not_a_prefill() -> None:
    """A prompt pushed off the device pool comes back from the host tier: cached, and
    its step charged bytes / bandwidth for those tokens instead of prefill_us each."""
    cost = CostModel(
        prefill_us_per_token=100.0, decode_ms_per_token=2.0, max_running=1, cache_tokens=64,
        evict_batch=8, host_cache_tokens=256, host_load_bytes_per_s=1e9, kv_bytes_per_token=10_000,
        decode_us_per_1k_context=0.0,  # the step's price here: weights pass + loads only
    )  # fmt: skip
    assert np.isclose(cost.host_load_us_per_token, 10.0)
    w = SimWorker(0, cost)
    now = 0.0
    for rid, base in enumerate((0, 100, 200, 300), start=1):  # 40 tokens each: 64 hold one
        w.submit(_job(rid, list(range(base, base + 40))))
        now = _drain(w, now)
    again = _job(9, list(range(40)))
    w.submit(again)
    end = w.start_step(now)
    assert end is not None
    assert again.cached == 39 and w.host_cached_tokens == 39
    # 39 tokens loaded at 10 us each; the last prompt token runs alone, priced as a
    # decode by the cost model (a one-token item), not 100 us of prefill.
    assert np.isclose(end - now, 0.002 + 39 * 10e-6)
    _drain(w, end)
    w.engine.check_integrity()
    plain = SimWorker(0, CostModel(100.0, 2.0, 1, 64, evict_batch=8))
    now = 0.0
    for rid, base in enumerate((0, 100, 200, 300, 0), start=1):
        job = _job(rid, list(range(base, base + 40)))
        plain.submit(job)
        now = _drain(plain, now)
    assert job.cached == 0


def test_simulate_cli_runs_with_a_host_tier(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    code = cli([
        "simulate", "--workers", "2", "--policies", "cache_aware", "--workload", "multi_turn",
        "--conversations", "4", "--turns", "3", "--users-per-worker", "2",
        "--cache-tokens", "512", "--host-cache-tokens", "2048", "--no-memory",
        "--out", str(out),
    ])  # fmt: skip
    assert code == 0 and (out / "simulation.json").is_file()
