"""Prompt handling every engine front shares: request → token ids, chat template, count.

A template that is missing or refuses the messages raises ValueError in the tokenizer;
every engine turns that into the same 400 (`EngineError` on `messages`), here.
"""

from __future__ import annotations

from typing import Any, Protocol

from worker.engine.types import EngineError, EngineRequest


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


class ChatPrompts:
    """Mixin for engines that tokenize with `self.tokenizer` as is (sim): prompt
    ids for a request plus the `count_tokens` / `apply_chat_template` half of the
    Engine protocol. (The radix engine strips a doubled BOS and checks id types, so it
    keeps its own `encode_prompt`.)"""

    tokenizer: PromptTokenizer

    def prompt_ids(self, request: EngineRequest) -> list[int]:
        """The request's prompt as token ids: text encoded, ids range-checked, never empty."""
        if request.prompt is not None:
            ids = self.tokenizer.encode(request.prompt)
        else:
            ids = [int(t) for t in request.prompt_token_ids or ()]
            vocab = self.tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise EngineError(f"token ids must be in [0, {vocab})", param="prompt")
        if not ids:
            raise EngineError("prompt is empty", param="prompt")
        return ids

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        return render_chat(self.tokenizer, messages, add_generation_prompt)
