"""The chat template, rendered with the engine's tokenizer.

A template that is missing or refuses the messages raises ValueError in the tokenizer;
it becomes a 400 (`EngineError` on `messages`), here.
"""

from __future__ import annotations

from typing import Any, Protocol

from worker.engine.types import EngineError


class PromptTokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...


def render_chat(
    tokenizer: PromptTokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except ValueError as exc:  # no template, or the template refused the messages
        raise EngineError(str(exc), param="messages") from exc
