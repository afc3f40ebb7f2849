"""The engine's public vocabulary: what a request asks for and what comes back.

Every backend (`radix`, `sim`) speaks these types, so the HTTP layer never
knows which engine it fronts. Pure data: no torch, no aiohttp, no Redis.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

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


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        if self.max_tokens <= 0:
            raise EngineError("max_tokens must be at least 1", param="max_tokens")
        if self.temperature < 0:
            raise EngineError("temperature must be >= 0", param="temperature")
        if not 0 < self.top_p <= 1:
            raise EngineError("top_p must be in (0, 1]", param="top_p")
        if self.top_k == 0 or self.top_k < -1:
            raise EngineError("top_k must be -1 (off) or >= 1", param="top_k")


@dataclass(frozen=True)
class GenerateRequest:
    """One generation. Exactly one of `prompt` (text) or `prompt_token_ids` is set."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)


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
    finished: bool = False
    finish_reason: FinishReason | None = None
    # Seconds the request waited before the scheduler admitted it (None until admitted).
    queue_seconds: float | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for heartbeats and /metrics."""

    running: int
    waiting: int
    cache_capacity_tokens: int
    cache_used_tokens: int
    prompt_tokens_total: int
    cached_tokens_total: int
    completion_tokens_total: int
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


class Engine(Protocol):
    """What the worker's HTTP layer needs from a backend."""

    model_name: str
    max_model_len: int

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Stream outputs; closing the iterator early (client gone) aborts the request
        and frees everything it held."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def flush_cache(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def count_tokens(self, text: str) -> int: ...

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> str: ...
