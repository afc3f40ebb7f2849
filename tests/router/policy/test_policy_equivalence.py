"""The fast cache_aware path makes exactly the decisions of the rule written plainly.

``Reference`` is the routing rule of router/policy/cache_aware.py's docstring in its most direct
form (a per-worker dict of match lengths from ``PrefixTree.match``, Python loops over
the fleet): the shape the fast path replaced. Both replay the same random requests and
load changes with the same seeded randomness, over a plain list of ``WorkerView`` and
over a ``FleetView``; every decision must agree (worker, reason, predicted match).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from router.holdings.tree import PrefixTree
from router.policy import build_routing
from router.policy.base import Decision, FleetView, RouteRequest, WorkerView
from shared.config import RouterConfig


class Reference:
    def __init__(self, cfg: RouterConfig, rng: random.Random) -> None:
        self.cfg, self.rng, self.tree = cfg, rng, PrefixTree[str]()

    def least(self, ws: list[WorkerView]) -> WorkerView:
        low = min(w.load for w in ws)
        tied = [w for w in ws if w.load == low]
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)

    def select(self, text: str, ws: list[WorkerView], now: float) -> Decision:
        cfg, matches = self.cfg, self.tree.match(text)
        loads = [w.load for w in ws]
        chosen, reason = None, ""
        if cfg.balance_mode == "fleet":
            hi, lo = max(loads), min(loads)
            if hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo:
                chosen, reason = self.least(ws), "balance"
        if chosen is None:
            threshold = cfg.cache_threshold * len(text)
            best_len = max(matches.get(w.worker_id, 0) for w in ws)
            if best_len <= threshold:
                if cfg.no_match == "least_load":
                    chosen = self.least(ws)
                else:
                    small = min(self.tree.tenant_size(w.worker_id) for w in ws)
                    chosen = self.least(
                        [w for w in ws if self.tree.tenant_size(w.worker_id) == small]
                    )
                reason = "no_match"
            else:
                chosen = self.least([w for w in ws if matches.get(w.worker_id, 0) == best_len])
                reason = "cache_hit"
                mean = sum(loads) / len(loads)

                def over(w: WorkerView) -> bool:
                    return (
                        w.load > mean * cfg.balance_rel_threshold
                        and w.load > mean + cfg.balance_abs_threshold
                    )

                if cfg.balance_mode == "per_request" and over(chosen):
                    ok = [w for w in ws if matches.get(w.worker_id, 0) > threshold and not over(w)]
                    chosen, reason = self.least(ok or ws), "spill"
        self.tree.insert(text, chosen.worker_id, now)
        m = matches.get(chosen.worker_id, 0)
        return Decision(chosen.worker_id, reason, m, m / len(text))


def _stream(seed: int, n: int) -> list[tuple[str, list[tuple[int, int]]]]:
    rng = random.Random(seed)
    systems = ["".join(rng.choices("abcd", k=rng.randint(20, 60))) for _ in range(6)]
    out = []
    for _ in range(300):
        text = rng.choice(systems)[: rng.randint(5, 60)] + "".join(
            rng.choices("abcd", k=rng.randint(1, 30))
        )
        changes = [
            (rng.randrange(n), rng.choice((0, 1, 2, 3, 5, 40, 90)))
            for _ in range(rng.randint(0, 3))
        ]
        out.append((text, changes))
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "keys",
    [
        {},
        {"no_match": "smallest_tree"},
        {"balance_mode": "per_request", "balance_abs_threshold": 4},
        {"balance_abs_threshold": 8, "cache_threshold": 0.5, "no_match": "smallest_tree"},
    ],
)
def test_fast_path_matches_the_plain_rule(seed: int, keys: dict[str, object]) -> None:
    n = 6
    cfg = RouterConfig(**keys)  # type: ignore[arg-type]
    ref = Reference(cfg, random.Random(seed))
    on_list = build_routing(cfg, random.Random(seed))
    on_columns = build_routing(cfg, random.Random(seed))
    ids = [f"w{i}" for i in range(n)]
    views = [WorkerView(w, 0) for w in ids]
    columns = FleetView(ids)
    for step, (text, changes) in enumerate(_stream(seed, n)):
        for i, load in changes:
            views[i] = WorkerView(ids[i], load)
            columns.loads[i] = load
        want = ref.select(text, views, float(step))
        assert on_list.select(RouteRequest(text), views, float(step)) == want
        assert on_columns.select(RouteRequest(text), columns, float(step)) == want


def test_fleet_view_is_a_sequence_of_views_and_follows_a_changed_fleet() -> None:
    columns = FleetView(["a", "b"], [3, 1], (100, 0))
    assert list(columns) == [WorkerView("a", 3, 100), WorkerView("b", 1, 0)]
    assert len(columns) == 2 and columns[1] == WorkerView("b", 1, 0)
    with pytest.raises(ValueError, match="one entry per worker"):
        FleetView(["a"], [1, 2])
    p = build_routing(RouterConfig(tree_chars_per_token=1.0), random.Random(0))
    p.holdings.observe("a", "z" * 500, now=0)
    p.holdings.observe("a", "x" * 50, now=1)
    # a's capacity (100 tokens × 1 char) applies first: the older z-run goes, x stays.
    assert p.select(RouteRequest("x" * 60), columns, 2).worker_id == "a"
    assert p.holdings.worker_stats()["a"]["tree_chars"] == 60
    # A new fleet (new ids tuple): positions are rebuilt, "a" is gone from routing.
    moved: Sequence[WorkerView] = FleetView(["c", "b"], [0, 0])
    assert p.select(RouteRequest("x" * 60), moved, 3).reason == "no_match"
