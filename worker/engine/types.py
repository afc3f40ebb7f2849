"""The engine's public vocabulary: what a request asks for and what comes back.

Every backend (`radix`, `sim`) speaks these types, so the HTTP layer never
knows which engine it fronts. Pure data: no torch, no aiohttp, no Redis.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

FinishReason = Literal["stop", "length", "abort"]


class EngineError(ValueError):
    """A request the engine refuses (bad sampling values, prompt too long, ...).

    `param` names the offending request field so the HTTP layer can build an
    OpenAI error; `code` is a short machine-readable reason.
    """

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class EngineOverloaded(RuntimeError):
    """The engine cannot take the request now (queue full, draining): HTTP 503."""


# OpenAI's limits: at most 20 alternatives per position, biases in [-100, 100].
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1  # choices sampled from one prompt (its KV computed once)
    # OpenAI's penalties over the output so far: logit -= presence * [count > 0]
    # + frequency * count; repetition (vLLM / HF, over prompt and output): a seen
    # token's positive logit is divided by it, a negative one multiplied.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: bool = False  # the chosen token's log-probability (temperature 1)
    top_logprobs: int = 0  # and this many most likely alternatives

    def validate(self, max_n: int = 1 << 30, vocab_size: int | None = None) -> None:
        if self.max_tokens <= 0:
            raise EngineError("max_tokens must be at least 1", param="max_tokens")
        if self.temperature < 0:
            raise EngineError("temperature must be >= 0", param="temperature")
        if not 0 < self.top_p <= 1:
            raise EngineError("top_p must be in (0, 1]", param="top_p")
        if self.top_k == 0 or self.top_k < -1:
            raise EngineError("top_k must be -1 (off) or >= 1", param="top_k")
        if not 0 <= self.min_p <= 1:
            raise EngineError("min_p must be in [0, 1]", param="min_p")
        if not 1 <= self.n <= max_n:
            raise EngineError(f"n must be in [1, {max_n}] on this worker", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise EngineError(f"{name} must be in [-2, 2]", param=name)
        if not 0 < self.repetition_penalty <= 2:
            raise EngineError("repetition_penalty must be in (0, 2]", param="repetition_penalty")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise EngineError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs"
            )
        for token, bias in self.logit_bias:
            if vocab_size is not None and not 0 <= token < vocab_size:
                raise EngineError(
                    f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})",
                    param="logit_bias",
                )
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise EngineError(
                    f"logit_bias values must be in [-100, 100], got {bias}", param="logit_bias"
                )

    @property
    def needs_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def penalized(self) -> bool:
        """Any penalty on: the sampler keeps token counts for it."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability at temperature 1 and the `top` alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class EngineRequest:
    """One generation. Exactly one of `prompt` (text) or `prompt_token_ids` is set."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    # Its prefix cache namespace (vLLM's `cache_salt`): shares blocks only with the same.
    cache_salt: str | None = None
    # vLLM's: lower is admitted earlier (shared/wire/service_class.py maps the classes).
    priority: int = 0
    # The client's prompt_cache_key (logged, never scheduled on) and the pin it asks for
    # after the answer (seconds, already clamped; worker/engine/pins.py).
    cache_key: str | None = None
    pin_ttl: float = 0.0


@dataclass(frozen=True)
class GenerateOutput:
    """One streamed step: new text/tokens since the previous output.

    The last output of a request has `finished=True` and carries the final counts.
    """

    request_id: str
    text_delta: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finished: bool = False  # this choice is done (the request is when all n are)
    finish_reason: FinishReason | None = None
    index: int = 0  # the choice (0 .. n-1)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when asked for
    # Seconds the request waited before the scheduler admitted it (None until admitted).
    queue_seconds: float | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for heartbeats and /metrics."""

    running: int
    waiting: int
    kv_capacity_tokens: int
    kv_used_tokens: int
    prompt_tokens_total: int
    cached_tokens_total: int
    completion_tokens_total: int
    preemptions_total: int = 0  # running requests sent back to the queue (KV ran short)
    # For the router's cost_aware policy (predicted time to first token): prompt tokens
    # queued or still prefilling (a waiting request's whole prompt: its cache hit is only
    # known at admission) and what a prefill token / a decode step costs. 0.0: unknown.
    queued_prefill_tokens: int = 0
    prefill_us_per_token: float = 0.0
    decode_ms_per_token: float = 0.0
    # Seats: requests it runs at once (more wait for one), and how long an admitted
    # request holds its seat (a recent mean, ms). 0: unknown.
    max_running_requests: int = 0
    request_ms: float = 0.0
    # The host KV tier (0 when off): capacity and use in tokens, prompt tokens served
    # from it (part of cached_tokens_total), tokens loaded / written back, the measured
    # (or, for the sim, configured) load bandwidth and the KV bytes of one token.
    host_kv_capacity_tokens: int = 0
    host_kv_used_tokens: int = 0
    host_cached_tokens_total: int = 0
    host_load_tokens_total: int = 0
    host_write_tokens_total: int = 0
    host_load_bytes_per_s: float = 0.0
    kv_bytes_per_token: int = 0
    # Tokens per block of its KV events (0: it publishes none): the router indexes its
    # events at this size (router/holdings/kv_feed.py).
    kv_block_size: int = 0
    pins: int = 0  # prefixes pinned across tool gaps (pins.py) and their tokens
    pinned_tokens: int = 0


class OutputStream(Protocol):
    """A request's outputs (choices interleaved when n > 1; it ends once every choice has
    finished); closing it early (client gone) aborts the request and frees everything it
    held. `ready()`: the next output is there already (awaiting it will not wait)."""

    def __aiter__(self) -> OutputStream: ...

    def __anext__(self) -> Awaitable[GenerateOutput]: ...

    async def aclose(self) -> None: ...

    def ready(self) -> bool: ...


class Engine(Protocol):
    """What the worker's HTTP layer needs from a backend."""

    model_name: str
    max_model_len: int

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request: EngineRequest) -> OutputStream: ...

    async def abort(self, request_id: str) -> None: ...

    async def flush_cache(self) -> bool: ...

    async def release_pin(self, key: str) -> bool:
        """Release the pin held under a `prompt_cache_key` (worker/engine/pins.py)."""
        ...

    def stats(self) -> EngineStats: ...

    def tokenize(self, text: str) -> list[int]:
        """The prompt ids the engine would run for `text` (a rendered chat prompt is
        tokenized once, here, and sent as ids)."""
        ...

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """Each token's own raw UTF-8 bytes (for logprobs; may be part of a character)."""
        ...

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> str: ...


@dataclass(frozen=True)
class KVCopies:
    """One step's copies: write-backs (device -> host) first, then loads (host -> device).

    `write_device[i]` is copied to `write_host[i]`; `load_host[i]` to `load_device[i]`."""

    write_device: np.ndarray
    write_host: np.ndarray
    load_host: np.ndarray
    load_device: np.ndarray

    @property
    def load_tokens(self) -> int:
        return len(self.load_device)

    @property
    def write_tokens(self) -> int:
        return len(self.write_host)
