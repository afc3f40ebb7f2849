"""Predicted vs actual cached tokens on a fresh `radix-router up`, with KV events on (its
default) and off, as a new user would run it.

    python -m loadtests.router.bench_up_prediction [--engine sim] [--sessions 12] [--turns 4]

Starts `python -m router up --workers 2` (then again with `--no-kv-events`), sends
multi-turn chats through it with the official client, and reads the dashboard's totals:
the tokens the router predicted cached on the chosen workers and what they reported.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

from loadtests.load.workloads import NATO_WORDS as WORDS
from shared.procs import Child, free_port, wait_until


def dashboard(url: str) -> dict:
    with urllib.request.urlopen(url + "/dashboard.json", timeout=10) as r:
        return json.loads(r.read())


def _ready(url: str) -> bool:
    try:
        return dashboard(url)["fleet"]["ready"] == 2
    except OSError:
        return False


def run(args: argparse.Namespace, kv_events: bool) -> tuple[float, float, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # A Child (shared/procs.py): its own session and a log file, never an unread pipe
    # (a full one blocked `up`, which then outlived the bench); `stop` is SIGTERM, which
    # `up` answers by stopping its router and workers, then SIGKILL after the grace.
    with tempfile.TemporaryDirectory() as tmp:
        up = Child("up", ["router", "up", "--workers", "2", "--engine", args.engine,
                          "--port", str(port)] + ([] if kv_events else ["--no-kv-events"]),
                   url, Path(tmp) / "up.log").start()  # fmt: skip
        try:
            wait_until(lambda: _ready(url), 180, up, poll_s=0.5)
            client = openai.OpenAI(base_url=url + "/v1", api_key="x")
            model = client.models.list().data[0].id
            rng = random.Random(3)
            chats = [[{"role": "system", "content": f"Session {s}. " +
                       " ".join(rng.choice(WORDS) for _ in range(args.words))}]
                     for s in range(args.sessions)]  # fmt: skip
            for turn in range(args.turns):
                for chat in chats:
                    chat.append({"role": "user", "content": f"Turn {turn}: {rng.choice(WORDS)}?"})
                    r = client.chat.completions.create(model=model, messages=chat, max_tokens=8)
                    chat.append(
                        {"role": "assistant", "content": r.choices[0].message.content or ""}
                    )
                time.sleep(0.3)
            fleet = dashboard(url)["fleet"]
            return (fleet["predicted_cached_tokens_total"], fleet["actual_cached_tokens_total"],
                    fleet["hit_rate"] or 0.0)  # fmt: skip
        finally:
            up.stop(grace_s=30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="sim")
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--words", type=int, default=300)
    args = p.parse_args()
    for kv in (True, False):
        predicted, actual, hit = run(args, kv)
        print(f"up --engine {args.engine} kv_events {'on ' if kv else 'off'}: predicted "
              f"{predicted:,.0f} / actual {actual:,} cached tokens = {predicted / actual:.3f} "
              f"(hit rate {hit:.3f})", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
