"""The router's feed applying a recorded KV-event stream: CPU per request, before vs after.

    python -m loadtests kv-feed [--requests 2000] [--repeats 5] [--before-ref REF] [--event-blocks N]

The stream is what one worker at capacity publishes for multi-turn chats: 16
conversations of ~2k-token prompts, each turn storing its new blocks under the previous
one, the worker's pool (`--pool-blocks`) evicting its least recently used leaves, so a
turn whose conversation was evicted stores it again. At the defaults ~17 blocks stored
and ~15 removed per request (denser than the live sim worker's ~8 / ~6.5 in
bench_router_tokens: per-block costs, on a heavier stream). It is built once, encoded
as the stream entries a worker writes (shared/wire/kv_events.py: msgpack, epoch, sequence),
and applied by `KvEventFeed.apply_entry` (parse, decode, index) in a fresh feed; then the
batches are decoded alone (`decode_batch`), timed apart. `--event-blocks N` splits each
request's events into events of at most N blocks (the live sim worker's hold ~6: more
events for the same blocks, so more of the per-event cost).

`--before-ref REF` times the same entries with the feed's code from that git ref
(loadtests/kit.py), alternating sides per repeat, each side in its own process; both
sides must leave the same index (a digest of every conversation's match_tiers and
lost_at, compared), so a faster side that answers differently fails the bench.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path

from loadtests.kit import ROOT, checkout, short

# Runs in the side's own tree (only APIs both sides have): times apply_entry, prints
# {"us": per-request microseconds per repeat, "digest": what the index answers}.
SIDE = r"""
import gc, json, pickle, sys, time
try:
    from router.holdings.kv_feed import FeedMember, KvEventFeed
except ImportError:  # refs before the holdings room (issue 30)
    from router.fleet.kv_feed import FeedMember, KvEventFeed
d = pickle.load(open(sys.argv[1], "rb"))
times, digest = [], None
for _ in range(int(sys.argv[2])):
    try:  # the block size from the heartbeat (issue 30); refs before it took the events'
        member = FeedMember("w0", "m", 1.0, 0, block_size=d.get("block_size", 16))
    except TypeError:
        member = FeedMember("w0", "m", 1.0, 0)
    feed = KvEventFeed(None, route_clock=lambda: 1.0)
    feed.follow([member])
    t0 = time.process_time()
    for fields in d["entries"]:
        feed.apply_entry("w0", fields)
    times.append((time.process_time() - t0) / d["requests"] * 1e6)
    index = feed.indexes["m"]
    digest = [[sorted(index.match_tiers(p).items()),
               [index.lost_at("w0", p, h) for h in range(0, len(p), 16 * 8)]]
              for p in d["probes"]]
try:  # the decode alone (the batches, no index): refs before the holdings room had it too
    from shared.wire.kv_events import decode_batch
except ImportError:
    decode_batch = None
# the index freed and collected first: a full collection over it (~10-20 ms) would
# otherwise land in this timing, or not, by the heap's count alone
dropped = dict(feed.dropped)
feed = index = None
gc.collect()
decode = []
for _ in range(int(sys.argv[2]) if decode_batch else 0):
    t0 = time.process_time()
    for fields in d["entries"]:
        decode_batch(fields[b"batch"])
    decode.append((time.process_time() - t0) / d["requests"] * 1e6)
print(json.dumps({"us": times, "decode_us": decode, "digest": digest, "dropped": dropped}))
"""


def record(args: argparse.Namespace) -> dict:
    """The stream entries of `--requests` chat turns on one worker at capacity."""
    from shared.wire.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        encode_batch,
        engine_block_hash,
        entry_fields,
    )  # fmt: skip

    rng = random.Random(7)
    bs = args.block_size
    chats = [[rng.randrange(1, 50_000) for _ in range(args.prompt_tokens)]
             for _ in range(args.sessions)]  # fmt: skip
    hashes: list[list[int]] = [[] for _ in chats]  # per chat, its blocks' engine hashes
    lru: OrderedDict[int, int] = OrderedDict()  # engine hash -> chat (leaves evict first)
    children: dict[int, int] = {}  # engine hash -> children held
    entries = [entry_fields("w0", 1.0, 0, encode_batch([AllBlocksCleared()], 1.0))]
    stored = removed = 0
    for r in range(args.requests):
        c = r % args.sessions
        chat, chain = chats[c], hashes[c]
        chat += [rng.randrange(1, 50_000) for _ in range(args.turn_tokens)]
        # what the worker still holds of this chat: the chain's prefix still in the pool
        held = 0
        while held < len(chain) and chain[held] in lru:
            lru.move_to_end(chain[held])
            held += 1
        del chain[held:]
        events: list = []
        parent = chain[-1] if chain else None
        new = []
        for b in range(held, len(chat) // bs):
            h = engine_block_hash(parent, bytes(str(chat[b * bs : (b + 1) * bs]), "ascii"))
            new.append(h)
            lru[h] = c
            if parent is not None:
                children[parent] = children.get(parent, 0) + 1
            parent = h
        if new:
            ids = chat[held * bs : (held + len(new)) * bs]
            parent = chain[-1] if chain else None
            step = args.event_blocks or len(new)  # the live sim worker's: ~6 a stored event
            for i in range(0, len(new), step):
                piece = tuple(new[i : i + step])
                events.append(BlockStored(piece, parent, ids[i * bs : (i + step) * bs], bs))
                parent = piece[-1]
            chain += new
            stored += len(new)
        gone = []
        for h in list(lru):  # oldest first; only leaves (no held children)
            if len(lru) - len(gone) <= args.pool_blocks:
                break
            if not children.get(h) and h not in new:
                gone.append(h)
        for h in gone:
            del lru[h]
            children.pop(h, None)
        for cc in hashes:  # fix parents' child counts
            for i, h in enumerate(cc):
                if h in gone and i:
                    children[cc[i - 1]] = children.get(cc[i - 1], 1) - 1
        step = args.event_blocks or max(len(gone), 1)
        events += [BlockRemoved(tuple(gone[i : i + step])) for i in range(0, len(gone), step)]
        removed += len(gone)
        entries.append(entry_fields("w0", 1.0, r + 1, encode_batch(events, 1.0)))
    raw = [{k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in e.items()}
           for e in entries]  # fmt: skip
    return {"entries": raw, "requests": args.requests, "probes": chats, "block_size": bs,
            "stored": stored / args.requests, "removed": removed / args.requests}  # fmt: skip


def side(tree: Path, data: str, repeats: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", SIDE, data, str(repeats)], cwd=tree, env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=2000, help="chat turns in the stream")
    p.add_argument("--sessions", type=int, default=16, help="conversations")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="first turn's prompt")
    p.add_argument("--turn-tokens", type=int, default=24, help="tokens each turn adds")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pool-blocks", type=int, default=1500, help="the worker's pool")
    p.add_argument("--event-blocks", type=int, default=0,
                   help="blocks an event at most (0: one stored and one removed event a "
                        "request; the live sim worker's events hold ~6)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=5, help="per side, alternating")
    p.add_argument("--before-ref", default="", help="also time the feed of this git ref")


def main(args: argparse.Namespace) -> int:
    d = record(args)
    print(f"stream: {args.requests} requests, {d['stored']:.1f} blocks stored and "
          f"{d['removed']:.1f} removed per request", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, checkout(args.before_ref or "HEAD") as before:
        data = str(Path(tmp) / "stream.pkl")
        Path(data).write_bytes(pickle.dumps(d))
        sides = {"this tree": ROOT}
        if args.before_ref:
            sides = {f"@{short(args.before_ref)}": before, "this tree": ROOT}
        us: dict[str, list[float]] = {s: [] for s in sides}
        decode: dict[str, list[float]] = {s: [] for s in sides}
        digests = {}
        for _ in range(args.repeats):
            for name, tree in sides.items():
                out = side(tree, data, 1)
                us[name] += out["us"]
                decode[name] += out.get("decode_us", [])
                digests[name] = json.dumps(out["digest"])
                if out["dropped"]:
                    print(f"{name}: dropped {out['dropped']}")
        for name, v in us.items():
            v.sort()
            print(f"{name:12s} apply per request: median {v[len(v) // 2]:.1f} us "
                  f"(min {v[0]:.1f}, max {v[-1]:.1f}; {len(v)} repeats)")  # fmt: skip
        for name, v in decode.items():
            v.sort()
            if v:
                print(f"{name:12s} of which decode_batch alone: median {v[len(v) // 2]:.1f} us")
        if len(sides) == 2:
            a, b = (sorted(v)[len(v) // 2] for v in us.values())
            print(f"after / before: {b / a:.2f}x (medians)")
            if all(decode.values()):
                a, b = (sorted(v)[len(v) // 2] for v in decode.values())
                print(f"decode after / before: {b / a:.2f}x (medians)")
            same = len(set(digests.values())) == 1
            print(f"same index answers: {'yes' if same else 'NO'}")
            return 0 if same else 1
    return 0
