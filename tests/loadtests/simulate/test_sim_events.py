"""KV events in the simulator: the router's real feed, index and scorer in virtual time."""

from __future__ import annotations

import dataclasses
from itertools import pairwise

import numpy as np

from loadtests.__main__ import main as cli
from loadtests.kit import WorkloadOptions
from loadtests.simulate.divergence import (
    CASES,
    MODEL,
    ArmSpec,
    DivergenceSim,
    EventStreams,
    cached_prefix,
)
from loadtests.simulate.simulation import ClosedLoop
from loadtests.simulate.worker import CostModel, Job, SimWorker
from router.fleet.kv_feed import KvEventFeed
from shared.config import RouterConfig

COST = CostModel(30.0, 3.0, 8, 16_384)
# Conversations whose own turns outweigh the shared system prompt (as the live bench's).
TALK = WorkloadOptions(
    workload="multi_turn", system_len=16, question_len=96, output_len=16, turns=3
)  # fmt: skip


def _simulate(case: str, arm: str, workers: int = 4, delay: float = 0.05, block: int = 16,
              cost: CostModel = COST, reply_hits: bool = False) -> DivergenceSim:  # fmt: skip
    users = 2 * workers
    o = dataclasses.replace(TALK, conversations=users)
    routed = users * o.turns - (users if CASES[case].direct else 0)
    config = RouterConfig(policy="cache_aware", tree_chars_per_token=5.0)
    spec = ArmSpec(arm, delay, block)
    sim = DivergenceSim(
        config, workers, cost, CASES[case], spec, routed // 2, reply_hits=reply_hits
    )
    sim.run(closed=ClosedLoop(o, users=users))
    return sim


def _placements(sim: DivergenceSim) -> list[tuple[int, int, int]]:
    return sorted((j.rid, j.worker, j.cached) for j in sim._done)


def _job(rid: int, tokens: list[int]) -> Job:
    return Job(rid, 0.0, np.array(tokens, dtype=np.int64), np.arange(900 + rid, 902 + rid), "")


def _run_idle(w: SimWorker, now: float, streams: EventStreams) -> float:
    while (end := w.start_step(now)) is not None:
        streams.collect("w0", w.engine.kv_events, end)
        w.finish_step(end)
        now = end
    return now


def test_cached_prefix_reads_the_cache_without_touching_it() -> None:
    w = SimWorker(0, COST)
    w.submit(_job(1, list(range(40))))
    while (end := w.start_step(0.0)) is not None:
        w.finish_step(end)
    ticks = [n.last_access for n in w.cache._nodes()]
    probe = np.array([*range(25), 99, 98], dtype=np.int64)
    assert cached_prefix(w.cache, probe) == 25
    assert cached_prefix(w.cache, np.array([7, 8], dtype=np.int64)) == 0
    assert [n.last_access for n in w.cache._nodes()] == ticks  # no LRU touch, no split
    assert w.cache.match_prefix(probe, record=False).prefix_len == 25


def test_events_reach_the_index_after_the_delay_and_follow_a_flush() -> None:
    w = SimWorker(0, dataclasses.replace(COST, kv_events_block_size=4))
    feed = KvEventFeed(registry=None)  # type: ignore[arg-type]
    streams = EventStreams(feed, delay=0.5)
    streams.join("w0", 1.0)
    feed.follow(streams.members())
    w.submit(_job(1, list(range(40))))
    done = _run_idle(w, 0.0, streams)
    prompt = list(range(40))
    streams.deliver(done + 0.49)
    assert feed.match(MODEL, prompt) == {}  # not yet: the stream is read 0.5 s later
    streams.deliver(done + 0.5)
    assert feed.status_of("w0") == "ok"
    assert feed.match(MODEL, prompt) == {"w0": 40}  # whole blocks of 4
    w.engine.flush_cache()
    streams.collect("w0", w.engine.kv_events, done + 1.0)
    streams.deliver(done + 1.4)
    assert feed.match(MODEL, prompt) == {"w0": 40}  # the router still believes it
    streams.deliver(done + 1.5)
    assert feed.match(MODEL, prompt) == {}
    assert not feed.dropped


def test_a_restarted_worker_is_untrusted_until_its_new_epoch_resyncs() -> None:
    feed = KvEventFeed(registry=None)  # type: ignore[arg-type]
    streams = EventStreams(feed, delay=0.0)
    old = SimWorker(0, dataclasses.replace(COST, kv_events_block_size=4))
    streams.join("w0", 1.0)
    feed.follow(streams.members())
    old.submit(_job(1, list(range(40))))
    t = _run_idle(old, 0.0, streams)
    streams.deliver(t)
    assert feed.match(MODEL, list(range(40))) == {"w0": 40}
    new = SimWorker(0, old.cost)  # restarted: a new engine, a new epoch
    streams.join("w0", 2.0)
    feed.follow(streams.members())  # the heartbeat names the new epoch
    assert feed.status_of("w0") == "stale" and feed.match(MODEL, list(range(40))) == {}
    new.submit(_job(2, list(range(100, 140))))
    streams.deliver(_run_idle(new, t, streams))
    assert feed.status_of("w0") == "ok"
    assert feed.match(MODEL, list(range(100, 140))) == {"w0": 40}


def test_a_run_is_deterministic() -> None:
    for arm in ("events", "ceiling"):
        a, b = _simulate("restart", arm), _simulate("restart", arm)
        assert _placements(a) == _placements(b)
        assert a.summary() == b.summary()


def test_events_change_nothing_when_nothing_diverges_at_zero_delay() -> None:
    # Block size 1 and caches that never evict: the index then holds exactly what the
    # tree predicts (the tree keys on the same ids), so every decision is the same.
    # At block size 16 a match rounds down to whole blocks and ties can break otherwise.
    tree = _simulate("baseline", "tree_tokens", delay=0.0, block=1)
    events = _simulate("baseline", "events", delay=0.0, block=1)
    assert events.kv is not None and events.kv.corrected > 0  # the index was consulted
    assert _placements(events) == _placements(tree)
    assert events.summary()["hit_rate"] == tree.summary()["hit_rate"]


def test_ceiling_at_least_events_at_least_tree_when_traffic_bypasses_the_router() -> None:
    # Events seen 10 ms after a step: before the next turn (a turn decodes 16 tokens,
    # ~50 ms). At a 50 ms delay they come too late here and events fall below the tree.
    hits = {
        arm: _simulate("direct", arm, delay=0.01).summary()["hit_rate"]
        for arm in ("tree", "events", "ceiling")
    }
    assert hits["ceiling"] >= hits["events"] > hits["tree"], hits


def _hits_past_the_last_prompt(sim: DivergenceSim) -> int:
    """Follow-ups whose cached prefix reaches past the previous turn's whole prompt."""
    turns: dict[int, list[Job]] = {}
    for j in sorted(sim._done, key=lambda j: j.rid):  # one conversation per user
        turns.setdefault(j.session, []).append(j)
    return sum(b.cached > len(a.tokens) for ts in turns.values() for a, b in pairwise(ts))


def test_reply_hits_makes_the_cached_reply_a_prefix_of_the_next_turn() -> None:
    assert _hits_past_the_last_prompt(_simulate("baseline", "tree_tokens")) == 0
    replies = _simulate("baseline", "tree_tokens", reply_hits=True)
    assert _hits_past_the_last_prompt(replies) > 0


def test_the_command_prints_every_arm(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["simulate-events", "--workers", "2", "--cases", "baseline,restart",
            "--conversations-per-worker", "1", "--users-per-worker", "1", "--turns", "2",
            "--system-len", "8", "--question-len", "16", "--output-len", "4"]  # fmt: skip
    assert cli(argv) == 0
    out = capsys.readouterr().out
    for arm in ("tree", "tree_tokens", "events", "ceiling"):
        assert f"| 2 | restart | {arm} |" in out


def test_simulate_runs_each_kv_arm_on_any_workload(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    rc = cli([
        "simulate", "--workers", "2", "--workload", "shared_prefix", "--groups", "3",
        "--prompts-per-group", "4", "--system-len", "40", "--question-len", "4",
        "--output-len", "2", "--no-memory", "--policies", "cache_aware,round_robin",
        "--kv-arms", "tree_tokens,events,ceiling", "--out", str(tmp_path),
    ])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    for name in ("cache_aware [tree_tokens]", "cache_aware [events]", "cache_aware [ceiling]"):
        assert f"| 2 | {name} | 12 |" in out
    assert "| 2 | round_robin | 12 |" in out  # load-only policies run once, as before
