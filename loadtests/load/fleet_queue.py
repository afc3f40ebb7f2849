"""The fleet queue against today's router: many tenants, three classes, one flooding.

    python -m loadtests fleet-queue --before-ref main [--workload shared_prefix]
        [--loads 0.5,1.5] [--seconds 30] [--tenants 8] [--flood 10] [--replicas 1]
        [--spare-seats 0,1] [--retries 2]

`--before-ref none` runs this tree's side alone. `--spare-seats 0,1` runs this tree's
side once per `queue_spare_seats`, in that order, after the before side (not given: the
router's default). Since the fleet queue was merged, `main` queues too: today's router
without a queue is aa1ca1e (the merge's first parent, loadtests/results/fleet_queue.md).

One sim fleet (Redis, `--workers` sim workers of `--max-running` seats each, this
tree's code) serves the same open-loop schedule twice per load, flushed in between:
through `--before-ref`'s router (today's: no tenants, no classes; its requests carry no
class field, so this tree's workers order them as today's do) and through this tree's
(tenants and classes configured). `--tenants` tenants of weight 1 each send at one rate,
one of them `--flood` times that; each request is interactive, standard or batch by
`--mix` (multi_turn: each conversation keeps one class). A load of 1.0 is the fleet's
saturation rate, computed from the cost model:
workers x max_running / (output_len x decode_ms + prompt x prefill_us).

The client is open loop (each request leaves at its scheduled time, whatever came back
before) and retries as the official openai client does (openai-python's defaults,
`_base_client.py`): up to `--retries` (2) more tries of a request answered 408, 409, 429
or 5xx, after its Retry-After when that is 0-120 s, else 0.5 x 2^n s (at most 8 s, less
up to 25% jitter). A request's TTFT is taken from its FIRST try's send to the first byte
of its streamed answer's body (the first token: the worker opens its stream only then),
so a retried request's wait and back-off count against its class's objective.

Per side and load it prints, per class: goodput at SLO (requests/s whose first byte came
within the class's TTFT objective), SLO attainment (of those sent), TTFT p50, requests
refused for good (429 on the last try), 429 answers (every try), retried requests and
requests answered 503 on any try; the fleet's hit rate (the workers' own cached /
prompt token counters); Jain's index over the tenants' goodput, each divided by its fair
share (weight-proportional max-min shares of the total goodput, capped at what the
tenant sent), so 1.0 is a fair split; how far the busiest worker ran past its seats
(with `--replicas 2`, the replicas' bound); where this tree's queue placed its waiting
requests against their best predicted worker (`radix_router_queue_placed_total`); and
goodput over the answers' span (to the last good first byte), never above what the
fleet serves a second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml

from loadtests.kit import checkout, short
from loadtests.load.cluster import ROOT, Child, Cluster, WorkerSpec, serve_router, sim_cluster
from loadtests.load.workloads import words
from shared.config import RouterConfig
from shared.procs import free_port, wait_until

NO_BEFORE = "none"  # --before-ref none: this tree's side alone
CLASSES = ("interactive", "standard", "batch")
TIER = {"interactive": "priority", "standard": "default", "batch": "flex"}


@dataclass
class Sent:
    at: float  # offset in the schedule
    tenant: str
    klass: str
    prompt: str
    status: int = 0  # the last try's
    ttft: float | None = None  # from the first try's send
    tries: int = 0
    answered_429: int = 0  # tries answered 429
    answered_503: int = 0  # tries answered 503


def schedule(args: argparse.Namespace, rate: float) -> list[Sent]:
    """Every request of the run, in arrival order (Poisson per tenant, seeded)."""
    rng = random.Random(args.seed)
    mix = [float(x) for x in args.mix.split(",")]
    share = rate / (args.tenants - 1 + args.flood)
    out: list[Sent] = []
    for t in range(args.tenants):
        tenant = f"t{t}"
        prompts = _prompts(args, tenant, random.Random(f"{args.seed}:{tenant}"))
        per_s = share * (args.flood if t == 0 else 1)
        at = rng.expovariate(per_s)
        while at < args.seconds:
            prompt, klass = next(prompts)
            out.append(Sent(at, tenant, klass or rng.choices(CLASSES, mix)[0], prompt))
            at += rng.expovariate(per_s)
    out.sort(key=lambda s: s.at)
    return out


def _prompts(
    args: argparse.Namespace, tenant: str, rng: random.Random
) -> Iterator[tuple[str, str | None]]:
    """(prompt, class) per request; class None: drawn per request by `--mix`."""
    if args.workload == "shared_prefix":
        systems = [words(rng, args.system_len) for _ in range(args.groups)]
        while True:
            yield rng.choice(systems) + " " + words(rng, args.question_len), None
    # multi_turn, open loop: a turn extends its conversation's last prompt with a reply
    # and a new question, whether or not that reply has come back yet. A conversation
    # keeps one class (a chat is interactive, a batch job batch), drawn by `--mix`.
    mix = [float(x) for x in args.mix.split(",")]
    classes = [rng.choices(CLASSES, mix)[0] for _ in range(args.groups)]
    convs = [f"{tenant} " + words(rng, args.system_len // 4) for _ in range(args.groups)]
    turns = [0] * args.groups
    k = 0
    while True:
        c = k % args.groups
        k += 1
        if turns[c] == args.turns:
            convs[c], turns[c] = f"{tenant} " + words(rng, args.system_len // 4), 0
        convs[c] += " " + words(rng, args.question_len)
        turns[c] += 1
        yield convs[c], classes[c]
        convs[c] += " " + words(rng, args.output_len)


# openai-python's retry rule (`_base_client.py`, `_should_retry` and
# `_calculate_retry_timeout`): what a client of the official SDK does by default.
RETRY_STATUSES = frozenset({408, 409, 429})
RETRY_AFTER_MAX_S = 120.0
BACKOFF_S, BACKOFF_MAX_S = 0.5, 8.0


def retry_delay(headers: Mapping[str, str], retry: int, rng: random.Random) -> float:
    """Seconds before retry number `retry` (0-based): the answer's Retry-After when it is
    a number in (0, 120], else 0.5 x 2^retry s, at most 8, less up to 25% jitter."""
    try:
        after = float(headers.get("Retry-After", ""))
    except ValueError:
        after = math.nan
    if math.isfinite(after) and 0 < after <= RETRY_AFTER_MAX_S:
        return after
    return min(BACKOFF_S * 2.0**retry, BACKOFF_MAX_S) * (1 - 0.25 * rng.random())


def should_retry(status: int) -> bool:
    return status in RETRY_STATUSES or status >= 500


async def _one(
    session: aiohttp.ClientSession, url: str, s: Sent, classes: bool, retries: int
) -> None:
    body: dict = {"prompt": s.prompt, "max_tokens": OUTPUT[0], "ignore_eos": True, "stream": True}
    if classes:
        body["service_tier"] = TIER[s.klass]
    headers = {"Authorization": f"Bearer key-{s.tenant}"}
    rng = random.Random(f"{s.at}:{s.tenant}")  # the jitter, the same for both sides
    start = time.monotonic()  # the first try's send: TTFT and the SLO count from here
    while True:
        s.tries += 1
        try:
            async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
                s.status = r.status
                s.answered_429 += r.status == 429
                s.answered_503 += r.status == 503
                if r.status == 200:
                    await r.content.readany()
                    s.ttft = time.monotonic() - start
                    await r.read()
                    return
                await r.read()
                retry_headers = r.headers
        except (aiohttp.ClientError, TimeoutError):
            s.status = -1
            return
        if s.tries > retries or not should_retry(s.status):
            return
        await asyncio.sleep(retry_delay(retry_headers, s.tries - 1, rng))


OUTPUT = [16]  # max_tokens of every request (set from --output-len)


async def drive(
    urls: list[str], plan: list[Sent], classes: bool, drain_s: float, retries: int = 0
) -> float:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        t0 = time.monotonic()
        tasks = []
        for i, s in enumerate(plan):
            delay = s.at - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            url = urls[i % len(urls)]
            tasks.append(asyncio.create_task(_one(session, url, s, classes, retries)))
        _, pending = await asyncio.wait(tasks, timeout=drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return time.monotonic() - t0


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else 0.0


def fair_shares(demand: dict[str, float], total: float) -> dict[str, float]:
    """Max-min fair shares (equal weights) of `total`, none above its demand."""
    shares, left, open_ = {}, total, dict(demand)
    while open_:
        each = left / len(open_)
        capped = {t: d for t, d in open_.items() if d <= each}
        if not capped:
            shares.update(dict.fromkeys(open_, each))
            break
        for t, d in capped.items():
            shares[t] = d
            left -= d
            del open_[t]
    return shares


def summarize(plan: list[Sent], slo: dict[str, float], seconds: float) -> dict:
    out: dict = {"classes": {}}
    for klass in CLASSES:
        mine = [s for s in plan if s.klass == klass]
        good = [s for s in mine if s.status == 200 and s.ttft is not None and s.ttft <= slo[klass]]
        ttfts = [s.ttft for s in mine if s.ttft is not None]
        out["classes"][klass] = {
            "sent": len(mine),
            "goodput_rps": len(good) / seconds,
            "attainment": len(good) / len(mine) if mine else None,
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "429": sum(s.status == 429 for s in mine),  # refused for good: every try
            "429_answers": sum(s.answered_429 for s in mine),
            "retried": sum(s.tries > 1 for s in mine),
            "503": sum(s.answered_503 > 0 for s in mine),  # on any try
            "unanswered": sum(s.status in (0, -1) for s in mine),
        }
    good_by: dict[str, float] = {}
    sent_by: dict[str, float] = {}
    for s in plan:
        sent_by[s.tenant] = sent_by.get(s.tenant, 0) + 1
        ok = s.status == 200 and s.ttft is not None and s.ttft <= slo[s.klass]
        good_by[s.tenant] = good_by.get(s.tenant, 0) + ok
    shares = fair_shares(sent_by, sum(good_by.values()))
    out["jain"] = jain([good_by[t] / shares[t] for t in sent_by if shares[t] > 0])
    out["goodput_rps"] = sum(good_by.values()) / seconds
    # The same over the run's span up to the last good first byte (the schedule's clock):
    # answers served after the schedule ended (a backlog, a retry) spread over the time
    # they took, so it never goes above what the fleet serves a second.
    ends = [s.at + s.ttft for s in plan if s.ttft is not None and s.ttft <= slo[s.klass]]
    out["goodput_span_rps"] = sum(good_by.values()) / max([seconds, *ends])
    for who, mine in (("flooder", [s for s in plan if s.tenant == "t0"]),
                      ("others", [s for s in plan if s.tenant != "t0"])):  # fmt: skip
        out[who] = {k: _attainment([s for s in mine if s.klass == k], slo[k]) for k in CLASSES}
    solo = [s.ttft for s in plan if s.tenant != "t0" and s.ttft is not None]
    out["others_ttft_p50_s"] = statistics.median(solo) if solo else None
    return out


def _attainment(sent: list[Sent], slo: float) -> float | None:
    good = sum(s.status == 200 and s.ttft is not None and s.ttft <= slo for s in sent)
    return good / len(sent) if sent else None


def router_config(args: argparse.Namespace, new: bool, sync: bool) -> dict:
    config: dict = {
        "policy": "cache_aware", "balance_abs_threshold": max(1, args.max_running // 2),
        "discovery_interval": 0.2, "retry_backoff": 0.01, "access_log": False,
        "log_level": "WARNING", "sync": sync,
    }  # fmt: skip
    if new:
        config["tenants"] = {f"t{t}": {"keys": [f"key-t{t}"]} for t in range(args.tenants)}
        config["classes"] = {k: {"ttft_slo_s": v} for k, v in _slo(args).items()}
        config["queue_timeout"] = args.max_wait
        if args.spare_seats is not None:
            config["queue_spare_seats"] = args.spare_seats
    return config


def _slo(args: argparse.Namespace) -> dict[str, float]:
    return dict(zip(CLASSES, (float(x) for x in args.slo.split(",")), strict=True))


def start_router(fleet: Cluster, name: str, config: dict, tree: Path | None, tmp: Path) -> Child:
    """A router from checkout `tree` (None: this one) on `config` (a YAML file: tenants
    are nested), ready once it routes to every worker; stopped with the cluster."""
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**config, "redis_url": fleet.redis.url}))  # type: ignore[union-attr]
    child = serve_router(name, free_port(), fleet.log_dir, ["--config", str(path)], tree or ROOT)
    fleet.adopt(child)
    fleet.router_headers = {"Authorization": "Bearer key-t0"}
    wait_until(lambda: fleet.routable(child) >= len(fleet.workers), 45, child)
    return child


async def watch_seats(fleet: Cluster, seats: int, stop: asyncio.Event) -> dict:
    """Sample each worker's running + waiting (its own /metrics) until `stop`."""
    most, over, samples = 0, 0, 0
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            for child in fleet.workers.values():
                async with session.get(child.url + "/metrics") as r:
                    text = await r.text()
                held = sum(
                    float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith(("radix_worker_running_requests ", "radix_worker_waiting_requests "))
                )  # fmt: skip
                most, samples, over = max(most, int(held)), samples + 1, over + (held > seats)
            await asyncio.sleep(0.05)
    return {"max_held": most, "seats": seats, "max_over": max(0, most - seats),
            "share_of_samples_over": over / samples if samples else 0.0}  # fmt: skip


async def placed(routers: list[Child]) -> dict[str, float]:
    """Where this tree's queue placed its waiting requests against their best predicted
    worker (`radix_router_queue_placed_total`, summed over the replicas)."""
    out: dict[str, float] = {}
    prefix = "radix_router_queue_placed_total{"
    async with aiohttp.ClientSession() as session:
        for child in routers:
            async with session.get(child.url + "/metrics") as r:
                for line in (await r.text()).splitlines():
                    if line.startswith(prefix):
                        name = line.split('placed="', 1)[1].split('"', 1)[0]
                        out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def hit_rate(fleet: Cluster) -> tuple[float, float]:
    return (
        fleet.worker_counter("radix_worker_cached_tokens_total"),
        fleet.worker_counter("radix_worker_prompt_tokens_total"),
    )


async def run_side(
    args: argparse.Namespace, fleet: Cluster, urls: list[str], plan: list[Sent], new: bool
) -> dict:
    fleet.flush()
    cached0, prompt0 = hit_rate(fleet)
    stop = asyncio.Event()
    per_worker = args.max_running + (spare_seats(args) if new else 0)
    watcher = asyncio.create_task(watch_seats(fleet, per_worker, stop))
    await drive(urls, plan, new, args.drain, args.retries)
    stop.set()
    seats = await watcher
    cached1, prompt1 = hit_rate(fleet)
    out = summarize(plan, _slo(args), args.seconds)
    out["hit_rate"] = (cached1 - cached0) / (prompt1 - prompt0) if prompt1 > prompt0 else None
    out["seats"] = seats
    return out


def spare_seats(args: argparse.Namespace) -> int:
    """This tree's `queue_spare_seats`: the side's own, else the router's default."""
    return RouterConfig().queue_spare_seats if args.spare_seats is None else args.spare_seats


def this_tree_sides(args: argparse.Namespace) -> list[tuple[str, argparse.Namespace]]:
    """This tree's sides, in run order: one per `--spare-seats` entry (each its own copy
    of `args` with that `spare_seats`), else one at the router's default."""
    counts = [int(x) for x in args.spare_seats_list.split(",")] if args.spare_seats_list else []
    return [
        (
            f"spare {n}" if counts else "this tree",
            argparse.Namespace(**{**vars(args), "spare_seats": n}),
        )
        for n in counts or [None]
    ]


def saturation_rate(args: argparse.Namespace) -> float:
    prompt = args.system_len + args.question_len * (
        args.turns if args.workload == "multi_turn" else 1
    )
    per_request_s = args.output_len * args.decode_ms / 1e3 + prompt * args.prefill_us / 1e6
    return args.workers * args.max_running / per_request_s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--before-ref", default="main", help=f"today's router: this git ref ({NO_BEFORE}: skip it)"
    )
    p.add_argument("--workload", choices=["shared_prefix", "multi_turn"], default="shared_prefix")
    p.add_argument("--loads", default="0.5,1.5", help="rates, as multiples of saturation")
    p.add_argument("--seconds", type=float, default=30.0, help="schedule length per run")
    p.add_argument("--drain", type=float, default=90.0, help="seconds to wait for answers")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--flood", type=float, default=10.0, help="tenant t0 sends this x its share")
    p.add_argument("--mix", default="0.2,0.3,0.5", help="interactive,standard,batch shares")
    p.add_argument("--slo", default="1,4,60", help="TTFT objective s: interactive,standard,batch")
    p.add_argument("--max-wait", type=float, default=20.0, help="each tenant's max_queue_wait_s")
    p.add_argument("--replicas", type=int, default=1, help="routers per side (2: sync on)")
    p.add_argument(
        "--spare-seats", dest="spare_seats_list", default="",
        help="this tree once per queue_spare_seats, side by side: 0,1 (default: the router's)",
    )  # fmt: skip
    p.add_argument(
        "--retries", type=int, default=2,
        help="the client's retries of a 408/409/429/5xx, as openai-python's max_retries",
    )  # fmt: skip
    p.set_defaults(spare_seats=None)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-running", type=int, default=4, help="each worker's seats")
    p.add_argument("--decode-ms", type=float, default=25.0)
    p.add_argument("--prefill-us", type=float, default=50.0)
    p.add_argument("--system-len", type=int, default=256, help="words")
    p.add_argument("--question-len", type=int, default=32, help="words")
    p.add_argument("--output-len", type=int, default=16, help="tokens per answer")
    p.add_argument("--groups", type=int, default=4, help="prompts (or conversations) per tenant")
    p.add_argument("--turns", type=int, default=6, help="multi_turn: turns per conversation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="also write the results here")


async def _main(args: argparse.Namespace) -> dict:
    OUTPUT[0] = args.output_len
    sat = saturation_rate(args)
    spec = WorkerSpec(
        decode_ms=args.decode_ms, prefill_us=args.prefill_us, cache_tokens=200_000,
        heartbeat_s=0.2, max_running=args.max_running, extra=("--log-level", "WARNING"),
    )  # fmt: skip
    results: dict = {"saturation_rps": sat, "args": vars(args), "runs": []}
    before_name = "" if args.before_ref == NO_BEFORE else f"@{short(args.before_ref)}"
    skip_before = args.before_ref == NO_BEFORE
    with (
        tempfile.TemporaryDirectory() as tmp,
        contextlib.nullcontext() if skip_before else checkout(args.before_ref) as before,
        sim_cluster(args.workers, spec) as fleet,
    ):
        sides = [] if skip_before else [(before_name, before, False, args)]
        sides += [(name, None, True, side) for name, side in this_tree_sides(args)]
        for load in (float(x) for x in args.loads.split(",")):
            plan_of = schedule(args, load * sat)
            for i, (name, tree, new, side_args) in enumerate(sides):
                routers = []
                for r in range(args.replicas):
                    config = router_config(side_args, new, args.replicas > 1)
                    routers.append(
                        start_router(fleet, f"{name[:6]}{i}-{load}-{r}", config, tree, Path(tmp))
                    )
                plan = [Sent(s.at, s.tenant, s.klass, s.prompt) for s in plan_of]
                out = await run_side(side_args, fleet, [c.url for c in routers], plan, new)
                if new:
                    out["placed"] = await placed(routers)
                out.update(side=name, load=load, rate_rps=load * sat, sent=len(plan))
                results["runs"].append(out)
                print(render(out), flush=True)
                for child in routers:
                    child.stop(grace_s=5)
                    fleet.others.remove(child)
    return results


def render(run: dict) -> str:
    lines = [
        f"{run['side']:>10}  load {run['load']:.2f} ({run['rate_rps']:.1f} req/s, {run['sent']} sent): "
        f"goodput@SLO {run['goodput_rps']:.2f} req/s "
        f"(over the answers' span {run.get('goodput_span_rps', math.nan):.2f}), "
        f"hit rate {_pct(run['hit_rate'])}, "
        f"Jain {run['jain']:.3f}, others' TTFT p50 {_ms(run['others_ttft_p50_s'])}, "
        f"worker max held {run['seats']['max_held']}/{run['seats']['seats']} seats"
        f" (over in {100 * run['seats']['share_of_samples_over']:.1f}% of samples)"
    ]
    if run.get("placed"):
        lines.append(
            f"{'':>12}waiting requests placed: "
            + ", ".join(f"{k} {v:.0f}" for k, v in run["placed"].items())
        )
    for klass, c in run["classes"].items():
        lines.append(
            f"{'':>12}{klass:<12} sent {c['sent']:>5}  goodput {c['goodput_rps']:6.2f}/s  "
            f"attainment {_pct(c['attainment']):>6} (flooder {_pct(run['flooder'][klass])}, "
            f"others {_pct(run['others'][klass])})  TTFT p50 {_ms(c['ttft_p50_s']):>9}  "
            f"429 {c['429']:>4} (answers {c['429_answers']}, retried {c['retried']})  "
            f"503 {c['503']:>4}  unanswered {c['unanswered']}"
        )
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f} ms"


def defaults() -> argparse.Namespace:
    """Every option at its default (another command's starting point: `sweep --multi-tenant`)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([])


def run(args: argparse.Namespace) -> dict:
    """Both sides at every load of `args.loads`; the results `--json` writes."""
    return asyncio.run(_main(args))


def main(args: argparse.Namespace) -> int:
    results = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
