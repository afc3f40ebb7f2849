"""The agent workload (loadtests/load/agents.py) in the fleet simulator, virtual time.

The router side is the router's own code: `build_routing` (cache_aware and its trees) and,
with keys, `router.holdings.sessions.select` over a `SessionTable`, as the proxy runs them.
`replicas` > 1 gives each replica its own policy and table, sends a session's calls
round robin over them, and applies each replica's decisions (tree inserts, session
placements and pins, as the proxy publishes them) to the others `sync_delay_s` later (router/fleet/sync.py's flush). The
workers are the engine (simulate/worker.py) with pins on when `CostModel.pin_budget` > 0.
Each replica's session table is built as the proxy builds it (`replicas` when sync is on).

Not modelled: the router's fleet queue (router/queue/), which gives a worker at most
`max_running + 1` requests and holds the rest in the router. Here every call goes to
the worker the policy picks and waits in its engine. Counted in the sixth round's runs
(loadtests/results/agents.md): the calls sent to a worker that already held
`max_running + 1` were 0-0.4% at 4 workers, 0.08 sessions/s (5% at seed 1) and 2
workers, 0.04/s; only past capacity (2 workers, 0.08/s) would the queue change routing.

Optional background: `background` shared-prefix requests (open loop, Poisson at
`background_rate`) through the same router; their hit rate is reported apart, so a run
with agents beside them compares with a run of them alone.

Reported per run (`AgentResult`): job completion time per session (first call sent to
last answer), the same less its tool gaps, per-call hit rate after the first call (mean
of each call's cached / prompt tokens), TTFT per call, siblings co-located (siblings
that reached their first sibling's worker) and the background's hit rate; and where the
JCT goes (`breakdown`): tool gaps, queue, prefill and decode per session, the tokens
prefilled and the workers' busy fraction, with the floor no side can beat (the gaps
over today's JCT).

`python -m loadtests agent`: the agent workload, side by side, in one run.

Sides (the same sessions, the same fleet, the same background traffic):

  today        cache_aware; no prompt_cache_key; the engine without pins (what main
               runs: with no key the router takes today's path, with pin_budget 0 the
               engine builds no pin table)
  keys         + prompt_cache_key sessions (router/holdings/sessions.py)
  keys+pins    + pins across tool gaps (worker/engine/pins.py): `--pin-budget`, a TTL
               of `--pin-ttl-s` (virtual seconds, after `--speedup`)
  2 replicas   keys+pins through two router replicas, calls round robin, decisions
               shared `--sync-delay-s` later

and the background (shared-prefix, `--background-rate` a second) alone, to compare its
hit rate beside agents with its hit rate alone. Simulated (loadtests/simulate/agents.py:
the router's policy and session code, the engine's scheduler, cache and pins, virtual
time); `--live` replays the same sessions through a local sim fleet instead
(`run_live` in loadtests/load/agents.py), `--before-ref REF` running the today side from REF.
Simulator only: `--sides` (a subset of the sides) and `--host-cache-tokens` (a host KV
tier on every side's workers).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from loadtests.kit import WorkloadOptions
from loadtests.load.agents import AgentOptions, AgentSession, agent_sessions, run_live
from loadtests.load.workloads import Workload
from loadtests.simulate.simulation import (
    LiveTokenizer,
    Simulation,
    WordTokenizer,
    busy_fraction,
    output_tokens,
    reply_text,
)
from loadtests.simulate.worker import CostModel, Job
from router.holdings import sessions
from router.holdings.prediction import RouteRequest
from router.holdings.sessions import SessionTable, session_digest
from router.holdings.sync_wire import SessionEntry
from router.policy import build_routing
from router.routing import Routing
from shared.config import RouterConfig

_STEP_END, _ARRIVAL, _SESSION = 0, 1, 2


@dataclass
class AgentResult:
    label: str
    jct: np.ndarray  # per session, seconds
    jct_less_gaps: np.ndarray
    call_hit: np.ndarray  # per call after the first, cached / prompt tokens
    # The same over what could be cached: the previous call's prompt (the new tool
    # output never can be), so 1.0 means the cache survived every tool gap.
    call_reuse: np.ndarray
    # The workload's own ceiling per call after the first: what could be cached (the
    # previous call's prompt) over the prompt; hit after 1st can be no higher.
    call_ceiling: np.ndarray
    ttft: np.ndarray  # per agent call
    siblings: int = 0
    siblings_together: int = 0
    background_hit: float = float("nan")
    reasons: dict[str, int] = field(default_factory=dict)
    hit_rate: float = 0.0  # every agent call's cached / prompt tokens, summed
    makespan: float = 0.0  # first call sent to last answer, virtual seconds
    # JCT = gaps + queue + prefill + decode, per session (seconds): each step's time is
    # its last-answered call's, split at admission (queue: waiting for a running slot or
    # KV) and at the first token (prefill: its uncached prompt, chunked beside others).
    parts: dict[str, np.ndarray] = field(default_factory=dict)
    prefilled: int = 0  # agent prompt tokens prefilled (not served from the cache)
    busy: float = 0.0  # workers' time in steps / (workers x makespan)

    def row(self) -> dict[str, object]:
        return {
            "label": self.label,
            "sessions": len(self.jct),
            "calls": len(self.ttft),
            "hit_after_first": float(self.call_hit.mean()) if len(self.call_hit) else 0.0,
            "reuse_after_first": float(self.call_reuse.mean()) if len(self.call_reuse) else 0.0,
            "ceiling_after_first": (
                float(self.call_ceiling.mean()) if len(self.call_ceiling) else 0.0
            ),
            "jct_mean_s": float(self.jct.mean()),
            "jct_less_gaps_mean_s": float(self.jct_less_gaps.mean()),
            "ttft_p50_ms": float(np.percentile(self.ttft, 50)) * 1e3,
            "ttft_p99_ms": float(np.percentile(self.ttft, 99)) * 1e3,
            "siblings_colocated": self.siblings_together / self.siblings if self.siblings else 1.0,
            "background_hit": self.background_hit,
            "hit_rate": self.hit_rate,
            "request_throughput": len(self.ttft) / self.makespan if self.makespan else 0.0,
            "median_ttft_ms": float(np.median(self.ttft)) * 1e3,
            **{f"{k}_mean_s": float(v.mean()) for k, v in self.parts.items()},
            "prefilled_tokens": self.prefilled,
            "busy": self.busy,
            "reasons": self.reasons,
        }


@dataclass
class _Step:
    """One step of a session in flight: a call, or its siblings."""

    texts: list[str]
    jobs: list[Job]
    sent: float
    left: int


class AgentSim(Simulation):
    def __init__(
        self, config: RouterConfig, workers: int, cost: CostModel, options: AgentOptions,
        replicas: int = 1, sync_delay_s: float = 0.02, seed: int = 0,
        tokenizer: WordTokenizer | LiveTokenizer | None = None,
    ) -> None:  # fmt: skip
        super().__init__(config, workers, cost, seed)
        self.config = config
        self.options = options
        self.replicas: list[tuple[Routing, SessionTable]] = [
            (self.policy if r == 0 else build_routing(config, random.Random(seed + r)),
             SessionTable(config.session_table_max, config.session_ttl, replicas > 1))
            for r in range(replicas)
        ]  # fmt: skip
        self.sync_delay_s = sync_delay_s
        self._sync: list[tuple[float, int, int, str, str | None, SessionEntry | None]] = []
        self._sync_seq = 0
        self._turn = 0
        self.tok = tokenizer or WordTokenizer()

    # -- routing ----------------------------------------------------------------------
    def _apply_sync(self, now: float) -> None:
        while self._sync and self._sync[0][0] <= now:
            _, _, r, wid, text, session = heapq.heappop(self._sync)
            policy, table = self.replicas[r]
            if text is not None:
                policy.observe(wid, text, now)
            if session is not None:
                table.learn(session, now)

    def _share(self, r: int, now: float, wid: str, text: str, session: SessionEntry | None) -> None:
        for other in range(len(self.replicas)):
            if other != r:
                self._sync_seq += 1
                at = now + self.sync_delay_s
                heapq.heappush(self._sync, (at, self._sync_seq, other, wid, text, session))

    def _route(self, job: Job, now: float) -> None:  # type: ignore[override]
        self._apply_sync(now)
        for i in self._unread:
            self.views.reported_at[i] = now
        self._unread.clear()
        r = self._turn % len(self.replicas)
        self._turn += 1
        policy, table = self.replicas[r]
        request = RouteRequest(job.text)
        shared = None
        if job.pin_key is not None and self.options.keys:
            digest = session_digest("", job.pin_key)
            decision, placed, left = sessions.select(
                table, policy, request, self.views, now, digest,
                self.config.balance_abs_threshold, self.config.balance_rel_threshold,
                pin_ttl=job.pin_ttl,
            )  # fmt: skip
            if placed or job.pin_ttl > 0:  # as the proxy publishes it
                shared = SessionEntry(digest, decision.worker_id, job.pin_ttl, placed)
            if left is not None:  # the session moved: its pin on the old worker goes
                self.workers[self.index[left]].engine.release_pin(job.pin_key)
        else:
            decision = policy.select(request, self.views, now)
        self._share(r, now, decision.worker_id, job.text, shared)
        who = "agent" if job.session >= 0 else "background"
        self.reasons[f"{who} {decision.reason}"] += 1
        i = self.index[decision.worker_id]
        worker = self.workers[i]
        if not worker.fits(job):
            self.rejected += 1
            return
        worker.submit(job)
        if not worker.busy:
            self._start_step(i, now)
        self._refresh(i, now)

    # -- the run ----------------------------------------------------------------------
    def _send_step(self, s: AgentSession, now: float) -> _Step:
        texts = s.next_step()
        jobs = []
        for text in texts:
            self._rids += 1
            job = Job(
                self._rids, now, self.tok.encode(text),
                output_tokens(self._rids, self.options.output_tokens), text, session=s.sid,
                pin_key=s.key if self.options.keys or self.options.pin_ttl_s else None,
                pin_ttl=self.options.pin_ttl_s,
            )  # fmt: skip
            jobs.append(job)
            self._push(now, _ARRIVAL, job)
        return _Step(texts, jobs, now, len(jobs))

    def run_agents(self, background: list[tuple[float, str]] = ()) -> AgentResult:  # type: ignore[assignment]
        o = self.options
        agents = agent_sessions(o)
        steps: dict[int, _Step] = {}
        history: dict[int, list[_Step]] = {s.sid: [] for s in agents}
        first_sent: dict[int, float] = {}
        last_answer: dict[int, float] = {}
        gaps: dict[int, float] = {s.sid: 0.0 for s in agents}
        for s in agents:
            self._push(s.start_s, _SESSION, s.sid)  # type: ignore[arg-type]
        bg_jobs: list[Job] = []
        for t, text in background:
            self._rids += 1
            job = Job(self._rids, t, self.tok.encode(text), output_tokens(self._rids, 32), text)
            bg_jobs.append(job)
            self._push(t, _ARRIVAL, job)
        while self._heap:
            now, kind, _, what = heapq.heappop(self._heap)
            if kind == _SESSION:
                s = agents[what]  # type: ignore[index]
                first_sent.setdefault(s.sid, now)
                steps[s.sid] = _Step([], [], now, 0)
                step = self._send_step(s, now)
                steps[s.sid] = step
                history[s.sid].append(step)
                continue
            if kind == _ARRIVAL:
                self._route(what, now)  # type: ignore[arg-type]
                continue
            finished = self.workers[what].finish_step(now)  # type: ignore[index]
            self._start_step(what, now)  # type: ignore[arg-type]
            self._refresh(what, now)  # type: ignore[arg-type]
            for job in finished:
                self._done.append(job)
                if job.session < 0:
                    continue
                s, step = agents[job.session], steps[job.session]
                step.left -= 1
                if step.left:
                    continue
                answers = [reply_text(j.rid, len(j.out_tokens)) for j in step.jobs]
                s.on_answers(step.texts, answers)
                last_answer[s.sid] = now
                if not s.done:
                    gap = s.gap_s()
                    gaps[s.sid] += gap
                    self._push(now + gap, _SESSION, s.sid)  # type: ignore[arg-type]
        return self._result(agents, history, first_sent, last_answer, gaps, bg_jobs)

    def _result(self, agents, history, first_sent, last_answer, gaps, bg_jobs) -> AgentResult:  # type: ignore[no-untyped-def]
        done = [s.sid for s in agents if s.sid in last_answer]
        jct = np.array([last_answer[i] - first_sent[i] for i in done])
        hits, reuse, ceiling, ttft, sib, together = [], [], [], [], 0, 0
        cached = prompt = 0
        parts = {k: np.zeros(len(done)) for k in ("gaps", "queue", "prefill", "decode")}
        for d, sid in enumerate(done):
            parts["gaps"][d] = gaps[sid]
            for n, step in enumerate(history[sid]):
                last = max(step.jobs, key=lambda j: j.finish)
                parts["queue"][d] += last.admitted - last.arrival
                parts["prefill"][d] += last.first_token - last.admitted
                parts["decode"][d] += last.finish - last.first_token
                for k, job in enumerate(step.jobs):
                    ttft.append(job.ttft)
                    cached, prompt = cached + job.cached, prompt + len(job.tokens)
                    if n > 0:
                        hits.append(job.cached / len(job.tokens))
                        # A sibling can reuse the context its first sibling prefills.
                        before = (step.jobs[0] if k else history[sid][n - 1].jobs[0]).tokens
                        reusable = _common(before, job.tokens)
                        reuse.append(min(job.cached, reusable) / reusable if reusable else 1.0)
                        ceiling.append(reusable / len(job.tokens))
                if len(step.jobs) > 1:
                    sib += len(step.jobs) - 1
                    together += sum(j.worker == step.jobs[0].worker for j in step.jobs[1:])
        bg_prompt = sum(len(j.tokens) for j in bg_jobs if j.admitted >= 0)
        bg_cached = sum(j.cached for j in bg_jobs if j.admitted >= 0)
        return AgentResult(
            label="", jct=jct, jct_less_gaps=jct - np.array([gaps[i] for i in done]),
            call_hit=np.array(hits), call_reuse=np.array(reuse),
            call_ceiling=np.array(ceiling), ttft=np.array(ttft), siblings=sib,
            siblings_together=together,
            background_hit=bg_cached / bg_prompt if bg_prompt else float("nan"),
            reasons=dict(self.reasons), hit_rate=cached / prompt if prompt else 0.0,
            makespan=max(last_answer.values(), default=0.0) - min(first_sent.values(), default=0.0),
            parts=parts, prefilled=prompt - cached,
            busy=busy_fraction(self.workers, self._done),
        )  # fmt: skip


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the common prefix of two token arrays."""
    same = min(len(a), len(b))
    neq = a[:same] != b[:same]
    return int(neq.argmax()) if neq.any() else same


def background_requests(
    count: int, rate: float, seed: int, groups: int = 8
) -> list[tuple[float, str]]:
    """`count` shared-prefix requests (SGLang's generator: `groups` groups of questions
    on one system prompt each; as many groups as requests: no prefix shared, traffic
    that only churns the caches), Poisson arrivals at `rate` a second, as (arrival, text)."""
    o = WorkloadOptions(
        workload="shared_prefix", groups=groups, prompts_per_group=max(1, count // groups),
        system_len=1024, question_len=64, output_len=32, seed=seed,
    )  # fmt: skip
    rng = random.Random(seed)
    t, out = 0.0, []
    for req in list(Workload(o).requests())[:count]:
        t += rng.expovariate(rate)
        out.append((t, req.text()))
    return out


def simulate_agents(
    label: str, config: RouterConfig, workers: int, cost: CostModel, options: AgentOptions,
    replicas: int = 1, background: list[tuple[float, str]] = (), seed: int = 0,
    tokenizer: WordTokenizer | LiveTokenizer | None = None,
) -> AgentResult:  # fmt: skip
    """One run; `options.keys` / `cost.pin_budget` / `options.pin_ttl_s` say which side.
    The router's tree counts characters against the workers' KV in tokens at the
    workload's own chars per token, as a live router learns it from its first answers
    (router/holdings/calibration.py): at the default guess (4.0; these texts are 5.0 a
    token) the tree forgot prefixes the workers still held, and the neighbour's
    requests were sent where nothing was cached."""
    tok = tokenizer or WordTokenizer()
    config = config.model_copy(
        update={"tree_chars_per_token": chars_per_token(options, background, tok)}
    )
    sim = AgentSim(config, workers, cost, options, replicas=replicas, seed=seed, tokenizer=tok)
    result = sim.run_agents(list(background))
    return replace(result, label=label)


def chars_per_token(
    options: AgentOptions, background: Sequence[tuple[float, str]],
    tokenizer: WordTokenizer | LiveTokenizer,
) -> float:  # fmt: skip
    """Characters per token of the run's texts (the sessions' first calls and up to 64
    background requests): what the live router's calibration converges to."""
    texts = [s.next_step()[0] for s in agent_sessions(options)[:16]]
    texts += [text for _, text in background[:64]]
    tokens = sum(len(tokenizer.encode(t)) for t in texts)
    return sum(map(len, texts)) / tokens if tokens else 4.0


def background_alone(
    config: RouterConfig, workers: int, cost: CostModel, background: list[tuple[float, str]],
) -> float:  # fmt: skip
    """The background's hit rate with no agents beside it (same fleet, same requests)."""
    none = AgentOptions(sessions=0)
    return simulate_agents(
        "alone", config, workers, cost, none, background=background
    ).background_hit


def add_arguments(p: argparse.ArgumentParser) -> None:
    defaults = AgentOptions(speedup=10.0, pin_ttl_s=0.0)
    for f in dataclasses.fields(AgentOptions):
        if f.name in ("keys", "pin_ttl_s"):
            continue  # set per side
        value = getattr(defaults, f.name)
        p.add_argument("--" + f.name.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--cache-tokens", type=int, default=192_000, help="device KV per worker")
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--prefill-us", type=float, default=30.0)
    p.add_argument("--decode-ms", type=float, default=3.0)
    p.add_argument("--pin-budget", type=float, default=0.25,
                   help="fraction of KV, keys+pins (the worker's default)")  # fmt: skip
    p.add_argument("--pin-ttl-s", type=float, default=None, help="default: gap max / speedup")
    p.add_argument(
        "--second-chance", type=float, default=CostModel.second_chance,
        help="the radix cache's second-chance cap, fraction of KV, every side (0: off)",
    )  # fmt: skip
    p.add_argument(
        "--host-cache-tokens", type=int, default=0,
        help="host KV tier per worker, every side (0: off, the worker's default)",
    )  # fmt: skip
    p.add_argument("--background-rate", type=float, default=6.0, help="shared-prefix req/s")
    p.add_argument("--background-s", type=float, default=60.0, help="its span, seconds")
    p.add_argument(
        "--background-groups", type=int, default=8,
        help="its system prompts (as many as requests: nothing shared, churn only)",
    )  # fmt: skip
    p.add_argument("--sync-delay-s", type=float, default=0.02)
    p.add_argument(
        "--sides", default=",".join(SIDES),
        help="the sides to run, comma-separated (today and keys+pins at least)",
    )  # fmt: skip
    p.add_argument("--json", default=None, help="write every row here too")
    p.add_argument("--live", action="store_true", help="through a local sim fleet")
    p.add_argument("--before-ref", default=None, help="--live: the today side from this ref")


def _options(args: argparse.Namespace) -> AgentOptions:
    names = {f.name for f in dataclasses.fields(AgentOptions)}
    return AgentOptions(**{k: v for k, v in vars(args).items() if k in names and v is not None})


# --sides names -> the sides' labels.
SIDES = {
    "today": "today", "keys": "keys", "keys+pins": "keys+pins",
    "replicas": "keys+pins, 2 replicas",
}  # fmt: skip


def run_sides(args: argparse.Namespace) -> tuple[list[AgentResult], dict[str, float]]:
    o = replace(_options(args), keys=False, pin_ttl_s=0.0)
    ttl = args.pin_ttl_s if args.pin_ttl_s is not None else o.gap_max_s / o.speedup
    cost = CostModel(
        cache_tokens=args.cache_tokens, max_running=args.max_running,
        prefill_us_per_token=args.prefill_us, decode_ms_per_token=args.decode_ms,
        host_cache_tokens=args.host_cache_tokens, second_chance=args.second_chance,
    )  # fmt: skip
    pinned = replace(cost, pin_budget=args.pin_budget, pin_max_ttl_s=ttl)
    config = RouterConfig(policy="cache_aware")
    count = int(args.background_rate * args.background_s)
    groups = min(args.background_groups, max(count, 1))
    bg = background_requests(count, args.background_rate, o.seed, groups) if count else []
    sides = {
        "today": (o, cost, 1),
        "keys": (replace(o, keys=True), cost, 1),
        "keys+pins": (replace(o, keys=True, pin_ttl_s=ttl), pinned, 1),
        "keys+pins, 2 replicas": (replace(o, keys=True, pin_ttl_s=ttl), pinned, 2),
    }
    wanted = [s.strip() for s in args.sides.split(",")]
    unknown = [s for s in wanted if s not in SIDES]
    if unknown or "today" not in wanted or "keys+pins" not in wanted:
        raise SystemExit(f"--sides: {unknown or wanted}: from {list(SIDES)}, today and keys+pins")
    results = []
    for name, label in SIDES.items():
        if name in wanted:
            opts, c, r = sides[label]
            results.append(
                simulate_agents(label, config, args.workers, c, opts, replicas=r, background=bg)
            )
    extra = {"background_alone_hit": float("nan")}
    if bg:
        alone = simulate_agents(
            "background alone", config, args.workers, cost, replace(o, sessions=0), background=bg
        )
        extra["background_alone_hit"] = alone.background_hit
    return results, extra


def table(results: list[AgentResult], extra: dict[str, float]) -> str:
    cols = [
        ("side", "label", "{}"), ("ceiling", "ceiling_after_first", "{:.3f}"),
        ("hit after 1st", "hit_after_first", "{:.3f}"),
        ("reuse after 1st", "reuse_after_first", "{:.3f}"),
        ("JCT mean s", "jct_mean_s", "{:.2f}"), ("JCT less gaps s", "jct_less_gaps_mean_s", "{:.2f}"),
        ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"), ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"),
        ("siblings together", "siblings_colocated", "{:.3f}"),
        ("background hit", "background_hit", "{:.3f}"),
    ]  # fmt: skip
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        row = r.row()
        lines.append("| " + " | ".join(f.format(row[k]) for _, k, f in cols) + " |")
    today = results[0].row()
    best = next(r for r in results if r.label == "keys+pins").row()
    lines.append("")
    lines.append(breakdown(results))
    lines.append("")
    lines.append(
        f"keys+pins / today: JCT {best['jct_mean_s'] / today['jct_mean_s']:.2f}x, "  # type: ignore[operator]
        f"JCT less gaps {best['jct_less_gaps_mean_s'] / today['jct_less_gaps_mean_s']:.2f}x; "  # type: ignore[operator]
        # No side can beat the tool gaps: the ratio if keys+pins spent no time in calls.
        f"floor (gaps / today's JCT) {today['gaps_mean_s'] / today['jct_mean_s']:.2f}x; "  # type: ignore[operator]
        f"background alone hit {extra['background_alone_hit']:.3f}, beside agents "
        f"{best['background_hit']:.3f}"
    )
    return "\n".join(lines)


def breakdown(results: list[AgentResult]) -> str:
    """Where each side's mean JCT goes (seconds a session), and the fleet's work: the
    agent prompt tokens prefilled and the workers' busy fraction."""
    parts = ("gaps", "queue", "prefill", "decode")
    lines = [
        "| side | JCT mean s | " + " | ".join(f"{p} s" for p in parts)
        + " | prefilled Mtok | workers busy |",
        "|" + "---|" * (len(parts) + 4),
    ]  # fmt: skip
    for r in results:
        row = r.row()
        lines.append(
            f"| {r.label} | {row['jct_mean_s']:.2f} | "
            + " | ".join(f"{row[p + '_mean_s']:.2f}" for p in parts)
            + f" | {r.prefilled / 1e6:.2f} | {r.busy:.2f} |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.live:
        return run_live(args, _options(args))
    results, extra = run_sides(args)
    print(table(results, extra))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [r.row() for r in results], **extra}, f, indent=1)
    return 0
