"""Characters per token, learned per worker from its answers (no router `tokenizer`).

Without a tokenizer the router's tree counts characters, but a worker's cache and its
capacity are in tokens. The fixed ``tree_chars_per_token`` (4.0) is only a guess: the
sim engine's tokenizer, a code-heavy workload or a non-English one can be 1-2 chars a
token, and then the tree cap is too large and every predicted token count too small
(issue 26 measured the dashboard's predicted/actual off by 2.43x on a fresh fleet).

Every answer carries ``usage.prompt_tokens``; the router knows the characters of the
text it routed on. Their ratio, smoothed per worker (an EWMA; the first good sample
replaces the default outright, so a fleet calibrates in one answer), is the worker's
chars per token. A worker's figure is only a hint: a value outside ``[LOW, HIGH]``, not
a positive integer, or from a prompt too short to tell (a chat template's own tokens
dominate it) is ignored; the out-of-bounds ones are counted on the worker, so a broken
or hostile peer shows in ``/metrics`` without steering the estimate.
"""

from __future__ import annotations

import re

from router.fleet.workers import Worker

LOW, HIGH = 0.5, 32.0  # chars per token a real tokenizer can produce on real text
MIN_CHARS = 64  # shorter prompts are mostly template tokens: no signal
WEIGHT = 0.2  # EWMA weight of a new sample (~ the last 5-10 answers)

# The last `"prompt_tokens": n` of an answer or of a stream's tail: workers put `usage`
# last. Quotes inside JSON strings are escaped, so the quoted key cannot come from text;
# `"prompt_tokens_details"` is another key (the closing quote differs).
_KEY = b'"prompt_tokens"'
_AFTER_KEY = len(_KEY)
_VALUE = re.compile(rb"\s*:\s*(-?[0-9]+(?:\.[0-9]*)?)")


def prompt_tokens_from(answer: bytes) -> float | None:
    """`usage.prompt_tokens` of a JSON body or an SSE tail, as sent (None: absent)."""
    at = answer.rfind(_KEY)
    if at < 0:
        return None
    found = _VALUE.match(answer, at + _AFTER_KEY)
    return float(found[1]) if found else None


def chars_per_token(worker: Worker, default: float) -> float:
    """The worker's learned ratio, or ``default`` until it has one."""
    return worker.chars_per_token or default


def calibrate(worker: Worker, chars: int, prompt_tokens: float | None) -> bool:
    """Fold one answer into ``worker.chars_per_token``; False when it was not used."""
    if prompt_tokens is None or chars < MIN_CHARS:
        return False
    ratio = chars / prompt_tokens if prompt_tokens > 0 else 0.0
    if prompt_tokens != int(prompt_tokens) or not LOW <= ratio <= HIGH:
        worker.calibration_rejected_total += 1
        return False
    old = worker.chars_per_token
    worker.chars_per_token = ratio if old is None else old + WEIGHT * (ratio - old)
    return True
