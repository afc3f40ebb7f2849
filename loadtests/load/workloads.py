"""Workloads for LLM load tests: what each simulated user sends, deterministic by seed.

Four shapes, each the traffic whose speed depends on prefix reuse:

- `shared_prefix` (SGLang's "generated shared prefix"): `groups` system prompts of
  `system_len` words, `prompts_per_group` questions of `question_len` words each,
  all (group, question) pairs shuffled once by seed; with `group_zipf` > 0 the groups
  are drawn Zipf-like instead (a few hot prefixes).
- `multi_turn`: `conversations` chats of `turns` turns; a user keeps its conversation
  and sends it back with the reply and a new question, so every turn extends the last.
- `rag`: a pool of `docs` documents of `doc_len` words; each of `rag_requests`
  requests cites `docs_per_request` of them, drawn Zipf-like so popular ones repeat.
- `mooncake`: replay of a Mooncake trace. Each 512-token block id becomes
  `block_words` words from a generator seeded by the id, so equal ids give equal text.

One word of the generated vocabulary is meant to be about one token. Requests are
plain data (`LLMRequest`); a `Session` hands them to one user, one at a time.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from loadtests.kit import WorkloadOptions

# A fixed vocabulary of short pronounceable words: deterministic, no data files needed.
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
VOCAB: tuple[str, ...] = tuple(a + b for a, b in itertools.product(_SYLLABLES, repeat=2) if a != b)


# Real words for the benchmarks whose prompts a real tokenizer reads (issue 26's).
NATO_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
              "india", "juliet", "kilo", "lima", "mike")  # fmt: skip


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(VOCAB, k=n))


def text_of(rng: random.Random, chars: int, vocab: Sequence[str] = VOCAB) -> str:
    """Random words of `vocab` until the text is at least `chars` long (the last one whole)."""
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(vocab)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


@dataclass(frozen=True)
class LLMRequest:
    """One request as plain data. `messages` for chat, `prompt` for completions."""

    max_tokens: int
    messages: tuple[tuple[str, str], ...] = ()  # (role, content)
    prompt: str | None = None
    arrival_s: float | None = None  # offset from the start of the run; None: right away
    session_id: str = ""
    tag: str = ""  # group / conversation / trace line, for per-request records

    @property
    def endpoint(self) -> Literal["chat", "completions"]:
        return "completions" if self.prompt is not None else "chat"

    def body(self, model: str, stream: bool) -> dict[str, object]:
        body: dict[str, object] = {
            "model": model,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,  # outputs of the requested length: a fixed decode cost
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.prompt is not None:
            body["prompt"] = self.prompt
        else:
            body["messages"] = [{"role": r, "content": c} for r, c in self.messages]
        return body

    def text(self) -> str:
        """The text a router would route on (same shape as shared.wire.protocol's canonical text)."""
        if self.prompt is not None:
            return self.prompt
        return "".join(f"<|{r}|>{c}\n" for r, c in self.messages)


class Session(Protocol):
    def next_request(self) -> LLMRequest | None:
        """The next request, or None once the workload is exhausted."""

    def on_reply(self, request: LLMRequest, reply_text: str) -> None:
        """Called with the generated text of a finished request."""


class _StreamSession:
    """A user that takes requests from one iterator shared by all users."""

    def __init__(self, source: Iterator[LLMRequest]) -> None:
        self._source = source

    def next_request(self) -> LLMRequest | None:
        return next(self._source, None)

    def on_reply(self, request: LLMRequest, reply_text: str) -> None:
        pass


class Workload:
    """Builds sessions for users. Open-loop shapes share one request stream."""

    def __init__(self, options: WorkloadOptions) -> None:
        self.options = options
        self._conv_ids = itertools.count()
        self._stream: Iterator[LLMRequest] | None = None
        if options.workload != "multi_turn":
            self._stream = self._cycle(self.requests())

    @property
    def closed_loop(self) -> bool:
        return self.options.workload == "multi_turn"

    def _cycle(self, reqs: list[LLMRequest]) -> Iterator[LLMRequest]:
        rounds = itertools.count() if self.options.loop else range(1)
        return (r for _ in rounds for r in reqs)

    def new_session(self) -> Session:
        if self._stream is not None:
            return _StreamSession(self._stream)
        return ConversationSession(self)

    def next_conversation(self) -> int | None:
        n = next(self._conv_ids)
        if n >= self.options.conversations and not self.options.loop:
            return None
        return n % self.options.conversations

    def requests(self) -> list[LLMRequest]:
        """All requests of an open-loop workload, in send order."""
        o = self.options
        if o.workload == "shared_prefix":
            return shared_prefix(o)
        if o.workload == "rag":
            return rag(o)
        if o.workload == "mooncake":
            return mooncake(o)
        raise ValueError(f"{o.workload} is closed-loop: use sessions")


class ConversationSession:
    """Keeps one conversation at a time; the next turn carries the whole history."""

    def __init__(self, workload: Workload) -> None:
        self._workload = workload
        self._conv: int | None = None
        self._messages: list[tuple[str, str]] = []
        self._rng = random.Random()

    def _start(self) -> bool:
        conv = self._workload.next_conversation()
        if conv is None:
            return False
        o = self._workload.options
        self._conv = conv
        self._rng = random.Random(f"{o.seed}:conv:{conv}")
        # One system prompt for the whole fleet of conversations: the part every user shares.
        system = words(random.Random(f"{o.seed}:system"), o.system_len)
        self._messages = [("system", system)] if o.system_len else []
        return True

    def next_request(self) -> LLMRequest | None:
        o = self._workload.options
        turn = sum(1 for r, _ in self._messages if r == "user")
        if (self._conv is None or turn >= o.turns) and not self._start():
            return None
        self._messages.append(("user", words(self._rng, o.question_len)))
        return LLMRequest(
            max_tokens=o.output_len,
            messages=tuple(self._messages),
            session_id=f"conv-{self._conv}",
            tag=f"conv-{self._conv}",
        )

    def on_reply(self, request: LLMRequest, reply_text: str) -> None:
        self._messages.append(("assistant", reply_text))


def shared_prefix(o: WorkloadOptions) -> list[LLMRequest]:
    rng = random.Random(f"{o.seed}:shared_prefix")
    systems = [words(rng, o.system_len) for _ in range(o.groups)]
    picks = [g for g in range(o.groups) for _ in range(o.prompts_per_group)]
    if o.group_zipf > 0:  # hot prefixes: group g drawn with weight 1 / (g + 1)^zipf
        weights = [1.0 / (g + 1) ** o.group_zipf for g in range(o.groups)]
        picks = random.Random(f"{o.seed}:group_zipf").choices(
            range(o.groups), weights, k=len(picks)
        )
    reqs = [
        LLMRequest(
            max_tokens=o.output_len,
            messages=(("system", systems[g]), ("user", words(rng, o.question_len))),
            session_id=f"group-{g}",
            tag=f"group-{g}",
        )
        for g in picks
    ]
    rng.shuffle(reqs)
    return reqs


def rag(o: WorkloadOptions) -> list[LLMRequest]:
    rng = random.Random(f"{o.seed}:rag")
    docs = [words(rng, o.doc_len) for _ in range(o.docs)]
    # Zipf weights: a few documents are cited by many questions (the reuse a cache exploits).
    weights = [1.0 / (i + 1) ** o.zipf for i in range(o.docs)]
    k = min(o.docs_per_request, o.docs)
    reqs = []
    for i in range(o.rag_requests):
        picked: list[int] = []
        while len(picked) < k:
            d = rng.choices(range(o.docs), weights)[0]
            if d not in picked:
                picked.append(d)
        context = "\n\n".join(f"[doc {d}] {docs[d]}" for d in picked)
        question = words(rng, o.question_len)
        reqs.append(
            LLMRequest(
                max_tokens=o.output_len,
                messages=(
                    ("system", "Answer from the documents."),
                    ("user", f"{context}\n\nQuestion: {question}"),
                ),
                tag=f"rag-{i}",
            )
        )
    return reqs


class BlockText:
    """Deterministic words for a trace block id, cached (blocks repeat across requests)."""

    def __init__(self, seed: int, block_words: int) -> None:
        self.seed = seed
        self.block_words = block_words
        self._cache: dict[int, list[str]] = {}

    def __call__(self, block_id: int) -> list[str]:
        got = self._cache.get(block_id)
        if got is None:
            got = random.Random(self.seed * 1_000_003 + block_id).choices(VOCAB, k=self.block_words)
            self._cache[block_id] = got
        return got


def read_trace(path: str | Path, limit: int | None = None) -> list[dict[str, object]]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if not isinstance(rec.get("hash_ids"), list) or "input_length" not in rec:
                raise ValueError(
                    f"{path}:{n}: not a Mooncake trace line (needs hash_ids, input_length)"
                )
            out.append(rec)
            if limit is not None and len(out) >= limit:
                break
    return out


def mooncake(o: WorkloadOptions) -> list[LLMRequest]:
    block = BlockText(o.seed, o.block_words)
    reqs = []
    for i, rec in enumerate(read_trace(o.trace, o.trace_limit)):
        ids: list[int] = rec["hash_ids"]  # type: ignore[assignment]
        n_words = max(1, math.ceil(int(rec["input_length"]) * o.block_words / 512))
        text = [w for b in ids for w in block(b)][:n_words]
        out_len = max(1, int(rec.get("output_length", o.output_len)))  # type: ignore[call-overload]
        if o.max_output is not None:
            out_len = min(out_len, o.max_output)
        arrival = None
        if o.arrival == "trace":
            arrival = float(rec.get("timestamp", 0)) / 1000.0 / o.speedup  # type: ignore[arg-type]
        reqs.append(
            LLMRequest(
                max_tokens=out_len, prompt=" ".join(text), arrival_s=arrival, tag=f"trace-{i}"
            )
        )
    return reqs
