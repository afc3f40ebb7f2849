"""Scoring with the exact index beside the tree: what a worker holds, plus what is on its way.

The tree (router/policy/tree.py) records what this router sent each worker, when; the index
(router/fleet/kv_feed.py) what each worker reports holding. For a worker whose index is
trusted, its predicted match for a request is

    max(longest run of its held blocks,  its tree match over entries used in the last
        `kv_events_inflight` seconds)

The second term is the tree's in-flight prediction: a follow-up that arrives while the
first turn is still queued or prefilling finds nothing in the index yet (events alone
lost 13 points of hit rate at overload in the simulator, issue 26). Older tree entries
of a trusted worker are ignored: the index says what became of them (evicted, flushed).
A worker that is not trusted (stale epoch, lagging, no events) keeps its tree match; a
rebuilding one (events lost, router/fleet/kv_feed.py) keeps it and adds its index's.

`correct` returns the tree's match path in the same shape (holders, end in chars, root
side first) so the policies' rules run unchanged; index tokens become chars at the
request's own chars-per-token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from shared.prompt_tokens import PromptTokens
from shared.protocol import ChatCompletionRequest, CompletionRequest, GenerateWireRequest

Path = list[tuple[Mapping[object, float], int]]


class BlockHolders(Protocol):
    """What scoring reads of the KV-event feed (router/fleet/kv_feed.py's KvEventFeed)."""

    @property
    def streams(self) -> Mapping[str, object]: ...
    def trusted(self, wid: str) -> bool: ...
    def only_model(self) -> str: ...
    def match(self, model: str, tokens: Sequence[int]) -> dict[str, int]: ...


class KvScorer:
    def __init__(self, feed: BlockHolders, inflight: float) -> None:
        self.feed = feed
        self.inflight = inflight
        self.corrected = 0  # requests where the index changed the prediction

    def correct(
        self, path: Path, tokens: Sequence[int], model: str, text_len: int, now: float
    ) -> Path:
        feed = self.feed
        if not feed.streams or not len(tokens):
            return path
        held = feed.match(model or feed.only_model(), tokens)
        trusted = feed.trusted
        cutoff = now - self.inflight
        best: dict[object, float] = {}
        changed = bool(held)
        for holders, end in path:  # root side first: deeper ends overwrite
            for w, used in holders.items():
                if used < cutoff and trusted(w):  # type: ignore[arg-type]
                    changed = True
                    continue
                best[w] = end
        if not changed:
            return path
        self.corrected += 1
        scale = text_len / len(tokens)
        for w, n in held.items():
            chars = min(text_len, round(n * scale))
            if chars > best.get(w, 0):
                best[w] = chars
        ends = sorted(set(best.values()))
        return [({w: now for w, e in best.items() if e >= end}, int(end)) for end in ends]


def request_tokens(tokens: PromptTokens | None, parsed: object) -> Sequence[int] | None:
    """The prompt ids the worker will compute for a parsed request (None: unknown).

    Token-id prompts are used as they are; text is encoded, chats rendered with the
    model's template first (shared/prompt_tokens.py). A template that refuses the
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
