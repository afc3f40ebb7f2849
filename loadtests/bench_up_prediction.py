"""Predicted vs actual cached tokens on a fresh `radix-router up`, with KV events on (its
default) and off, as a new user would run it.

    python -m loadtests.bench_up_prediction [--engine sim] [--sessions 12] [--turns 4]

Starts `python -m router up --workers 2` (then again with `--no-kv-events`), sends
multi-turn chats through it with the official client, and reads the dashboard's totals:
the tokens the router predicted cached on the chosen workers and what they reported.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import IO

import openai

from loadtests.workloads import NATO_WORDS as WORDS
from shared.procs import free_port


def dashboard(url: str) -> dict:
    with urllib.request.urlopen(url + "/dashboard.json", timeout=10) as r:
        return json.loads(r.read())


def run(args: argparse.Namespace, kv_events: bool) -> tuple[float, float, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "router", "up", "--workers", "2", "--engine", args.engine,
           "--port", str(port)] + ([] if kv_events else ["--no-kv-events"])  # fmt: skip
    # `up`'s output goes to a file, never an unread pipe: a full pipe blocks `up` (and its
    # SIGINT handler's last lines), which then outlived the bench. Its own session lets
    # the fallback kill reach the router and workers it started, not just `up`.
    with tempfile.TemporaryFile(mode="w+") as log:
        return _measure(args, cmd, port, log)


def _measure(
    args: argparse.Namespace, cmd: list[str], port: int, log: IO[str]
) -> tuple[float, float, float]:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"`{' '.join(cmd)}` did not get ready:\n{log.read()[-4000:]}")
            try:
                if dashboard(url)["fleet"]["ready"] == 2:
                    break
            except OSError:
                pass
            time.sleep(0.5)
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
                chat.append({"role": "assistant", "content": r.choices[0].message.content or ""})
            time.sleep(0.3)
        fleet = dashboard(url)["fleet"]
        return (fleet["predicted_cached_tokens_total"], fleet["actual_cached_tokens_total"],
                fleet["hit_rate"] or 0.0)  # fmt: skip
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


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
