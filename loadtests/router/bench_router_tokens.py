"""Router CPU per request with prompt ids (tokenizer + KV-event index) on vs off.

    python -m loadtests.router.bench_router_tokens [--requests 320] [--rounds 3] [--before-ref REF]

One zero-cost sim worker publishing KV events and one real router process per mode,
all running at once: `off` (no tokenizer: the text tree alone), `tok` (`tokenizer`
only: each chat rendered with the template and tokenized as the worker does, pieces
cached, the tree keyed on the ids) and `on` (`tokenizer` + `kv_events`: the ids also
looked up in the index, and the feed applying the worker's event stream). Every request
of the multi-turn conversations (~2k-token prompts) goes to every router at the same
moment, so a busy neighbour on a shared machine slows all modes alike; each router's own
CPU (utime + stime from /proc, its feed's included) is divided by the requests.

`--before-ref REF` adds `tok@REF` and `on@REF`: the same modes with the router's code
from that git ref (loadtests/refs.py). Every round prints each mode's ratio to the same
round's `off`; the summary gives the range over rounds and whether every round is
within `--target` (issue 26: 1.5x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from contextlib import ExitStack

import aiohttp

from loadtests.load.cluster import BenchFleet, WorkerSpec
from loadtests.load.workloads import NATO_WORDS as WORDS
from loadtests.refs import checkout, short


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(urls: list[str], args: argparse.Namespace, seed: int) -> int:
    """The conversations, each request sent to every router at once; the first router's
    answer continues the conversation. Returns the requests each router answered."""
    rng = random.Random(seed)
    chats = [[{"role": "system", "content": f"Chat {s}. " +
               " ".join(rng.choice(WORDS) for _ in range(args.words))}]
             for s in range(args.sessions)]  # fmt: skip
    sent = 0
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def post(url: str, body: bytes) -> dict:
            async with http.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
                data = await r.json()
                assert r.status == 200, (url, data)
                return data  # type: ignore[no-any-return]

        for turn in range(args.requests // args.sessions):

            async def one(chat: list[dict], turn: int = turn) -> None:
                chat.append({"role": "user", "content": f"Turn {turn}: {rng.choice(WORDS)}?"})
                body = json.dumps({"messages": chat, "max_tokens": 4}).encode()
                answers = await asyncio.gather(*(post(u, body) for u in urls))
                content = answers[0]["choices"][0]["message"]["content"]
                chat.append({"role": "assistant", "content": content})

            await asyncio.gather(*(one(c) for c in chats))
            sent += len(chats)
    return sent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=320, help="per router and round")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--words", type=int, default=700, help="system prompt words (~2k tokens)")
    p.add_argument("--tokenizer", default="sim")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before-ref", default="", help="also run tok/on from this git ref")
    p.add_argument("--target", type=float, default=1.5, help="the ratio to off to meet")
    args = p.parse_args()
    extra = ("--kv-events",) + (() if args.tokenizer == "sim" else ("--model", args.tokenizer))
    modes = ["off", "tok", "on"]
    if args.before_ref:
        ref = short(args.before_ref)
        modes += [f"tok@{ref}", f"on@{ref}"]
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    with ExitStack() as stack:
        before = stack.enter_context(checkout(args.before_ref)) if args.before_ref else None
        fleet = stack.enter_context(BenchFleet())
        # A 3 s heartbeat expiry (1 s x 3): on a loaded shared machine the default 0.6 s
        # lapsed mid-round once in a while (`no_workers`), which is not what is measured.
        spec = WorkerSpec(decode_ms=0.0, prefill_us=0.0, heartbeat_s=1.0, extra=extra)
        fleet.start_worker("w0", spec)
        routers = {}
        for mode in modes:
            kind, _, at = mode.partition("@")
            settings: dict[str, object] = {"access_log": False}
            if kind != "off":
                settings |= {"tokenizer": args.tokenizer, "kv_events": kind == "on"}
            name = f"router-{kind}" + ("-before" if at else "")
            routers[mode] = fleet.add_router(name, settings, tree=before if at else None)
        urls = [r.url for r in routers.values()]
        asyncio.run(drive(urls, args, seed=100))  # warm-up: pieces, pools, trees
        for r in range(args.rounds):
            start = {m: cpu_s(c.pid) for m, c in routers.items()}
            t0 = time.perf_counter()
            n = asyncio.run(drive(urls, args, seed=200 + r))
            for m, c in routers.items():
                cpu[m].append((cpu_s(c.pid) - start[m]) / n * 1e3)
            line = ", ".join(f"{m} {v[-1]:.3f} ms ({ratio(v[-1], cpu['off'][-1]):.2f}x)"
                             for m, v in cpu.items())  # fmt: skip
            print(f"round {r} ({n} requests each, {time.perf_counter() - t0:.1f} s): {line}",
                  flush=True)  # fmt: skip
    print(summary(cpu, args), flush=True)
    return 0


def ratio(value: float, off: float) -> float:
    """/proc counts CPU in 10 ms ticks: a tiny run can read 0 for `off`."""
    return value / off if off else float("inf")


def summary(cpu: dict[str, list[float]], args: argparse.Namespace) -> str:
    """Per mode: CPU per request (min-max over rounds) and its ratio to the same round's
    `off` (min-max), and whether the ratio is within the target in every round."""
    lines = [f"\nrouter CPU per request over {args.rounds} rounds, {args.requests} requests "
             f"each (tokenizer {args.tokenizer}); ratio to the same round's off:"]  # fmt: skip
    for mode, values in cpu.items():
        ratios = [ratio(v, o) for v, o in zip(values, cpu["off"], strict=True)]
        line = f"  {mode:12s} {min(values):.3f}-{max(values):.3f} ms"
        if mode != "off":
            every = "yes" if max(ratios) <= args.target else "NO"
            line += (f"  ratio {min(ratios):.2f}-{max(ratios):.2f}x "
                     f"(mean {sum(ratios) / len(ratios):.2f}x; <= {args.target}x every round: {every})")  # fmt: skip
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
