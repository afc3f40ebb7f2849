"""How each inference endpoint renders engine outputs: OpenAI completions and chat
(any number of choices, with logprobs in OpenAI's two shapes) and SGLang's `/generate`.

A request with `n` choices streams their outputs interleaved (each carries its
`index`); usage counts the prompt once and the completion tokens of every choice.
Log-probabilities come from the engine as token ids; `token_bytes` gives each token's
raw UTF-8 bytes. A byte-level BPE token may hold only part of a character (the three
bytes of '€' can be three tokens), so, as in OpenAI's and vLLM's answers:

- chat entries carry `bytes` = the token's raw bytes (joined over consecutive tokens
  they rebuild the character) and `token` = those bytes decoded with U+FFFD for a
  partial character;
- completions carry the same `token` strings, so `"".join(tokens)` equals `text` only
  when no character is split; what always holds is that the bytes of all tokens,
  decoded, give `text` (invalid bytes as U+FFFD), except that a trailing incomplete
  character at a length stop is withheld from `text`. `text_offset[k]` is the index in
  `text` (counting the echoed prompt) of the character holding token k's first byte:
  the length of the text the tokens before it complete, so the tokens of one split
  character share the offset of that character.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.wire import openai_responses as wire
from worker.engine.types import GenerateOutput, TokenLogprob
from worker.http.streaming import DeltaEvents, Event

TokenBytes = Callable[[list[int]], list[bytes]]


@dataclass
class Choice:
    """One choice of a whole (non-streamed) answer, accumulated."""

    index: int
    parts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, out: GenerateOutput) -> None:
        self.parts.append(out.text_delta)
        self.ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.finish_reason = out.finish_reason


class Tally:
    """Usage over every choice: the prompt once, every choice's completion tokens."""

    def __init__(self) -> None:
        self.prompt = self.cached = 0
        self._completion: dict[int, int] = {}
        # The pin this answer leaves (worker/engine/pins.py), reported in usage as
        # `cache_pin`: {"ttl_s": granted, "requested_ttl_s": asked, "clamped": bool}.
        self.pin: dict[str, Any] | None = None

    def add(self, out: GenerateOutput) -> None:
        self.prompt = out.prompt_tokens
        if out.index == 0:
            self.cached = out.cached_tokens
        self._completion[out.index] = out.completion_tokens

    def usage(self) -> dict[str, Any]:
        usage = wire.usage(self.prompt, sum(self._completion.values()), self.cached)
        if self.pin is not None:
            usage["cache_pin"] = self.pin
        return usage


class Format(Protocol):
    def body(self, choices: list[Choice], tally: Tally) -> dict[str, Any]: ...
    def chunks(self, out: GenerateOutput, first: bool) -> list[Event]: ...
    def usage_chunk(self, tally: Tally) -> dict[str, Any] | None: ...


def _raw_bytes(lps: list[TokenLogprob], token_bytes: TokenBytes) -> dict[int, bytes]:
    """token id -> raw bytes, for every sampled and top-alternative token of `lps`."""
    ids = list(dict.fromkeys([lp.token_id for lp in lps] + [t for lp in lps for t, _ in lp.top]))
    return dict(zip(ids, token_bytes(ids), strict=True))


def _shown(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def _chat_logprobs(lps: list[TokenLogprob], token_bytes: TokenBytes) -> dict[str, Any] | None:
    if not lps:
        return None
    raw = _raw_bytes(lps, token_bytes)

    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": _shown(raw[token]), "logprob": logprob, "bytes": list(raw[token])}

    content = [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in lps
    ]
    return {"content": content}


class TextOffsets:
    """One choice's `text_offset` counter: the characters its tokens' bytes complete so
    far (an incremental UTF-8 decoder holds a partial character back, as the engine's
    detokenizer does for `text`), starting after the echoed prompt. A special token
    (skipped from `text`) still counts its bytes, so offsets after one mid-text are
    ahead by its length; the usual one, the eos token, ends the text."""

    def __init__(self, start: int) -> None:
        self.chars = start
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, raw: bytes) -> int:
        """The offset of a token with these bytes; advances past what it completes."""
        at = self.chars
        self.chars += len(self._utf8.decode(raw))
        return at


def _completion_logprobs(
    lps: list[TokenLogprob], token_bytes: TokenBytes, offsets: TextOffsets
) -> dict[str, Any] | None:
    if not lps:
        return None
    raw = _raw_bytes(lps, token_bytes)
    return {
        "tokens": [_shown(raw[lp.token_id]) for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{_shown(raw[t]): v for t, v in lp.top} for lp in lps],
        "text_offset": [offsets.take(raw[lp.token_id]) for lp in lps],
    }


class CompletionFormat:
    def __init__(
        self, rid: str, model: str, echo: str, include_usage: bool, token_bytes: TokenBytes
    ) -> None:
        self.rid, self.model, self.created = rid, model, int(time.time())
        self.echo, self.include_usage, self.token_bytes = echo, include_usage, token_bytes
        self._offsets: dict[int, TextOffsets] = {}  # per choice, across its chunks
        self._plain = DeltaEvents(
            lambda i, text: wire.envelope(
                "text_completion", rid, model, self.created, [wire.choice(i, {"text": text}, None)]
            )
        )

    def _choice(self, index: int, text: str, lps: list[TokenLogprob], finish: str | None) -> dict:
        offsets = self._offsets.setdefault(index, TextOffsets(len(self.echo)))
        logprobs = _completion_logprobs(lps, self.token_bytes, offsets)
        return wire.choice(index, {"text": text}, finish, logprobs)

    def body(self, choices: list[Choice], tally: Tally) -> dict[str, Any]:
        out = [
            self._choice(c.index, self.echo + c.text, c.logprobs, c.finish_reason) for c in choices
        ]
        return wire.envelope(
            "text_completion", self.rid, self.model, self.created, out, tally.usage()
        )

    def chunks(self, out: GenerateOutput, first: bool) -> list[Event]:
        text = (self.echo if first else "") + out.text_delta
        if not out.finished and not out.logprobs:
            return [self._plain.event(out.index, text)] if text else []
        choice = self._choice(out.index, text, list(out.logprobs), out.finish_reason)
        return [wire.envelope("text_completion", self.rid, self.model, self.created, [choice])]

    def usage_chunk(self, tally: Tally) -> dict[str, Any] | None:
        if not self.include_usage:
            return None
        return wire.usage_chunk(
            "text_completion", self.rid, self.model, self.created, tally.usage()
        )


class ChatFormat:
    def __init__(self, rid: str, model: str, include_usage: bool, token_bytes: TokenBytes) -> None:
        self.rid, self.model, self.created = rid, model, int(time.time())
        self.include_usage, self.token_bytes = include_usage, token_bytes
        self._plain = DeltaEvents(lambda i, text: self._chunk(i, {"content": text}))

    def body(self, choices: list[Choice], tally: Tally) -> dict[str, Any]:
        out = [
            wire.choice(
                c.index, {"message": {"role": "assistant", "content": c.text}}, c.finish_reason,
                _chat_logprobs(c.logprobs, self.token_bytes),
            )
            for c in choices
        ]  # fmt: skip
        return wire.envelope(
            "chat.completion", self.rid, self.model, self.created, out, tally.usage()
        )

    def chunks(self, out: GenerateOutput, first: bool) -> list[Event]:
        chunks: list[Event] = []
        if first:
            chunks.append(self._chunk(out.index, {"role": "assistant", "content": ""}))
        if out.text_delta and not out.finished and not out.logprobs:
            chunks.append(self._plain.event(out.index, out.text_delta))
        elif out.text_delta or out.finished or out.logprobs:
            delta = {"content": out.text_delta} if out.text_delta else {}
            lps = _chat_logprobs(list(out.logprobs), self.token_bytes)
            chunks.append(self._chunk(out.index, delta, out.finish_reason, lps))
        return chunks

    def _chunk(self, index: int, delta: dict, finish: str | None = None, lps: Any = None) -> dict:
        choice = wire.choice(index, {"delta": delta}, finish, lps)
        return wire.envelope("chat.completion.chunk", self.rid, self.model, self.created, [choice])

    def usage_chunk(self, tally: Tally) -> dict[str, Any] | None:
        if not self.include_usage:
            return None
        obj = "chat.completion.chunk"
        return wire.usage_chunk(obj, self.rid, self.model, self.created, tally.usage())


class SGLangFormat:
    """SGLang's `/generate` (n = 1), streamed incrementally (as SGLang does with
    `--incremental-streaming-output`): each chunk holds only the new text and token ids,
    with `meta_info`. The cumulative form resent the whole text every chunk: 8k tokens
    sent 271 MB."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.ids: list[int] = []  # token ids not sent yet (their text is still partial)

    def body(self, choices: list[Choice], tally: Tally) -> dict[str, Any]:
        c = choices[0]
        return {
            "text": c.text,
            "output_ids": c.ids,
            "meta_info": self._meta(c.finish_reason, tally),
        }

    def chunks(self, out: GenerateOutput, first: bool) -> list[Event]:
        self.ids.extend(out.token_ids)
        if not out.text_delta and not out.finished:
            return []
        ids, self.ids = self.ids, []
        tally = Tally()
        tally.add(out)
        return [
            {
                "text": out.text_delta,
                "output_ids": ids,
                "meta_info": self._meta(out.finish_reason, tally),
            }
        ]

    def _meta(self, finish: str | None, tally: Tally) -> dict[str, Any]:
        use = tally.usage()
        return {
            "id": self.rid,
            "prompt_tokens": use["prompt_tokens"],
            "completion_tokens": use["completion_tokens"],
            "cached_tokens": tally.cached,
            "finish_reason": {"type": finish} if finish else None,
        }

    def usage_chunk(self, tally: Tally) -> dict[str, Any] | None:
        return None
