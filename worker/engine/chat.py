"""The chat template, rendered with the engine's tokenizer.

A template that is missing or refuses the messages raises ValueError in the tokenizer;
it becomes a 400 (`EngineError` on `messages`), here.
"""

from __future__ import annotations

from typing import Any

from worker.engine.protocols import EngineTokenizer
from worker.engine.types import EngineError


def render_chat(
    tokenizer: EngineTokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except ValueError as exc:  # no template, or the template refused the messages
        raise EngineError(str(exc), param="messages") from exc
