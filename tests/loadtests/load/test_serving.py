"""Serving metrics as `vllm bench serve` defines them: goodput counted against a known set
of latencies, TPOT and ITL by hand, every worker listed, and the result file's names."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loadtests.load.records import RequestRecord, read_records
from loadtests.load.runner import summarize, write_report
from loadtests.load.summary import SLO, Latency, serving_metrics, tpot_s

# The fields of vLLM's result JSON (vllm/benchmarks/serve.py, vLLM 0.32.0: the `result`
# dict of `benchmark()`, `process_one_metric` for "ttft", "tpot", "itl", "e2el" with
# `--metric-percentiles 50,90,99`, and main()'s traffic fields) that mean the same here.
VLLM_FIELDS = [
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "std", "p50", "p90", "p99")),
    "request_rate", "burstiness", "max_concurrency",
]  # fmt: skip


def rec(ttft_ms: float, e2e_ms: float, out: int, start: float = 0.0, worker: str = "w0",
        ok: bool = True) -> RequestRecord:  # fmt: skip
    return RequestRecord(
        start=start, ok=ok, e2e_s=e2e_ms / 1000, ttft_s=ttft_ms / 1000 if ok else None,
        prompt_tokens=100, cached_tokens=50, output_tokens=out if ok else 0, worker=worker,
    )  # fmt: skip


# TTFT, E2E (ms), output tokens; TPOT = (E2E - TTFT) / (out - 1).
KNOWN = [
    rec(50, 450, 9, start=0.0),  # TPOT 50: meets ttft 100, misses tpot 40
    rec(80, 320, 9, start=1.0),  # TPOT 30: meets both
    rec(100, 340, 9, start=2.0),  # TTFT exactly at the limit counts (<=), TPOT 30: meets
    rec(150, 310, 9, start=3.0),  # TPOT 20, TTFT 150: misses ttft
    rec(90, 90, 1, start=4.0),  # one token: TPOT 0 for goodput (vLLM's rule): meets
    rec(0, 5000, 0, start=5.0, ok=False),  # failed: never good
]


def test_tpot_is_the_time_per_token_after_the_first() -> None:
    assert tpot_s(KNOWN[0]) == pytest.approx(0.050)
    assert tpot_s(KNOWN[4]) is None and tpot_s(KNOWN[5]) is None


def test_goodput_counts_the_requests_that_meet_every_objective() -> None:
    slo = SLO.parse("ttft=100,tpot=40")
    assert slo == SLO(ttft_ms=100, tpot_ms=40)
    assert [slo.met_by(r) for r in KNOWN] == [False, True, True, False, True, False]
    m = serving_metrics(KNOWN, slo)
    # The run: first send at 0 s, last answer at 5.0 + 5.0 s (the failed one).
    assert m.duration == pytest.approx(10.0)
    assert m.completed == 5 and m.failed == 1
    assert m.request_goodput == pytest.approx(3 / 10.0)
    assert m.request_throughput == pytest.approx(5 / 10.0)
    # One objective only: more requests meet it.
    assert serving_metrics(KNOWN, SLO.parse("tpot=40")).request_goodput == pytest.approx(4 / 10)
    assert serving_metrics(KNOWN, SLO.parse("e2el=400")).request_goodput == pytest.approx(4 / 10)
    assert serving_metrics(KNOWN).request_goodput is None  # no SLO, no goodput


def test_latency_statistics_match_numpy_as_vllm_computes_them() -> None:
    m = serving_metrics(KNOWN)
    assert m.ttft.mean == pytest.approx((50 + 80 + 100 + 150 + 90) / 5)
    assert m.ttft.median == m.ttft.p50 == pytest.approx(90)
    assert m.tpot.mean == pytest.approx((50 + 30 + 30 + 20) / 4)  # the one-token request has none
    assert m.e2el.p99 == pytest.approx(450 - 0.04 * (450 - 340))  # linear interpolation
    assert m.total_output_tokens == 37 and m.total_input_tokens == 500
    assert m.output_throughput == pytest.approx(37 / 10.0)
    assert m.total_token_throughput == pytest.approx(537 / 10.0)
    # ITL pools every gap of every request; an old record without gaps counts its mean once.
    gaps = [RequestRecord(start=0, ok=True, e2e_s=1, itls_s=[0.01, 0.03]),
            RequestRecord(start=0, ok=True, e2e_s=1, itl_s=0.02)]  # fmt: skip
    assert serving_metrics(gaps).itl.mean == pytest.approx(20.0)
    assert math.isnan(Latency.of([]).p99)


@pytest.mark.parametrize("bad", ["ttft", "ttft=", "latency=5", "ttft=-1", "ttft=fast"])
def test_slo_parsing_refuses_what_it_cannot_read(bad: str) -> None:
    with pytest.raises(ValueError, match="--slo"):
        SLO.parse(bad)


def test_one_worker_gets_everything_and_the_spread_shows_it() -> None:
    # The fleet has 4 workers (the router's GET /workers); every request went to w0.
    s = summarize(KNOWN[:4], SLO(ttft_ms=100), workers=["w0", "w1", "w2", "w3"])
    assert s.per_worker_requests == {"w0": 4, "w1": 0, "w2": 0, "w3": 0}
    assert s.load_max_over_mean == 4.0
    table = s.worker_table().splitlines()
    assert [line.split()[0] for line in table[1:]] == ["w0", "w1", "w2", "w3"]
    assert table[2].split()[1:3] == ["0", "0"]  # w1: no requests, no failures
    assert "over 4 workers" in s.table()
    # Per worker throughputs are over the run's duration: they add up to the whole.
    total = sum(m.request_throughput for m in s.per_worker_serving.values())
    assert total == pytest.approx(s.serving.request_throughput)
    assert s.per_worker_serving["w0"].request_goodput == pytest.approx(s.serving.request_goodput)


def test_the_result_file_uses_vllm_field_names(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    path.write_text("".join(r.to_json() + "\n" for r in KNOWN))
    info = {"request_rate": 2.0, "burstiness": 1.0, "max_concurrency": 16}
    write_report(read_records(path), tmp_path, slo=SLO(ttft_ms=100, tpot_ms=40),
                 workers=["w0", "w1"], run_info=info)  # fmt: skip
    result = json.loads((tmp_path / "summary.json").read_text())
    missing = [f for f in VLLM_FIELDS if f not in result]
    assert missing == []
    assert result["completed"] == 5 and result["failed"] == 1
    assert result["request_goodput"] == pytest.approx(0.3)
    assert result["median_ttft_ms"] == pytest.approx(90)
    assert result["per_worker"]["w1"]["completed"] == 0  # the idle worker is in the file
    assert all(f in result["per_worker"]["w0"] for f in VLLM_FIELDS[:-3])
