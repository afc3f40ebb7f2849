"""What one load-test run comes to: `summarize(records, slo, workers) -> Summary`.

The serving metrics of the run, as `vllm bench serve` defines and names them, for the
whole run and per worker:

- TTFT: time to the first generated text;
- TPOT: time per output token after the first, `(e2e - ttft) / (output_tokens - 1)`,
  one value per request with more than one output token;
- ITL: every gap between two streamed chunks (all gaps of all requests pooled);
- E2EL: the whole request;
- throughput: completed requests, output tokens and prompt + output tokens per second
  of the run's duration (first send to last answer);
- goodput: completed requests per second that met every objective of an `SLO`
  (DistServe's definition, and vLLM's rule: a request with one output token has TPOT 0).

Each latency gets mean, median, std and the p50 / p90 / p99 percentiles (numpy's linear
interpolation, as vLLM), in milliseconds. `ServingMetrics.to_vllm()` writes them under
the field names of vLLM's result JSON (vllm/benchmarks/serve.py, v0.32.0:
`completed`, `request_throughput`, `mean_ttft_ms`, `p99_tpot_ms`, `median_e2el_ms`, ...),
so a run of ours and one of theirs sit side by side. A distribution with no value
(no request succeeded, or no streamed chunk) is `None` there, where vLLM writes 0.

And the figures only a cache-aware router has: the hit rate from `cached_tokens`, and
requests per worker over every worker the router lists (GET /workers), the idle ones
included, so that a policy that sends everything to one of four workers shows a spread
of 4.00, not 1.00. Two tables with a unit on every figure: `table()` (the run) and
`worker_table()` (one line per worker). No plotting here: the locust process prints
these tables too (loadtests/load/runner.py draws the plots).

An uneven spread explains itself (`balance()`): on a cache-aware fleet, requests that
share a prefix stay on the worker that holds it until loads differ by more than the
router's balance threshold, so one user (or one shared system prompt) sends everything
to one worker and max/mean 2.00 on two workers is the policy working, not a fault. The
note says so when most requests hit a cached prefix (`prefix_hit_share`), and says it is
not affinity when they did not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace

import numpy as np

from loadtests.load.records import HitCounter, RequestRecord

PERCENTILES = (50, 90, 99)
UNEVEN = 1.25  # max/mean requests per worker above which the verdict explains the spread
AFFINITY = 0.5  # share of requests with a prefix hit above which affinity explains it
LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class SLO:
    """Service-level objectives per request, in milliseconds; None: no objective."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> SLO | None:
        """`ttft=200,tpot=50` (ms; keys ttft, tpot, e2el, as vLLM's --goodput); "" → None."""
        if not text or not text.strip():
            return None
        values: dict[str, float] = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"--slo wants ttft=MS,tpot=MS,e2el=MS (any of them), got {text!r}")
            try:
                values[f"{key}_ms"] = float(value)
            except ValueError:
                raise ValueError(f"--slo: {part.strip()!r} is not KEY=milliseconds") from None
            if values[f"{key}_ms"] <= 0:
                raise ValueError(f"--slo: {key} must be > 0 ms, got {value.strip()}")
        return cls(**values)

    def text(self) -> str:
        parts = [(f.name[:-3], getattr(self, f.name)) for f in fields(self)]
        return ",".join(f"{k}={v:g}" for k, v in parts if v is not None)

    def met_by(self, r: RequestRecord) -> bool:
        """Did a finished request meet every objective? A failed one never does."""
        if not r.ok:
            return False
        checks = ((self.ttft_ms, r.ttft_s), (self.tpot_ms, tpot_s(r) or 0.0),
                  (self.e2el_ms, r.e2e_s))  # fmt: skip
        # No TTFT measured (a whole answer, not a stream): it cannot be shown to meet one.
        return all(limit is None or (v is not None and v * 1000 <= limit) for limit, v in checks)


def tpot_s(r: RequestRecord) -> float | None:
    """Time per output token after the first (vLLM's TPOT); None for one token or none."""
    if r.ttft_s is None or r.output_tokens <= 1:
        return None
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)


@dataclass(frozen=True)
class Latency:
    """One latency's distribution, in milliseconds (NaN where there is no value)."""

    mean: float
    median: float
    std: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: Iterable[float]) -> Latency:
        ms = np.asarray(list(seconds), dtype=float) * 1000
        if not len(ms):
            return cls(*[math.nan] * 6)
        p50, p90, p99 = (float(np.percentile(ms, q)) for q in PERCENTILES)
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()), p50, p90, p99)


@dataclass(frozen=True)
class ServingMetrics:
    completed: int
    failed: int
    duration: float  # seconds, first send to last answer (of the whole run)
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    request_goodput: float | None  # requests / s meeting the SLO; None without one
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # prompt + output tokens / s
    ttft: Latency
    tpot: Latency
    itl: Latency
    e2el: Latency

    def to_vllm(self) -> dict[str, float | int | None]:
        """The fields of vLLM's result JSON that mean the same here, under their names."""
        out: dict[str, float | int | None] = {
            "duration": self.duration,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
        }
        for name in LATENCIES:
            lat: Latency = getattr(self, name)
            for stat in ("mean", "median", "std"):
                out[f"{stat}_{name}_ms"] = _num(getattr(lat, stat))
            for q in PERCENTILES:
                out[f"p{q}_{name}_ms"] = _num(getattr(lat, f"p{q}"))
        return out


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


def duration_of(records: list[RequestRecord]) -> float:
    """First send to last answer, in seconds (0 for no records)."""
    if not records:
        return 0.0
    return max(r.start + r.e2e_s for r in records) - min(r.start for r in records)


def serving_metrics(
    records: list[RequestRecord], slo: SLO | None = None, duration: float | None = None
) -> ServingMetrics:
    """`duration`: the run's, when `records` are a part of it (one worker's)."""
    ok = [r for r in records if r.ok]
    dur = duration_of(records) if duration is None else duration
    per_s = (lambda n: n / dur) if dur > 0 else (lambda n: 0.0)
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    good = None if slo is None else per_s(sum(1 for r in ok if slo.met_by(r)))
    # ITL: every gap between chunks, as vLLM pools them; a record written before the
    # gaps were kept counts its mean gap once.
    itl = [g for r in ok for g in (r.itls_s or ([r.itl_s] if r.itl_s is not None else []))]
    return ServingMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration=dur,
        total_input_tokens=prompt,
        total_output_tokens=output,
        request_throughput=per_s(len(ok)),
        request_goodput=good,
        output_throughput=per_s(output),
        total_token_throughput=per_s(prompt + output),
        ttft=Latency.of(r.ttft_s for r in ok if r.ttft_s is not None),
        tpot=Latency.of(t for r in ok if (t := tpot_s(r)) is not None),
        itl=Latency.of(itl),
        e2el=Latency.of(r.e2e_s for r in ok),
    )


def per_worker(
    records: list[RequestRecord],
    workers: Iterable[str] = (),
    slo: SLO | None = None,
    duration: float | None = None,
) -> dict[str, ServingMetrics]:
    """Each worker's share of the run, over the run's duration (`duration`, default the
    records' own), so the throughputs add up to the whole; a worker in `workers` that
    got nothing is listed with zeros."""
    dur = duration_of(records) if duration is None else duration
    by: dict[str, list[RequestRecord]] = {w: [] for w in workers}
    for r in records:
        by.setdefault(r.worker, []).append(r)
    return {w: serving_metrics(rs, slo, dur) for w, rs in sorted(by.items())}


@dataclass(frozen=True)
class Summary:
    requests: int  # sent, failed ones included
    failures: int
    serving: ServingMetrics  # the whole run, vLLM's metrics (loadtests/load/summary.py)
    hit_rate: float
    per_worker_requests: dict[str, int]
    per_worker_hit_rate: dict[str, float]
    per_worker_serving: dict[str, ServingMetrics]
    slo: SLO | None = None
    prefix_hit_share: float = 0.0  # answered requests with cached_tokens > 0, of all answered

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

    def balance(self) -> str:
        """Why requests per worker are uneven; "" when the spread is even enough."""
        counts = self.per_worker_requests
        spread = self.load_max_over_mean
        if len(counts) < 2 or spread <= UNEVEN:
            return ""
        busiest = max(counts, key=lambda w: counts[w])
        share = counts[busiest] / sum(counts.values())
        head = f"uneven load, max/mean {spread:.2f} ({busiest} answered {share:.0%})"
        hits = self.prefix_hit_share
        if hits >= AFFINITY:
            return (
                f"{head}: cache affinity, {hits:.0%} of requests hit a cached prefix; the "
                "router keeps a prefix on the worker that holds it until loads differ by more "
                "than its balance threshold (more users or more distinct prefixes spread it)"
            )
        return (
            f"{head}, not cache affinity (only {hits:.0%} of requests hit a cached prefix): "
            "check the policy and the workers' health"
        )

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
            "prefix_hit_share": self.prefix_hit_share,
            "balance": self.balance(),
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
            ("prefix hits", f"{self.prefix_hit_share:.0%} of answered requests "
             "(cached_tokens > 0)"),
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
        prefix_hit_share=sum(1 for r in ok if r.cached_tokens > 0) / len(ok) if ok else 0.0,
    ).over_fleet(workers)
