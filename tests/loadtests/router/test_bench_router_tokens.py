"""bench_router_tokens: every mode's router answers every request of the conversations,
and the summary says 'NO' when any one round is over the target (a range, not a best)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from loadtests.router.bench_router_tokens import drive, summary


def test_one_round_over_the_target_is_a_no() -> None:
    args = argparse.Namespace(rounds=3, requests=10, tokenizer="sim", target=1.5)
    cpu = {"off": [1.0, 1.0, 2.0], "tok": [1.2, 1.4, 2.2], "on": [1.4, 1.6, 2.4]}
    lines = {line.split()[0]: line for line in summary(cpu, args).splitlines()[2:]}
    assert "1.200-2.200 ms  ratio 1.10-1.40x" in lines["tok"]
    assert "every round: yes); beyond off 200-400 us" in lines["tok"]
    assert (
        "ratio 1.20-1.60x" in lines["on"] and "every round: NO); beyond off 400-600" in lines["on"]
    )


@pytest.mark.parametrize("shared", [False, True])
async def test_the_conversations_system_prompts_are_their_own_or_one(shared: bool) -> None:
    """`drive`: each conversation opens with a system prompt of its own, or with
    `--shared-system` all of them with the same one."""
    seen: list[list[dict]] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append((await request.json())["messages"])
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    async with TestServer(app) as server:
        args = argparse.Namespace(
            requests=8, sessions=4, words=5, fixed_order=True, shared_system=shared
        )
        assert await drive([str(server.make_url("")).rstrip("/")], args, seed=1) == 8
    assert len(seen) == 8 and all(m[0]["role"] == "system" for m in seen)
    assert len({m[0]["content"] for m in seen}) == (1 if shared else 4)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_tiny_run_measures_every_mode() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "loadtests", "router-tokens", "--requests", "8",
         "--sessions", "4", "--words", "30", "--rounds", "1", "--aa", "--idle", "1",
         "--cache-tokens", "12345"],
        capture_output=True, text=True, timeout=220,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "round 0 (8 requests each" in out.stdout
    # the worker's own /metrics: its pool is `--cache-tokens`, and what it computed a turn
    # (4 new ~45-token system prompts and their first turns, over 2 turns of 4 chats)
    computed = re.search(r"the worker computed (\d+) prompt tokens a turn beyond its cache "
                         r"\(KV pool 12,345 tokens\)", out.stdout)  # fmt: skip
    assert computed and 20 < int(computed[1]) < 200, out.stdout
    for mode in ("tok", "on", "off2"):
        assert any(line.strip().startswith(mode) and "ratio" in line
                   for line in out.stdout.splitlines()), out.stdout  # fmt: skip
    # `--idle`: the idle rates, then every mode's ratio again without them
    _, idle = out.stdout.split("\nidle CPU over 1 s, ms a second: ")
    assert all(f"{mode} " in idle.splitlines()[0] for mode in ("off", "tok", "on", "off2"))
    assert sum("ratio" in line for line in idle.splitlines()) == 3, idle


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("command", "arms", "same"),
    [
        ("kv-score", "on - tok", "decisions and predictions"),
        ("chat-ids", "tok - off", "ids and keys"),
    ],
)
def test_the_in_process_benches_compare_two_trees(command: str, arms: str, same: str) -> None:
    """`kv-score` and `chat-ids` (one driver, `compare_arms`): each side's cost a request
    and, with `--before-ref`, after / before and whether both sides gave the same digest."""
    out = subprocess.run(
        [sys.executable, "-m", "loadtests", command, "--rounds", "1", "--requests", "8",
         "--sessions", "4", "--words", "30", "--repeats", "1", "--before-ref", "HEAD"],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert sum(f", {arms} " in line and "(medians of 1)" in line for line in lines) == 2, lines
    assert f"{arms}, after / before: " in out.stdout
    assert lines[-1] == f"same {same}: yes"
