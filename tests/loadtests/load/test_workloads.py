"""Workload generators: deterministic, the advertised shapes, and prefix reuse where promised."""

from __future__ import annotations

import argparse
import itertools
from collections import Counter
from pathlib import Path

import pytest

from loadtests.kit import (
    WorkloadOptions,
    add_workload_arguments,
    options_from_namespace,
    options_to_argv,
)
from loadtests.load.workloads import Workload, mooncake, rag, read_trace, shared_prefix

SMALL = {"system_len": 20, "question_len": 5, "output_len": 7}


def test_shared_prefix_shape_and_determinism() -> None:
    o = WorkloadOptions(groups=3, prompts_per_group=4, **SMALL)
    reqs = shared_prefix(o)
    assert len(reqs) == 12
    systems = {r.messages[0][1] for r in reqs}
    assert len(systems) == 3 and all(len(s.split()) == 20 for s in systems)
    assert all(len(r.messages[1][1].split()) == 5 and r.max_tokens == 7 for r in reqs)
    assert [r.text() for r in reqs] == [r.text() for r in shared_prefix(o)]
    assert [r.text() for r in reqs] != [
        r.text()
        for r in shared_prefix(WorkloadOptions(seed=1, groups=3, prompts_per_group=4, **SMALL))
    ]
    # Shuffled: the groups are interleaved, not sent one after the other.
    assert [r.tag for r in reqs] != sorted(r.tag for r in reqs)


def test_shared_prefix_group_zipf_skews_groups_and_keeps_the_count() -> None:
    o = WorkloadOptions(groups=8, prompts_per_group=50, group_zipf=1.1, **SMALL)
    reqs = shared_prefix(o)
    counts = Counter(r.tag for r in reqs)
    assert len(reqs) == 400
    assert counts["group-0"] > 3 * counts["group-7"]  # weights 1 vs 1/8^1.1 ≈ 0.1
    assert [r.text() for r in reqs] == [r.text() for r in shared_prefix(o)]


def test_multi_turn_each_turn_extends_the_previous() -> None:
    o = WorkloadOptions(workload="multi_turn", conversations=2, turns=3, **SMALL)
    w = Workload(o)
    a, b = w.new_session(), w.new_session()
    texts: dict[str, list[str]] = {}
    for s in [a, b] * 3:
        req = s.next_request()
        assert req is not None
        texts.setdefault(req.session_id, []).append(req.text())
        s.on_reply(req, f"reply to {req.session_id}")
    assert set(texts) == {"conv-0", "conv-1"}
    for turns in texts.values():
        assert len(turns) == 3
        assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(turns))
        assert "reply to" in turns[-1]
    # Every conversation has been used: the sessions are exhausted.
    assert a.next_request() is None and b.next_request() is None


def test_rag_reuses_documents() -> None:
    o = WorkloadOptions(
        workload="rag", docs=10, doc_len=8, docs_per_request=3, rag_requests=50, **SMALL
    )
    reqs = rag(o)
    assert len(reqs) == 50
    cited = [d for r in reqs for d in r.messages[1][1].split("[doc ")[1:]]
    assert len(cited) == 150
    ids = [c.split("]")[0] for c in cited]
    assert len(set(ids)) <= 10 and max(ids.count(i) for i in set(ids)) > 15  # Zipf: a popular one


def test_mooncake_blocks_map_to_the_same_text(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]}\n'
        '{"timestamp": 500, "input_length": 1000, "output_length": 900, "hash_ids": [1, 3]}\n'
    )
    o = WorkloadOptions(
        workload="mooncake", trace=str(trace), block_words=4, speedup=2, max_output=100
    )
    a, b = mooncake(o)
    wa, wb = a.prompt.split(), b.prompt.split()  # type: ignore[union-attr]
    assert len(wa) == 8 and len(wb) == 8  # ceil(1000 * 4 / 512) = 8
    assert wa[:4] == wb[:4] and wa[4:] != wb[4:]  # block 1 shared, then 2 vs 3
    assert (a.arrival_s, b.arrival_s) == (0.0, 0.25)
    assert (a.max_tokens, b.max_tokens) == (5, 100)
    asap = mooncake(WorkloadOptions(workload="mooncake", trace=str(trace), arrival="asap"))
    assert all(r.arrival_s is None for r in asap)


def test_bundled_trace_is_readable() -> None:
    recs = read_trace(WorkloadOptions().trace, limit=5)
    assert len(recs) == 5 and all("hash_ids" in r for r in recs)


def test_bad_trace_line_names_the_line(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        read_trace(trace)


def test_options_round_trip_through_flags() -> None:
    o = WorkloadOptions(workload="rag", docs=7, zipf=0.5, trace_limit=3, loop=True)
    p = argparse.ArgumentParser()
    add_workload_arguments(p)
    assert options_from_namespace(p.parse_args(options_to_argv(o))) == o


def test_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="workload"):
        WorkloadOptions(workload="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--groups"):
        WorkloadOptions(groups=-1)


def test_loop_repeats_and_no_loop_ends() -> None:
    o = WorkloadOptions(groups=1, prompts_per_group=2, **SMALL)
    s = Workload(o).new_session()
    assert [s.next_request() is not None for _ in range(3)] == [True, True, False]
    s = Workload(WorkloadOptions(groups=1, prompts_per_group=2, loop=True, **SMALL)).new_session()
    assert all(s.next_request() is not None for _ in range(5))
