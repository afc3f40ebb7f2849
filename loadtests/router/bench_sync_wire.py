"""Replica sync entries, text vs prompt ids: bytes on the wire and a replica's CPU per entry.

    python -m loadtests.router.bench_sync_wire [--sessions 16] [--turns 20] [--words 700] [--rounds 3]

Routers share each routing decision through Redis (router/holdings/sync.py): the routed text
where the tree keys on text, the prompt ids (uint32 + zlib, with the tokenizer's
fingerprint) where it keys on tokens. The same multi-turn chats as
`bench_router_tokens` (a ~700-word system prompt, ~2k tokens, one user line a turn) are
turned into decisions both ways, in process:

- size: bytes of the stream field (what Redis stores and every replica reads), against
  the raw key (UTF-8 text, or 4 bytes an id);
- publish: the writer's CPU per entry (encode + compress: on the request's path);
- apply: the reader's CPU per entry, through the real `DecisionSync._apply` into the real
  `cache_aware` policy's tree (decode, validate, insert): what a replica pays for every
  other replica's decision. No Redis round trip is timed (the same for both).

The two arms run in alternating rounds on one machine; `time.process_time` per round.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import numpy as np
from redis.asyncio import Redis

from loadtests.load.workloads import NATO_WORDS as WORDS
from router.holdings.sync import DecisionSync
from router.policy import build_routing
from shared.config import RouterConfig
from shared.tokens.fingerprint import tokenizer_fingerprint
from shared.tokens.prompt_tokens import PromptTokens
from shared.wire.protocol import ChatCompletionRequest, canonical_chat_text
from shared.wire.registry import Registry


def chats(args: argparse.Namespace) -> list[list[dict[str, str]]]:
    """Every request of every conversation, in arrival order (turn by turn)."""
    rng = random.Random(7)
    convs = [[{"role": "system", "content": f"Chat {s}. " +
               " ".join(rng.choice(WORDS) for _ in range(args.words))}]
             for s in range(args.sessions)]  # fmt: skip
    out = []
    for turn in range(args.turns):
        for chat in convs:
            chat.append({"role": "user", "content": f"Turn {turn}: {rng.choice(WORDS)}?"})
            out.append([dict(m) for m in chat])
            chat.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=12))})
    return out


def make_sync(config: RouterConfig, fingerprint: str | None) -> tuple[DecisionSync, Any]:
    policy = build_routing(config, random.Random(1))
    redis = Redis.from_url("redis://127.0.0.1:1")  # never connected: nothing is sent
    sync = DecisionSync(
        redis, Registry(redis, "bench:"), config, policy.holdings.observe, dict, fingerprint=fingerprint,
    )  # fmt: skip
    return sync, policy


def run_arm(
    keys: list[Any], config: RouterConfig, fp: str | None
) -> tuple[list[bytes], float, float]:
    """(entries, publish CPU s, apply CPU s) for one arm."""
    writer, _ = make_sync(config, fp)
    t0 = time.process_time()
    for i, key in enumerate(keys):
        writer.publish(f"w{i % 4}", key)
    publish = time.process_time() - t0
    entries = list(writer._pending)
    reader, policy = make_sync(config, fp)
    stream = [(f"{i + 1}-0".encode(), {b"d": e}) for i, e in enumerate(entries)]
    t0 = time.process_time()
    reader._apply(stream, include_own=False)
    apply = time.process_time() - t0
    assert reader.applied == len(entries), (reader.applied, reader.skipped)
    assert policy.holdings.worker_stats(), "nothing reached the tree"
    return entries, publish, apply


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--words", type=int, default=700, help="system prompt words (~2k tokens)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    requests = chats(args)
    tokens = PromptTokens.load("sim")
    fp = tokenizer_fingerprint(tokens.tokenizer)
    texts = [canonical_chat_text(ChatCompletionRequest.model_validate({"messages": m}).messages)
             for m in requests]  # fmt: skip
    ids = [tokens.chat(m) for m in requests]
    arms = {
        "text": (texts, RouterConfig(sync=True), None),
        "tokens": (ids, RouterConfig(sync=True, tokenizer="sim"), fp),
    }
    raw = {"text": [len(t.encode()) for t in texts], "tokens": [4 * len(i) for i in ids]}
    units = {"text": np.mean([len(t) for t in texts]), "tokens": np.mean([len(i) for i in ids])}
    sizes: dict[str, list[int]] = {}
    cpu: dict[str, dict[str, list[float]]] = {a: {"publish": [], "apply": []} for a in arms}
    for _ in range(args.rounds):
        for arm, (keys, config, arm_fp) in arms.items():  # alternating, side by side
            entries, publish, apply = run_arm(keys, config, arm_fp)
            sizes[arm] = [len(e) for e in entries]
            cpu[arm]["publish"].append(publish / len(keys) * 1e6)
            cpu[arm]["apply"].append(apply / len(keys) * 1e6)
    n = len(requests)
    print(f"{n} decisions ({args.sessions} chats x {args.turns} turns), {args.rounds} rounds")
    print(
        "| key | mean key length | raw bytes (mean) | entry bytes mean / p50 / max "
        "| publish µs/entry best / mean | apply µs/entry best / mean |"
    )
    print("|---|---|---|---|---|---|")
    for arm in arms:
        s, c = sizes[arm], cpu[arm]
        unit = "chars" if arm == "text" else "ids"
        print(f"| {arm} | {units[arm]:,.0f} {unit} | {statistics.mean(raw[arm]):,.0f} "
              f"| {statistics.mean(s):,.0f} / {statistics.median(s):,.0f} / {max(s):,} "
              f"| {min(c['publish']):.1f} / {statistics.mean(c['publish']):.1f} "
              f"| {min(c['apply']):.1f} / {statistics.mean(c['apply']):.1f} |")  # fmt: skip
    t, k = cpu["text"], cpu["tokens"]
    print(f"tokens / text: entry bytes {statistics.mean(sizes['tokens']) / statistics.mean(sizes['text']):.2f}x, "
          f"publish {statistics.mean(k['publish']) / statistics.mean(t['publish']):.2f}x, "
          f"apply {statistics.mean(k['apply']) / statistics.mean(t['apply']):.2f}x (means)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
