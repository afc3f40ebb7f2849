"""Router CPU per request with prompt ids (tokenizer + KV-event index) on vs off.

    python -m loadtests.bench_router_tokens [--requests 300] [--tokenizer sim|MODEL_DIR]

One zero-cost sim worker publishing KV events, the real router process started three
times on the same fleet: `off` (no tokenizer: the text tree alone), `tok` (`tokenizer`
only: each chat rendered with the template and tokenized as the worker does, pieces
cached, the tree keyed on the ids) and `on` (`tokenizer` + `kv_events`: the ids also
looked up in the index). The same multi-turn conversations with ~2k-token prompts go through
both; the router's own CPU (utime + stime from /proc) is divided by the requests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

import aiohttp

from loadtests.fleet import BenchFleet, WorkerSpec
from loadtests.workloads import NATO_WORDS as WORDS


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(url: str, args: argparse.Namespace, seed: int) -> int:
    rng = random.Random(seed)
    chats = [[{"role": "system", "content": f"Chat {s}. " +
               " ".join(rng.choice(WORDS) for _ in range(args.words))}]
             for s in range(args.sessions)]  # fmt: skip
    sent = 0
    async with aiohttp.ClientSession() as http:
        for turn in range(args.requests // args.sessions):

            async def one(chat: list[dict], turn: int = turn) -> None:
                chat.append({"role": "user", "content": f"Turn {turn}: {rng.choice(WORDS)}?"})
                body = {"messages": chat, "max_tokens": 4}  # the fleet's one model
                async with http.post(url + "/v1/chat/completions", json=body) as r:
                    data = await r.json()
                    assert r.status == 200, data
                chat.append(
                    {"role": "assistant", "content": data["choices"][0]["message"]["content"]}
                )

            await asyncio.gather(*(one(c) for c in chats))
            sent += len(chats)
    return sent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=320)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--words", type=int, default=700, help="system prompt words (~2k tokens)")
    p.add_argument("--tokenizer", default="sim")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    extra = ("--kv-events",) + (() if args.tokenizer == "sim" else ("--model", args.tokenizer))
    results: dict[str, list[float]] = {"off": [], "tok": [], "on": []}
    with BenchFleet() as fleet:
        fleet.start_worker("w0", WorkerSpec(decode_ms=0.0, prefill_us=0.0, extra=extra))
        for r in range(args.rounds):
            for mode in results:  # side by side, alternating
                settings: dict[str, object] = {"access_log": False}
                if mode != "off":
                    settings |= {"tokenizer": args.tokenizer, "kv_events": mode == "on"}
                fleet.start_router(settings)
                router = fleet.router
                assert router is not None
                asyncio.run(drive(router.url, args, seed=100 + r))  # warm-up: pieces, pools
                before = cpu_s(router.pid)
                t0 = time.perf_counter()
                n = asyncio.run(drive(router.url, args, seed=200 + r))
                used = cpu_s(router.pid) - before
                results[mode].append(used / n * 1e3)
                print(f"round {r} {mode:3s}: {used / n * 1e3:.3f} ms CPU per request "
                      f"({n} requests, {time.perf_counter() - t0:.1f} s)", flush=True)  # fmt: skip
    off, tok, on = (min(results[m]) for m in ("off", "tok", "on"))
    print(f"\nrouter CPU per request (best of {args.rounds}): off {off:.3f} ms, "
          f"tok {tok:.3f} ms ({tok / off:.2f}x), on {on:.3f} ms ({on / off:.2f}x) "
          f"(tokenizer {args.tokenizer})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
