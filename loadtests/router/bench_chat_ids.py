"""A chat's prompt ids from its body, in process: what `tok` reads beyond `off`.

    python -m loadtests chat-ids [--rounds 2] [--repeats 5] [--tokenizer sim|DIR]
                                 [--before-ref REF] [--instructions]

`router-tokens`' conversations (16 chats of a ~700-word system prompt, a question a turn,
the sim worker's 4-token answers: `worker/backends/sim_model.py`), turn by turn, a
warm-up round and `--rounds` more, each round new chats. Every request's JSON body is
decoded as the router decodes it (not timed), then read two ways, alternating request by
request, so a busy neighbour slows both alike:

- `off`: the handler's reading without a tokenizer (router/http/handlers.py): the hand
  check and the routing text (`plain_extra`, `chat_text`);
- `tok`: its reading with one: the hand check, the chat's prompt ids from the
  tokenizer's caches (`request_tokens`, router/http/tokenize.py) and their tree key.

The cost is `tok - off` a request. `--before-ref REF` runs the same in the code of that
git ref (loadtests/kit.py), sides alternating per repeat, each in its own process; both
must give the same ids and keys (a digest of every request's tree key and block keys,
compared). `--instructions` counts instructions instead of timing (valgrind's callgrind,
inside one arm's calls: exact where a shared machine's timings swing; a run an arm a
side). The collector is off in the timed calls (the router's passes are rare:
shared/serving/gc_policy.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from loadtests.kit import ROOT, checkout, short

# Runs in the side's own tree. With `count` set, that arm's calls are made through
# `functools.reduce`: the C function callgrind's `--toggle-collect` counts inside.
SIDE = r"""
import functools, gc, hashlib, json, random, sys, time
from loadtests.load.workloads import NATO_WORDS as WORDS
from router.http.tokenize import ChatPrompt, request_tokens
from shared.serving.body import parse_json_object
from shared.serving.gc_policy import freeze_startup
from shared.tokens.prompt_tokens import PromptTokens, encode_prompt
from shared.tokens.text_tokenizer import TextTokenizer
from shared.wire.plain_body import chat_text, plain_extra
from worker.backends.sim_model import answer_ids

try:  # the handler's reading of a chat to tokenize (since the thirteenth pass)
    from shared.wire.plain_body import plain_chat
except ImportError:  # before it: the check, and the turns built in `request_tokens`
    plain_chat = None

a = json.loads(sys.argv[1])
tokens = PromptTokens.load(a["tokenizer"])
# The worker's tokenizer writes its answers, as text the next turn renders.
engine = TextTokenizer() if a["tokenizer"] == "sim" else tokens.tokenizer


def off(body):
    extra = plain_extra("chat", body)
    return chat_text(body["messages"]), extra


def tok(body):
    if plain_chat is None:
        extra, turns = plain_extra("chat", body), body["messages"]
    else:
        extra, turns = plain_chat(body)
    prompt = ChatPrompt(turns, body.get("add_generation_prompt") is not False)
    ids = request_tokens(tokens, prompt)
    return ids, ids.tree_key(), extra


def route(_, call):
    return call()


def counted(call, body):
    return functools.reduce(route, (lambda: call(body),), None)


def plain(call, body):
    return call(body)


freeze_startup()
gc.disable()
pc = time.perf_counter
spent = {"off": 0.0, "tok": 0.0}
timed = 0
digest = hashlib.sha256()
for round_ in range(a["rounds"] + 1):  # round 0: the warm-up
    rng = random.Random(100 + round_)
    chats = [[{"role": "system", "content": f"Chat {s}. " +
               " ".join(rng.choice(WORDS) for _ in range(a["words"]))}]
             for s in range(a["sessions"])]
    via = {arm: counted if round_ and a["count"] == arm else plain for arm in spent}
    for turn in range(a["requests"] // a["sessions"]):
        for chat in chats:
            chat.append({"role": "user", "content": f"Turn {turn}: {rng.choice(WORDS)}?"})
            body = parse_json_object(json.dumps({"messages": chat, "max_tokens": 4}).encode())
            t0 = pc()
            via["off"](off, body)
            t1 = pc()
            ids, key, _ = via["tok"](tok, body)
            t2 = pc()
            if round_:
                spent["off"] += t1 - t0
                spent["tok"] += t2 - t1
                timed += 1
            digest.update(key.encode("latin-1"))
            digest.update(repr(ids.block_keys(16)).encode())
            flat = encode_prompt(engine, engine.apply_chat_template(chat, True))
            chat.append({"role": "assistant",
                         "content": engine.decode(answer_ids(engine, flat, 4))})
print(json.dumps({"off_us": spent["off"] / timed * 1e6, "tok_us": spent["tok"] / timed * 1e6,
                  "requests": timed, "digest": digest.hexdigest()[:16]}))
"""

CALLGRIND = [
    "valgrind",
    "--tool=callgrind",
    "--collect-atstart=no",
    "--toggle-collect=functools_reduce",
]


def side(tree: Path, args: argparse.Namespace, count: str = "") -> dict:
    """One run of SIDE in `tree`; with `count` ("off" or "tok"), under callgrind,
    counting the instructions of that arm's calls (`ir`: a request)."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONHASHSEED="0")
    spec = {k: getattr(args, k) for k in ("rounds", "requests", "sessions", "words", "tokenizer")}
    cmd = [sys.executable, "-c", SIDE, json.dumps(spec | {"count": count})]
    with tempfile.TemporaryDirectory() as tmp:
        outfile = Path(tmp) / "callgrind.out"
        if count:
            cmd = [*CALLGRIND, f"--callgrind-out-file={outfile}", *cmd]
        out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
        result: dict = json.loads(out.stdout)
        if count:
            total = re.search(r"^totals: (\d+)", outfile.read_text(), re.M)
            assert total is not None, "no callgrind totals"
            result["ir"] = int(total.group(1)) / result["requests"]
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=2, help="rounds timed, after a warm-up one")
    p.add_argument("--requests", type=int, default=320, help="per round")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--words", type=int, default=700, help="system prompt words (~2k tokens)")
    p.add_argument("--tokenizer", default="sim", help="sim, or a tokenizer folder")
    p.add_argument("--repeats", type=int, default=5, help="per side, alternating")
    p.add_argument("--before-ref", default="", help="also run the code of this git ref")
    p.add_argument("--instructions", action="store_true",
                   help="count instructions (callgrind) instead of timing")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    with checkout(args.before_ref or "HEAD") as before:
        sides = {"this tree": ROOT}
        if args.before_ref:
            sides = {f"@{short(args.before_ref)}": before, "this tree": ROOT}
        runs: dict[str, list[dict]] = {s: [] for s in sides}
        costs = {}
        if args.instructions:
            for name, tree in sides.items():
                off, tok = side(tree, args, "off"), side(tree, args, "tok")
                runs[name] += [off, tok]
                costs[name] = tok["ir"] - off["ir"]
                print(f"{name:12s} instructions a request: tok {tok['ir']:,.0f}, "
                      f"off {off['ir']:,.0f}, tok - off {costs[name]:,.0f}", flush=True)  # fmt: skip
        for _ in range(0 if args.instructions else args.repeats):
            for name, tree in sides.items():
                runs[name].append(side(tree, args))
        for name, got in runs.items():
            if args.instructions:
                continue
            mid = len(got) // 2
            diffs = sorted(g["tok_us"] - g["off_us"] for g in got)
            toks = sorted(g["tok_us"] for g in got)
            offs = sorted(g["off_us"] for g in got)
            costs[name] = diffs[mid]
            print(f"{name:12s} a request (medians of {len(got)}): tok {toks[mid]:.1f} us, "
                  f"off {offs[mid]:.1f} us, tok - off {diffs[mid]:.1f} us "
                  f"(min {diffs[0]:.1f}, max {diffs[-1]:.1f})")  # fmt: skip
        if len(sides) == 2:
            a, b = costs.values()
            print(f"tok - off, after / before: {b / a:.2f}x")
            digests = {g["digest"] for got in runs.values() for g in got}
            same = len(digests) == 1
            print(f"same ids and keys: {'yes' if same else 'NO'}")
            return 0 if same else 1
    return 0
