"""The router's tokenizer, bounded: a request's prompt ids without stalling the event loop.

Any API key holder can send a prompt up to the body cap (16 MB). Tokenized on the event
loop, three concurrent 10 MB prompts stalled `/health` for 29.7 s and held 2.3 GB after
(issue 30), and the worker refused them for length anyway. So:

- **A cap before the work.** A prompt of more than `max_chars` = the workers' context
  length × MAX_CHARS_PER_TOKEN characters is not tokenized: no real tokenizer averages
  16 characters a token over a whole prompt (English BPE about 4, code about 3), so it
  almost surely does not fit. It is routed on the first `max_chars` characters of its
  text (the tree), and the worker answers it as it answers any over-long prompt (vLLM's
  and our engine's 400 naming the model's context length). A prompt of more than
  `refuse_chars` = context length × the tokenizer's longest token (in characters) cannot
  fit whatever its text: the router answers it itself, 400 `context_length_exceeded`
  naming both figures, as vLLM would, and the fleet never sees it.
- **Off the event loop.** Prompts of more than `inline_chars` characters are tokenized on
  one worker thread (PromptTokens' caches are not shared between threads: the thread
  holds a lock, and a short prompt is tokenized inline only when the lock is free). At
  most `max_waiting` requests wait for the thread; more are routed on text alone
  (`skipped["busy"]`).

Short prompts (the usual turn: 8,000 characters tokenize in well under a millisecond
from the caches) stay inline, so the router's CPU per request does not change.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from shared.serving.errors import APIError
from shared.tokens.prompt_tokens import PromptTokens
from shared.tokens.tokenizer import Tokenizer
from shared.wire.plain_body import chat_turns
from shared.wire.protocol import ChatCompletionRequest, CompletionRequest, GenerateWireRequest

MAX_CHARS_PER_TOKEN = 16  # the stated bound (see the module doc)
DEFAULT_CONTEXT_TOKENS = 131_072  # no context length in the config or the model folder
INLINE_CHARS = 32_768  # tokenized on the event loop up to this many characters
MAX_WAITING = 8  # requests waiting for the tokenizer thread
LATER: Any = object()  # `Tokenizing.now`'s answer: the ids are made on the thread (`later`)


class ChatPrompt:
    """A chat's prompt: its turns as the template reads them (`chat_turns` of a body its
    model takes as sent, shared/wire/plain_body.py: the hand check's `plain_chat` or
    `request_prompt` below) and whether the template adds the generation prompt."""

    __slots__ = ("add_generation_prompt", "turns")

    def __init__(self, turns: list[dict[str, Any]], add_generation_prompt: bool) -> None:
        self.turns = turns
        self.add_generation_prompt = add_generation_prompt


# What a request's prompt ids come from: a text to encode, ids as they are, a chat.
Prompt = str | list[int] | ChatPrompt


def request_prompt(parsed: object, body: dict[str, Any]) -> Prompt | None:
    """The prompt of `body`, which its request model took as `parsed` (a chat's
    messages are the body's own: strict, the model holds them as sent)."""
    if isinstance(parsed, ChatCompletionRequest):
        return ChatPrompt(chat_turns(body["messages"]), parsed.add_generation_prompt)
    if isinstance(parsed, CompletionRequest):
        text = parsed.prompt_text()
        return text if text is not None else parsed.prompt_ids()
    if isinstance(parsed, GenerateWireRequest):
        return list(parsed.input_ids) if parsed.input_ids is not None else parsed.text
    return None


def request_tokens(tokens: PromptTokens, prompt: Prompt | None) -> Sequence[int] | None:
    """The prompt ids the worker will compute for a request's prompt (None: unknown).

    Token-id prompts are used as they are; text is encoded, chats rendered with the
    model's template first (shared/tokens/prompt_tokens.py). A template that refuses the
    messages leaves the request to the tree (the worker answers the error)."""
    kind = type(prompt)
    if kind is str:
        return tokens.text(prompt)  # type: ignore[arg-type]
    if kind is not ChatPrompt:
        return prompt  # type: ignore[return-value]  # ids, or None
    try:
        return tokens.chat(prompt.turns, prompt.add_generation_prompt)  # type: ignore[union-attr]
    except Exception:  # a template error is the worker's to report, in its own words
        return None


class Tokenizing:
    """`now(prompt, chars)`, then `later(prompt)` where it answers LATER: a request's
    prompt ids, or None (routed on its text)."""

    def __init__(
        self,
        tokens: PromptTokens,
        context_tokens: int,
        inline_chars: int = INLINE_CHARS,
        max_waiting: int = MAX_WAITING,
    ) -> None:
        self.tokens = tokens
        self.context_tokens = context_tokens
        self.max_chars = context_tokens * MAX_CHARS_PER_TOKEN
        longest = (
            tokens.tokenizer.longest_token_chars()
            if isinstance(tokens.tokenizer, Tokenizer)
            else None  # the sim tokenizer: no vocabulary to bound by
        )
        self.longest_token_chars = longest
        self.refuse_chars = context_tokens * longest if longest else None
        self.inline_chars = inline_chars
        # A chat body of at most this many bytes is under every bound above whatever its
        # text: its canonical text (shared/wire/protocol.py) is shorter than the JSON it
        # came from (each char of a content is at least a byte of its JSON string, and a
        # message's `<|role|>` and newline are fewer than its `"role":""`), so the
        # handler checks the bounds on the body's length and need not render the text.
        self.quick_chars = min(inline_chars, self.max_chars, self.refuse_chars or self.max_chars)
        self.max_waiting = max_waiting
        self.skipped: Counter[str] = Counter()  # "too_long", "busy"
        self._lock = threading.Lock()
        self._waiting = 0
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    def now(self, prompt: Prompt | None, chars: int) -> Sequence[int] | None:
        """The prompt ids of `prompt`, whose routing text has `chars` characters, made
        on the event loop; None: routed on its text; LATER: to be made on the thread
        (`later`). APIError 400 when it cannot fit the context (see the module doc). Not
        a coroutine: the usual prompt is tokenized inline, and a coroutine a request
        would cost its frame and its await for nothing."""
        if self.refuse_chars is not None and chars > self.refuse_chars:
            self.skipped["refused"] += 1
            raise APIError(
                400,
                f"the prompt has {chars} characters; this model's context length is "
                f"{self.context_tokens} tokens, and no token of its tokenizer stands for "
                f"more than {self.longest_token_chars} characters",
                param="messages" if type(prompt) is ChatPrompt else "prompt",
                code="context_length_exceeded",
            )
        if chars > self.max_chars:
            self.skipped["too_long"] += 1
            return None
        if chars <= self.inline_chars and self._lock.acquire(blocking=False):
            try:
                return request_tokens(self.tokens, prompt)
            finally:
                self._lock.release()
        if self._waiting >= self.max_waiting:
            self.skipped["busy"] += 1
            return None
        return LATER

    async def later(self, prompt: Prompt | None) -> Sequence[int] | None:
        """The prompt ids `now` left to the thread (it answered LATER: call this at once,
        with no await between, so that at most `max_waiting` wait)."""
        self._waiting += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._thread, self._locked, prompt)
        finally:
            self._waiting -= 1

    def _locked(self, prompt: Prompt | None) -> Sequence[int] | None:
        with self._lock:
            return request_tokens(self.tokens, prompt)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def context_tokens(configured: int | None, tokenizer: str) -> int:
    """The workers' context length: the config's, else the model folder's
    (`max_position_embeddings` in config.json), else DEFAULT_CONTEXT_TOKENS."""
    if configured:
        return configured
    try:
        data = json.loads(Path(tokenizer, "config.json").read_text())
        value = data.get("max_position_embeddings") if isinstance(data, dict) else None
    except (OSError, ValueError):
        value = None
    if isinstance(value, int) and 0 < value <= 10_000_000:
        return value
    return DEFAULT_CONTEXT_TOKENS
