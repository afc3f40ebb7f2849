"""The SSE parser on awkward chunking, hit-rate aggregation, and the report files."""

from __future__ import annotations

import itertools
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from loadtests.load.records import HitCounter, RequestRecord, SSEParser, read_records
from loadtests.load.runner import summarize, write_report

STREAM = 'data: {"a":"é"}\r\n\r\n: keep-alive\n\ndata: x\ndata: y\r\rdata: [DONE]\n\n'.encode()


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), unique=True, max_size=12))
def test_sse_parser_is_independent_of_chunking(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(STREAM)]
    parser, events = SSEParser(), []
    for a, b in itertools.pairwise(bounds):
        events += parser.feed(STREAM[a:b])
    assert events == ['{"a":"é"}', "x\ny", "[DONE]"]


def test_sse_parser_holds_an_incomplete_event() -> None:
    p = SSEParser()
    assert p.feed(b"data: part") == []
    assert p.feed(b"ial\n") == []
    assert p.feed(b"\n") == ["partial"]


def _rec(start: float, worker: str, prompt: int, cached: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(
        start=start, ok=ok, e2e_s=0.5, ttft_s=0.1 if ok else None, itl_s=0.01,
        prompt_tokens=prompt, cached_tokens=cached, output_tokens=10, worker=worker,
    )  # fmt: skip


def test_hit_counter_per_worker_and_merge() -> None:
    hc = HitCounter.from_records(
        [_rec(0, "a", 100, 50), _rec(1, "b", 100, 0), _rec(2, "b", 9, 9, ok=False)]
    )
    assert hc.hit_rate == 0.25
    assert hc.worker_hit_rate("a") == 0.5 and hc.worker_hit_rate("b") == 0.0
    other = HitCounter()
    other.merge(hc.as_dict())
    other.merge(hc.as_dict())
    assert other.requests == {"a": 2, "b": 2} and other.hit_rate == 0.25
    assert "all" in hc.table()


def test_report_writes_summary_and_plots(tmp_path: Path) -> None:
    records = [_rec(i * 0.1, f"w{i % 3}", 100, 60) for i in range(30)] + [
        _rec(3.0, "w0", 0, 0, ok=False)
    ]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(r.to_json() + "\n" for r in records))
    assert read_records(path) == records
    s = write_report(read_records(path), tmp_path / "out", "test")
    assert (s.requests, s.failures) == (31, 1)
    assert abs(s.hit_rate - 0.6) < 1e-9 and s.load_max_over_mean == 1.0
    assert abs(s.ttft_p50_ms - 100) < 1e-6
    for name in ("summary.json", "ttft.png", "latency_over_time.png", "hit_rate_per_worker.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert summarize([]).requests == 0


def test_idle_workers_count_in_the_load_spread() -> None:
    # Everything on one of four workers: the records name only w0, the fleet has four.
    s = summarize([_rec(i * 0.1, "w0", 100, 50) for i in range(8)])
    assert s.load_max_over_mean == 1.0  # what the records alone say
    fleet = s.over_fleet(f"w{i}" for i in range(4))
    assert fleet.load_max_over_mean == 4.0
    assert fleet.per_worker_requests == {"w0": 8, "w1": 0, "w2": 0, "w3": 0}
    assert fleet.hit_rate == s.hit_rate
