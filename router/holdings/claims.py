"""Believe a worker's predicted hits only as far as its answers bear them out.

The rule (`unconfirmed_claims`): each answer carries `cached_tokens`, the prefix the
worker really reused, beside the tokens the room predicted it held. Per worker the room
keeps both sums, each halving every `HALF_LIFE_S` seconds. Once there is evidence
(predictions of at least `MIN_TOKENS` over at least `MIN_ANSWERS` answers) and less than
`BELIEVED` of the predicted tokens came true, the worker's predicted holdings count at
the share that did (confirmed / predicted); otherwise in full.

Why: a worker can pre-claim, in its KV events, a prefix nobody holds yet, and draw that
prefix's traffic: 20 of 20 requests in the adversarial review (issue 30, finding 5).
Its answers then report 0 cached tokens, and after `MIN_ANSWERS` of them its claims count
for nothing until the evidence decays below `MIN_TOKENS`; an honest worker's predictions come true (predicted / actual 1.00 measured,
loadtests/results/kv_events.md), and a miss now and then (an eviction racing a route)
stays far above `BELIEVED`. The sums decay, so a worker that lied once is believed
again within minutes and must lie again to draw traffic, one answer at a time.
"""

from __future__ import annotations

from collections.abc import Mapping

HALF_LIFE_S = 60.0
MIN_TOKENS = 256  # less predicted than this says nothing either way
MIN_ANSWERS = 2.5  # three answers within a half-life (the sums decay meanwhile)
BELIEVED = 0.5  # a worker whose predictions come true at least this often is believed


class Claims:
    """Per worker: decayed (predicted tokens, confirmed tokens, answers), as of when."""

    def __init__(self) -> None:
        self._sums: dict[str, tuple[float, float, float, float]] = {}
        # Workers believed only in part, and the share: the room's predictions read this
        # (empty for an honest fleet: no work per request).
        self.discounted: dict[str, float] = {}

    def answered(self, worker_id: str, predicted: float, cached: int, now: float) -> None:
        """One answer: `predicted` tokens the room said it held, `cached` it reused."""
        if predicted <= 0:
            return  # no claim to check
        # Every answer's: written without `get`, `max`, `min` and `pop` calls.
        sums, discounted = self._sums, self.discounted
        if worker_id in sums:
            claimed, confirmed, answers, at = sums[worker_id]
            elapsed = now - at
            keep = 0.5 ** (elapsed / HALF_LIFE_S) if elapsed > 0.0 else 1.0
        else:
            claimed, confirmed, answers, keep = 0.0, 0.0, 0.0, 1.0
        came_true = cached if cached > 0 else 0  # clamped to [0, predicted]
        claimed = claimed * keep + predicted
        confirmed = confirmed * keep + (came_true if came_true <= predicted else predicted)
        answers = answers * keep + 1.0
        sums[worker_id] = (claimed, confirmed, answers, now)
        share = confirmed / claimed
        # To be discounted takes MIN_ANSWERS answers; to stay, the tokens' evidence.
        enough = answers >= MIN_ANSWERS or worker_id in discounted
        if claimed >= MIN_TOKENS and enough and share < BELIEVED:
            discounted[worker_id] = share
        elif worker_id in discounted:
            del discounted[worker_id]

    def refresh(self, now: float) -> None:
        """Let decayed evidence lapse: a discounted worker whose predicted tokens have
        decayed below `MIN_TOKENS` is believed again (after some minutes: 3,000 tokens
        of empty claims take 3.5 at a 60 s half-life)."""
        for wid in list(self.discounted):
            claimed, _, _, at = self._sums[wid]
            if claimed * 0.5 ** (max(0.0, now - at) / HALF_LIFE_S) < MIN_TOKENS:
                del self.discounted[wid]

    def believed(self, worker_id: str) -> float:
        """The share of the worker's predicted hits that counts (1.0: all of them)."""
        return self.discounted.get(worker_id, 1.0)

    def forget(self, worker_id: str) -> None:
        self._sums.pop(worker_id, None)
        self.discounted.pop(worker_id, None)


def unconfirmed_claims(
    path: list[tuple[Mapping[object, float], int]], shares: Mapping[str, float], now: float
) -> list[tuple[Mapping[object, float], int]]:
    """`path` with each discounted worker's holding scaled by its share (see the module
    docstring); the others' unchanged."""
    best: dict[object, float] = {}
    for held, end in path:
        for w in held:
            best[w] = end
    changed = False
    for w, share in shares.items():
        if w in best:
            best[w] = int(best[w] * share)
            changed = True
    if not changed:
        return path
    ends = sorted({e for e in best.values() if e > 0})
    return [({w: now for w, e in best.items() if e >= end}, int(end)) for end in ends]
