"""A request's class: how urgently it wants its first token. Both services read it
from the same two body fields, so the router's queue and the worker's engine agree.

- OpenAI's `service_tier`: `priority` → interactive, `default` or `auto` → standard,
  `flex` → batch. Anything else is a 400 naming the field.
- vLLM's integer `priority` (lower runs earlier): below 0 → interactive, 0 → standard,
  above 0 → batch. Not an integer (a bool, "1", 1.5) is a 400 naming the field.

`service_tier` names the class where both are given; the engine's integer is the
request's own `priority` where given, else its class's (`PRIORITY`). The router orders
its queue by class (router/queue/); the worker's scheduler orders its waiting requests
by that integer, then by its longest-prefix rule (worker/engine/admission.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from shared.serving.errors import APIError

ServiceClass = Literal["interactive", "standard", "batch"]
CLASSES: tuple[ServiceClass, ...] = ("interactive", "standard", "batch")  # most urgent first
PRIORITY: dict[ServiceClass, int] = {"interactive": -1, "standard": 0, "batch": 1}
TIERS: dict[str, ServiceClass] = {
    "priority": "interactive",
    "default": "standard",
    "auto": "standard",
    "flex": "batch",
}
# vLLM's priority is a Python int; a bound keeps a 4,000-digit one out of comparisons.
PRIORITY_LIMIT = 1 << 31


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def request_class(body: Mapping[str, object]) -> tuple[ServiceClass, int]:
    """(class, engine priority) of a request body; APIError 400 naming a bad field."""
    priority = body.get("priority")
    if priority is not None:
        if type(priority) is not int:
            raise _bad("priority", "must be an integer (lower runs earlier)")
        if not -PRIORITY_LIMIT < priority < PRIORITY_LIMIT:
            raise _bad("priority", f"must lie within ±{PRIORITY_LIMIT}")
    tier = body.get("service_tier")
    if tier is not None:
        klass = TIERS.get(tier) if isinstance(tier, str) else None
        if klass is None:
            raise _bad("service_tier", f"must be one of {', '.join(TIERS)}")
    elif priority is not None:
        klass = "interactive" if priority < 0 else "standard" if priority == 0 else "batch"
    else:
        klass = "standard"
    return klass, (PRIORITY[klass] if priority is None else priority)


def with_priority(body: bytes, priority: int) -> bytes:
    """A JSON object body with `"priority": priority` added as its first key (the body
    must not have one: no parse, one copy; an attached vLLM reads it)."""
    head = body.lstrip()
    if not head.startswith(b"{"):
        raise ValueError("the body is not a JSON object")
    rest = head[1:].lstrip()
    sep = b"" if rest.startswith(b"}") else b", "
    return b'{"priority": %d%s' % (priority, sep) + rest
