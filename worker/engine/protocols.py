"""What `LLMEngine` needs of its three collaborators, so a reader (and a type checker)
follows a request through them: the runner that owns every tensor, the sampler that
picks each next token, and the tokenizer. The torch implementations live in
`worker/engine/runtime/` (`ModelRunner`, `TorchSampler`) and `shared/tokens/tokenizer.py`
(`Tokenizer`, shared/tokens/tokenizer.py); the sim engine's in `worker/backends/` (`CostModelRunner`,
`SimSampler`, `TextTokenizer`); tests pass fakes of each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from worker.engine.batch import BatchItem
from worker.engine.req import Detokenizer, Req
from worker.engine.types import TokenLogprob


class ModelShape(Protocol):
    """What the engine reads of the model's configuration."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...


class Runner(Protocol):
    """Runs a step's items on the model and keeps their KV (`capacity` slots)."""

    @property
    def config(self) -> ModelShape: ...

    @property
    def capacity(self) -> int: ...

    def forward(self, batch: list[BatchItem]) -> Any:
        """The logits of the items that `sample`, in batch order (a tensor; None in sim)."""
        ...

    def release(self, seq_id: int) -> None:
        """The request `seq_id` finished or was preempted: forget its slot table."""
        ...


class Sampler(Protocol):
    """Picks each sampled request's next token from its logits row."""

    def sample(self, logits: Any, reqs: list[Req]) -> list[tuple[int, TokenLogprob | None]]: ...

    def release(self, seq_id: int) -> None: ...


class EngineTokenizer(Protocol):
    """Text ⇄ token ids, and the chat template."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def detokenizer(self, skip_special_tokens: bool = True) -> Detokenizer: ...

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...
