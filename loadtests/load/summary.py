"""What one load-test run comes to: `summarize(records, slo, workers) -> Summary`.

vLLM's serving metrics for the run and per worker (loadtests/load/serving.py), and the
figures only a cache-aware fleet has: the hit rate from `cached_tokens`, and requests
per worker over every worker of the fleet (the router's GET /workers), the idle ones
included, so that a policy that sends everything to one of four workers shows a spread
of 4.00, not 1.00. Two tables with a unit on every figure: `table()` (the run) and
`worker_table()` (one line per worker). No plotting here: the locust process prints
these tables too (loadtests/load/report.py draws the plots).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from loadtests.load.metrics import HitCounter, RequestRecord
from loadtests.load.serving import SLO, Latency, ServingMetrics, per_worker, serving_metrics


@dataclass(frozen=True)
class Summary:
    requests: int  # sent, failed ones included
    failures: int
    serving: ServingMetrics  # the whole run, vLLM's metrics (loadtests/load/serving.py)
    hit_rate: float
    per_worker_requests: dict[str, int]
    per_worker_hit_rate: dict[str, float]
    per_worker_serving: dict[str, ServingMetrics]
    slo: SLO | None = None

    # The figures every caller reads, from the serving metrics.
    duration_s = property(lambda self: self.serving.duration)
    throughput_rps = property(lambda self: self.serving.request_throughput)
    output_tokens_per_s = property(lambda self: self.serving.output_throughput)
    ttft_p50_ms = property(lambda self: self.serving.ttft.p50)
    ttft_p90_ms = property(lambda self: self.serving.ttft.p90)
    ttft_p99_ms = property(lambda self: self.serving.ttft.p99)
    e2e_p50_ms = property(lambda self: self.serving.e2el.p50)
    e2e_p99_ms = property(lambda self: self.serving.e2el.p99)
    itl_p50_ms = property(lambda self: self.serving.itl.p50)

    @property
    def load_max_over_mean(self) -> float:
        """Max / mean requests per worker, over every worker listed: 1.0 is an even spread."""
        counts = list(self.per_worker_requests.values())
        return max(counts) / (sum(counts) / len(counts)) if counts and sum(counts) else 0.0

    def over_fleet(self, worker_ids: Iterable[str]) -> Summary:
        """The same run, with the fleet's idle workers counted (0 requests): a policy
        that sends everything to one of 4 workers spreads max/mean 4.0, not 1.0."""
        ids = list(worker_ids)
        counts = dict(sorted((dict.fromkeys(ids, 0) | self.per_worker_requests).items()))
        rates = dict.fromkeys(ids, 0.0) | self.per_worker_hit_rate
        idle = serving_metrics([], self.slo, self.serving.duration)
        per = dict(sorted((dict.fromkeys(ids, idle) | self.per_worker_serving).items()))
        return replace(self, per_worker_requests=counts, per_worker_hit_rate=rates,
                       per_worker_serving=per)  # fmt: skip

    def to_dict(self) -> dict[str, object]:
        """The result file: vLLM's field names where the meaning is the same, then ours."""
        return {
            **self.serving.to_vllm(),
            "requests": self.requests,
            "slo": self.slo.text() if self.slo else None,
            "hit_rate": self.hit_rate,
            "load_max_over_mean": self.load_max_over_mean,
            "per_worker": {
                w: {
                    "requests": n,
                    "hit_rate": self.per_worker_hit_rate.get(w, 0.0),
                    **self.per_worker_serving[w].to_vllm(),
                }
                for w, n in self.per_worker_requests.items()
            },
        }

    def table(self) -> str:
        s = self.serving
        goodput = "no --slo given"
        if self.slo is not None and s.request_goodput is not None:
            share = s.request_goodput / s.request_throughput if s.request_throughput else 0.0
            goodput = (
                f"{s.request_goodput:.2f} req/s ({share:.0%} of requests meet {self.slo.text()} ms)"
            )
        # A latency without values: nothing succeeded, or answers came whole (no stream).
        none = "n/a (no request succeeded)" if not s.completed else "n/a (no streamed answer)"
        rows = [
            ("requests (failed)", f"{self.requests} ({self.failures})"),
            ("duration", f"{s.duration:.1f} s"),
            ("request throughput", f"{s.request_throughput:.2f} req/s"),
            ("output token throughput", f"{s.output_throughput:.0f} tok/s"),
            ("total token throughput", f"{s.total_token_throughput:.0f} tok/s"),
            ("goodput", goodput),
            ("", "mean / p50 / p90 / p99"),
            ("TTFT", _ms(s.ttft, none)),
            ("TPOT", _ms(s.tpot, none, 1)),
            ("ITL", _ms(s.itl, none, 1)),
            ("E2E latency", _ms(s.e2el, none)),
            ("cache hit rate", f"{self.hit_rate:.3f} (cached / prompt tokens)"),
            ("max/mean requests per worker", f"{self.load_max_over_mean:.2f} "
             f"(over {len(self.per_worker_requests)} workers; 1.00 is even)"),
        ]  # fmt: skip
        return "\n".join(f"{k:<30} {v}" for k, v in rows)

    def worker_table(self) -> str:
        """One line per worker, idle ones included."""
        head = (f"{'worker':<16} {'requests':>8} {'failed':>6} {'hit rate':>8} {'req/s':>7} "
                f"{'goodput req/s':>13} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} "
                f"{'TPOT p99 ms':>11} {'E2E p99 ms':>10}")  # fmt: skip
        lines = [head]
        for w, n in self.per_worker_requests.items():
            m = self.per_worker_serving[w]
            good = "-" if m.request_goodput is None else f"{m.request_goodput:.2f}"
            lines.append(
                f"{w:<16} {n:>8} {m.failed:>6} {self.per_worker_hit_rate.get(w, 0.0):>8.3f} "
                f"{m.request_throughput:>7.2f} {good:>13} {_v(m.ttft.p50):>11} "
                f"{_v(m.ttft.p99):>11} {_v(m.tpot.p99, 1):>11} {_v(m.e2el.p99):>10}"
            )
        return "\n".join(lines)


def _v(x: float, digits: int = 0) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def _ms(lat: Latency, none: str, digits: int = 0) -> str:
    if math.isnan(lat.mean):  # say why instead of printing NaN
        return none
    values = (lat.mean, lat.p50, lat.p90, lat.p99)
    return " / ".join(f"{v:.{digits}f}" for v in values) + " ms"


def summarize(
    records: list[RequestRecord], slo: SLO | None = None, workers: Iterable[str] = ()
) -> Summary:
    """`workers`: the fleet's worker ids (the router's GET /workers), so that a worker
    that got no request is listed and counted in the spread."""
    hits = HitCounter.from_records(records)
    serving = serving_metrics(records, slo)
    # Per worker: its answered requests (a request the router refused itself names no
    # worker), over the whole run's duration so that the throughputs add up.
    ok = [r for r in records if r.ok]
    return Summary(
        requests=len(records),
        failures=len(records) - len(ok),
        serving=serving,
        hit_rate=hits.hit_rate,
        per_worker_requests=dict(sorted(hits.requests.items())),
        per_worker_hit_rate={w: hits.worker_hit_rate(w) for w in sorted(hits.prompt)},
        per_worker_serving=per_worker(ok, (), slo, serving.duration),
        slo=slo,
    ).over_fleet(workers)
