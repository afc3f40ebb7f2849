"""Scoring with the exact index beside the tree: what a worker holds, plus what is on its way.

The tree (router/holdings/tree.py) records what this router sent each worker, when; the index
(router/holdings/kv_feed.py) what each worker reports holding. For a worker whose index is
trusted, its predicted match for a request is

    max(longest run of its held blocks,  its tree match over entries used in the last
        `kv_events_inflight` seconds)

The second term is the tree's in-flight prediction: a follow-up that arrives while the
first turn is still queued or prefilling finds nothing in the index yet (events alone
lost 13 points of hit rate at overload in the simulator, issue 26). Older tree entries
of a trusted worker are ignored: the index says what became of them (evicted, flushed).
A worker that is not trusted (stale epoch, lagging, no events) keeps its tree match; a
rebuilding one (events lost, router/holdings/kv_feed.py) keeps it and adds its index's.

An entry in the window is past, not present, once the index has seen the worker lose
the first block it claims beyond what the index holds *after* the entry's route: its
blocks arrived and were evicted since. Otherwise a group replicated on two workers kept
going to the one that had evicted it, every route there a full miss that re-prefilled
it (3 of 9 extra full misses in a logged shared_prefix run: the index held the group on
w3 only, w2's entry was 0.4-0.6 s old; loadtests/results/kv_events.md).

One unit for both: the index counts whole blocks (it cannot see a block's partial tail),
the tree exact lengths. Where the index still holds every whole block of a trusted
worker's older tree entry, that entry is confirmed and keeps its exact end: otherwise a
holder seen only through the index ranked up to a block short of one routed to in the
last `kv_events_inflight` seconds for the same prefix (1,040 vs 1,042 tokens at 16-token
blocks), so cache_aware's best-holder set and cost_aware's hold lost it whatever its
load. With the index agreeing, the path is the tree's own (loadtests/results/kv_events.md,
"Why cost_aware fell below the tree").

A worker the tree's routes overflowed in the last `kv_events_inflight` seconds (an insert
pushed its entries over its cap, the capacity it reports) is about to evict: the
prefills on their way store that many new blocks, and its engine evicts its least
recently used ones first, i.e. what the index holds but no recent route touched. Its
index match then counts only as far as its tree entry (which the tree trims by the same
LRU rule). Otherwise a burst of turns sent a small pool prefixes the index saw there an
instant before, while the same burst's other prefills evicted them: in the live
capacities case 7 follow-up turns went to a 7,500-token worker within 0.1 s, 3 of them
as index hits, and all 7 missed (loadtests/results/kv_events.md, "Why capacities lost").

Tiers: the index says which of a worker's held blocks sit on its device and which only
on its host tier (KV events' medium "CPU"). A host-held token is loaded, not computed:
cheaper than a miss, dearer than a device hit. It counts as `host_weight(w)` of a token
(0..1): the share of its prefill the worker saves by loading it,

    1 - (kv_bytes_per_token / host_load_bytes_per_s) / prefill_us_per_token

from the worker's heartbeat (the sim's defaults: 128 KiB over 25 GB/s = 5.2 µs against
100 µs of prefill: 0.95), `HOST_HIT_WEIGHT` where it reports no load figures, or the
`kv_events_host_weight` key for every worker. The held run becomes
device tokens + host_weight × host tokens, so `cache_aware` and `cost_aware` both see a
host-held prefix as a shorter match than the same prefix on a device. Whether an entry
is confirmed or lost is judged on blocks held in any tier (a demoted block is held).

`correct` returns the tree's match path in the same shape (holders, end in chars, root
side first) so the policies' rules run unchanged; index tokens become chars at the
request's own chars-per-token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from shared.tokens.prompt_tokens import PromptTokens
from shared.wire.protocol import ChatCompletionRequest, CompletionRequest, GenerateWireRequest
from shared.wire.registry import WorkerRecord

Path = list[tuple[Mapping[object, float], int]]

# A host-held token's worth against a device-held one when the worker reports no host
# load figures: between a miss (0) and a hit (1); the measured CPU engine loads ~100x
# faster than it prefills, a GPU worker ~6-20x (loadtests/results/host_tier.md), so any
# real figure is above this; unknown, the router only prefers a device copy.
HOST_HIT_WEIGHT = 0.5
_MAX_US = 1e6  # a figure above 1 s a token is garbage: heartbeats are untrusted


def host_hit_weight(report: WorkerRecord | None, prefill_us_default: float) -> float:
    """The share of a token's prefill that loading it from `report`'s host tier saves."""
    if report is None:
        return HOST_HIT_WEIGHT
    rate, size = report.host_load_bytes_per_s, report.kv_bytes_per_token
    prefill = report.prefill_us_per_token
    if not _number(prefill, _MAX_US) or prefill <= 0:
        prefill = prefill_us_default
    if not (_number(rate, 1e15) and rate > 0 and _number(size, 1e9) and size > 0):
        return HOST_HIT_WEIGHT
    return max(0.0, 1.0 - size / rate * 1e6 / prefill)


def _number(value: object, high: float) -> bool:
    return isinstance(value, int | float) and 0 <= value <= high  # NaN fails both


def _any_weight(_wid: str) -> float:
    return HOST_HIT_WEIGHT


class BlockHolders(Protocol):
    """What scoring reads of the KV-event feed (router/holdings/kv_feed.py's KvEventFeed)."""

    @property
    def streams(self) -> Mapping[str, object]: ...
    def trusted(self, wid: str) -> bool: ...
    def only_model(self) -> str: ...
    def lost_at(self, model: str, tokens: Sequence[int], wid: str, held: int) -> float: ...
    def block_size(self, model: str) -> int: ...
    def match_tiers(self, model: str, tokens: Sequence[int]) -> dict[str, tuple[int, int]]: ...


class KvScorer:
    def __init__(
        self,
        feed: BlockHolders,
        inflight: float,
        host_weight: Callable[[str], float] = _any_weight,
    ) -> None:
        self.feed = feed
        self.inflight = inflight
        self.host_weight = host_weight  # worker id -> a host-held token's worth (0..1)
        self.corrected = 0  # requests where the index changed the prediction

    def correct(
        self,
        path: Path,
        tokens: Sequence[int],
        model: str,
        text_len: int,
        now: float,
        overflowed_at: Callable[[object], float] | None = None,
    ) -> Path:
        feed = self.feed
        if not feed.streams or not len(tokens):
            return path
        model = model or feed.only_model()
        tiers = feed.match_tiers(model, tokens)  # (on the device, in any tier)
        held = {w: n for w, (_, n) in tiers.items()}
        trusted = feed.trusted
        cutoff = now - self.inflight
        best: dict[object, float] = {}
        past: dict[object, int] = {}  # trusted workers' older entries: the deepest end
        fresh: dict[object, int] = {}  # ... in the window: the deepest end
        changed = bool(held)
        for holders, end in path:  # root side first: deeper ends overwrite
            for w, used in holders.items():
                if trusted(w):  # type: ignore[arg-type]
                    if used < cutoff:
                        past[w] = end
                        changed = True
                        continue
                    fresh[w] = end
                best[w] = end
        if not changed:
            return path
        self.corrected += 1
        scale = text_len / len(tokens)
        block = feed.block_size(model)
        for w, end in fresh.items():
            n = held.get(w, 0)  # type: ignore[call-overload]
            whole = int(end / scale) // block * block if block else 0
            if n >= whole:
                continue
            # The route that claimed the first block the index does not hold: the last
            # one through the tree node holding that block's first token.
            at = n * scale
            routed = next(h[w] for h, e in path if e > at and w in h)
            if feed.lost_at(model, tokens, w, n) > routed:  # type: ignore[arg-type]
                del best[w]  # arrived and evicted since: the index says what is left
        weight = self.host_weight
        for w, n in held.items():
            device = tiers[w][0]
            # A host-held tail is loaded, worth less than a device hit: its chars from
            # `device` on count at the worker's host weight.
            on_host = 1.0 if n == device else weight(w)  # type: ignore[arg-type]
            chars = min(text_len, round((device + on_host * (n - device)) * scale))
            end = past.get(w, 0)
            whole = int(end / scale) // block * block if block else 0  # its whole blocks
            if whole and n >= whole:  # the index confirms the older entry: its exact end
                start = min(end, device * scale)
                chars = max(chars, round(start + on_host * (end - start)))
            if overflowed_at is not None and trusted(w) and overflowed_at(w) >= cutoff:  # type: ignore[arg-type]
                chars = min(chars, max(end, fresh.get(w, 0)))  # evicting: the tree's LRU
            if chars > best.get(w, 0):
                best[w] = chars
        ends = sorted(set(best.values()))
        return [({w: now for w, e in best.items() if e >= end}, int(end)) for end in ends]


def request_tokens(tokens: PromptTokens | None, parsed: object) -> Sequence[int] | None:
    """The prompt ids the worker will compute for a parsed request (None: unknown).

    Token-id prompts are used as they are; text is encoded, chats rendered with the
    model's template first (shared/tokens/prompt_tokens.py). A template that refuses the
    messages leaves the request to the tree (the worker answers the error)."""
    if isinstance(parsed, CompletionRequest):
        text = parsed.prompt_text()
        if text is None:
            return parsed.prompt_ids()
        return tokens.text(text) if tokens is not None else None
    if isinstance(parsed, GenerateWireRequest):
        if parsed.input_ids is not None:
            return list(parsed.input_ids)
        return tokens.text(parsed.text) if tokens is not None and parsed.text else None
    if tokens is None or not isinstance(parsed, ChatCompletionRequest):
        return None
    messages = [{"role": m.role, "content": m.text()} for m in parsed.messages]
    try:
        return tokens.chat(messages, parsed.add_generation_prompt)
    except Exception:  # a template error is the worker's to report, in its own words
        return None
