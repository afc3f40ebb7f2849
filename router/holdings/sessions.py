"""Session affinity through OpenAI's ``prompt_cache_key``: a session's calls share a worker.

A client (an agent framework) sets ``prompt_cache_key`` on every call of one session, to
say which requests share a cache. Prefix matching alone sends a session's *first* call and
its parallel siblings (fanned out from one prefix before any of them was answered) where
load sends them; the key lets the router co-locate them before any prefix is known.

The rule (``select``, which the proxy and the simulator both call), before the policy:
  1. No entry for the key (first call, or the entry aged out) → the policy decides; when
     it found no cached prefix anywhere (reason ``no_match`` or ``balance``), the worker
     is instead *rule 1's pick* (``rendezvous``): through replicas, the less loaded of
     the key's two rendezvous-hash workers among those holding the fewest active
     sessions (``SessionTable.active``: placements the replicas share); on a lone
     router, the same among the least loaded workers only. So sessions spread over the
     workers' KV and their queues, and router replicas that see a session's first
     siblings at the same instant (before the sync carries anything) still agree (5
     seeds of the churn run: hit after the first call 0.898 against 0.883 with the
     policy's pick; 0.900 through 2 replicas against 0.845-0.901 by hash and load
     alone; the least loaded first took a lone router's JCT under load from 1.06x
     today's to 1.00x: loadtests/results/agents.md). The choice is recorded *at
     decision time*, so siblings sent a moment later (still unanswered) follow it.
  2. An entry whose worker is routable and not overloaded → that worker, reason
     ``session``. Overloaded is the balance rule seen from the session's worker: its load
     exceeds the least load by more than ``balance_abs_threshold`` and is more than
     ``balance_rel_threshold`` times it. Then (or when the worker is gone) the policy
     decides and the entry moves to its choice.
  3. Except a *lost* session: the policy found no cached prefix for the call anywhere
     (reason ``no_match``: the router's tree, which follows each worker's LRU, has let
     the session's context go), no pin holds it (the last call's ``cache_pin_ttl`` has
     run out, or there was none; or it has not, but the worker is busier than the least
     loaded by more than ``PIN_YIELD`` requests (plus the table's margin) and the
     balance ratio: the router cannot tell a held pin from a refused or released one,
     and under load most are not held) and the entry is older than ``FRESH_S`` (not a
     sibling of the call that placed it). Its worker has most likely evicted the
     context too, so keeping it there only adds a re-prefill to a worker short of KV: it
     moves to rule 1's pick. Measured beside a shared-prefix neighbour: sessions held
     on full workers evicted the neighbour's prefixes there (2.1 points under its solo
     run with keys, 1.0 with the rule). Through replicas each call that asks for a pin
     shares it (router/holdings/sync.py), so every replica knows what is held, and
     rule 1's pick is one every replica makes alike (the policy's follows each
     replica's own load view: a move one replica made alone split siblings,
     0.940-0.948 co-located; 1.000 with rule 1's pick over 5 seeds).

Keys are namespaced by tenant: the table is keyed by ``sha256(namespace NUL key)``,
the namespace being the caller's tenant (config ``tenants``) or, without one, its API
key's identity (hashed, never stored; router/http/handlers.py), so one tenant cannot
steer, or learn about, another's sessions. The table holds at most ``session_table_max``
entries (least recently used dropped first) and an entry lives ``session_ttl`` seconds
after its last use. Other router replicas learn entries through replica sync
(router/holdings/sync.py): only the 16-byte digest, the worker id and the pin's TTL
travel.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Protocol

from router.fleet.view import view_columns
from router.holdings.prediction import RouteRequest
from router.holdings.sync_wire import DIGEST_BYTES, SessionEntry
from router.policy.base import Decision


def session_digest(tenant: str, key: str) -> bytes:
    """The table's key: the tenant and the client's key, hashed together (fixed size, so
    the table's memory and the sync entry are bounded whatever the client sends)."""
    h = hashlib.sha256(tenant.encode("utf-8", "replace"))
    h.update(b"\x00")
    h.update(key.encode("utf-8", "replace"))
    return h.digest()[:DIGEST_BYTES]


def tenant_of(bearer: str | None) -> str:
    """The tenant a request speaks for: its API key's identity, hashed ("" without one)."""
    if not bearer:
        return ""
    return hashlib.sha256(bearer.encode("utf-8", "replace")).hexdigest()[:16]


def overloaded(load: int, low: int, abs_threshold: float, rel_threshold: float) -> bool:
    """The balance rule (router/policy/cache_aware.py) seen from one worker."""
    return load - low > abs_threshold and load > rel_threshold * low


# Seconds an entry counts as fresh: calls within it of the one that placed or last kept
# the session are its siblings (fanned out at once), kept together whatever the tree
# says; a tool gap is longer (the agent workload's shortest is 2 s).
FRESH_S = 1.0

# A session used within this many seconds counts as active on its worker (longer than a
# tool gap: the agent workload's longest is 240 s).
ACTIVE_S = 300.0


# Requests in flight: how much less loaded the key's second worker must be to take it
# in rule 1's pick through replicas. Replicas' load views lag by what the sync has not
# carried yet (the last session's siblings, still in a stale heartbeat or load hash): a
# margin of 2 split first-call siblings across two replicas in 1 e2e run of 6, 4 in
# none of 8. The price is balance: at 96k in loadtests/results/agents.md, 2 replicas
# spent 12.6 s in calls (margin 4) against 8.5 s (margin 2) and 10.3 s for one router.
AGREE_MARGIN = 4

# A believed pin holds a lost session (rule 3) only on a worker that is not busier than
# the least loaded by more than this many requests in flight (plus the table's margin)
# and the balance rule's ratio: the router cannot tell a pin its worker holds from one
# it refused (a context over the pin budget) or released (the budget's oldest first,
# memory pressure), and a busier worker's queue costs every call sent there.
PIN_YIELD = 2


class SessionTable:
    """digest → (worker id, last use, pinned until), LRU-bounded and aged; the proxy's
    only session state. Times (`now`) never decrease: the table is kept in order of
    last use, so the active sessions are its newest entries."""

    def __init__(self, max_entries: int, ttl: float, replicas: bool = False) -> None:
        self.max_entries = max_entries
        self.ttl = ttl
        # Through replicas rule 1's pick is one they agree on without talking, and
        # loads closer than AGREE_MARGIN count as equal (their load views differ by what
        # the sync has not carried yet); a lone router picks by load strictly.
        self.agree = replicas
        self.margin = AGREE_MARGIN if replicas else 0
        self._entries: OrderedDict[bytes, tuple[str, float, float]] = OrderedDict()
        # The entries used within ACTIVE_S (oldest first) and their count per worker,
        # kept as entries come, go and age: a first call reads the counts in O(1)
        # instead of scanning the table (fresh keys make every call a first call).
        self._window: OrderedDict[bytes, str] = OrderedDict()
        self._active: dict[str, int] = {}
        self.hits = 0  # calls routed by the table
        self.moved = 0  # entries moved off an overloaded or gone worker
        self.lost = 0  # entries moved by rule 3 (a lost session)

    def __len__(self) -> int:
        return len(self._entries)

    def active(self, now: float) -> dict[str, int]:
        """Sessions per worker used within `ACTIVE_S` (workers with none left out).
        Replicas share placements, so their counts agree but for what the sync has not
        carried yet. Amortized O(1): each entry leaves the window once per use."""
        window, entries = self._window, self._entries
        while window:
            digest = next(iter(window))
            if now - entries[digest][1] <= ACTIVE_S:
                break
            self._uncount(digest)
        return dict(self._active)

    def _uncount(self, digest: bytes) -> None:
        wid = self._window.pop(digest, None)
        if wid is not None:
            left = self._active[wid] - 1
            if left:
                self._active[wid] = left
            else:
                del self._active[wid]

    def _drop(self, digest: bytes) -> None:
        del self._entries[digest]
        self._uncount(digest)

    def get(self, digest: bytes, now: float) -> str | None:
        entry = self._entries.get(digest)
        if entry is None:
            return None
        if now - entry[1] > self.ttl:
            self._drop(digest)
            return None
        return entry[0]

    def fresh(self, digest: bytes, now: float) -> bool:
        """Whether the entry was placed or kept within FRESH_S (siblings follow it)."""
        entry = self._entries.get(digest)
        return entry is not None and now - entry[1] <= FRESH_S

    def held(self, digest: bytes, now: float) -> bool:
        """Whether the session's context is still held where it is: a fresh entry
        (siblings) or a pin not yet run out (rule 3)."""
        entry = self._entries.get(digest)
        return entry is not None and (now - entry[1] <= FRESH_S or now < entry[2])

    def put(self, digest: bytes, worker_id: str, now: float, pin_ttl: float = 0.0) -> None:
        """Record the session on `worker_id` at `now`; `pin_ttl`: the call asked its
        worker to pin its context that long (``cache_pin_ttl``; the worker may clamp it)."""
        self._entries[digest] = (worker_id, now, now + pin_ttl)
        self._entries.move_to_end(digest)
        self._uncount(digest)
        self._window[digest] = worker_id
        self._active[worker_id] = self._active.get(worker_id, 0) + 1
        while len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))

    def learn(self, entry: SessionEntry, now: float) -> None:
        """Another replica placed the session, or kept it with a pin (replica sync:
        router/holdings/sync.py). A *kept* entry naming another worker than this table's
        is stale (this replica or a third moved the session since) and is ignored: taken,
        a replica's keep crossing another's move in the stream would swap the two
        replicas' workers for the session, splitting it for good."""
        if not entry.placed:
            mine = self._entries.get(entry.digest)
            if mine is not None and mine[0] != entry.worker_id:
                return
        self.put(entry.digest, entry.worker_id, now, entry.pin_ttl)

    def pick(
        self, digest: bytes, ids: Sequence[str], loads: Sequence[int], now: float,
        abs_threshold: float, rel_threshold: float,
    ) -> str | None:  # fmt: skip
        """The session's worker when rule 2 above keeps it; else None (the policy decides,
        and the caller records its choice with ``put``)."""
        wid = self.get(digest, now)
        if wid is None:
            return None
        try:
            i = ids.index(wid)
        except ValueError:
            self.moved += 1
            return None
        if overloaded(loads[i], min(loads), abs_threshold, rel_threshold):
            self.moved += 1
            return None
        self.hits += 1
        return wid


def rendezvous(
    digest: bytes, ids: Sequence[str], loads: Sequence[int], abs_threshold: float,
    rel_threshold: float, active: Mapping[str, int] | None = None, agree: bool = True,
) -> str:  # fmt: skip
    """Rule 1's pick among the workers not overloaded, given `active` (sessions per
    worker: the table's count, which replicas share).

    `agree` (replicas): of the key's two highest-random-weight workers among those
    holding the fewest sessions, the second only when its load is lower by more than
    `AGREE_MARGIN`, else the first. Replicas pick the same worker for a key without
    talking as long as their views of the counts agree and of those two loads differ
    by no more than the margin. Loads alone (requests in flight: 0 or 1 between tool
    gaps) left the pick to the hash: 16 sessions on 4 workers piled up to 7 on one,
    whose KV could not hold them (hit after the first call 0.845 through 2 replicas,
    0.928 with the count).

    A lone router (no one to agree with): the same among the least loaded workers
    only (requests in flight, strictly). The count first ignored load: under load the
    sessions bunched on busy workers (JCT 1.06x today's at 4 workers, 0.08 sessions/s;
    1.00x with the least loaded first: loadtests/results/agents.md, sixth round). One
    hash a worker, on a session's first call or a lost session's move only."""
    low = min(loads)
    counts = active or {}
    fit = [
        (wid, load) for wid, load in zip(ids, loads, strict=True)
        if not overloaded(load, low, abs_threshold, rel_threshold)
    ]  # fmt: skip
    if not fit:
        return ids[0]
    if not agree:  # the least loaded only
        fit = [(wid, load) for wid, load in fit if load == low]
    fewest = min(counts.get(wid, 0) for wid, _ in fit)
    ranked = [
        (hashlib.blake2b(digest + wid.encode(), digest_size=8).digest(), wid, load)
        for wid, load in fit
        if counts.get(wid, 0) == fewest
    ]
    top = heapq.nlargest(2, ranked)
    if len(top) == 2 and top[1][2] + AGREE_MARGIN < top[0][2]:
        return top[1][1]
    return top[0][1]


class Placement(NamedTuple):
    """What the session rule decided for one keyed request."""

    decision: Decision
    placed: bool  # placed anew (a first call, or moved): shared with the replicas
    left: str | None  # the worker the session moved off: its pin there is released


class Routes(Protocol):
    """router/routing.py's Routing, as the session rule uses it."""

    def select(
        self, request: RouteRequest, workers: Sequence, now: float,
        amend: Callable[[Decision], Decision] | None = None,
    ) -> Decision: ...  # fmt: skip


def select(
    table: SessionTable, routing: Routes, request: RouteRequest, view: Sequence, now: float,
    digest: bytes, abs_threshold: float, rel_threshold: float, pin_ttl: float = 0.0,
) -> Placement:  # fmt: skip
    """The module's rule for one keyed request: the decision, whether the session was
    placed anew (the caller shares it with the replicas) and the worker it left, if it
    moved (the caller releases the session's pin there: ``POST /release_pin``). The
    routing records the route in the holdings room either way, as if the policy had
    chosen it. One router and replicas alike: a lost session (rule 3) moves to rule 1's
    pick, which every replica makes alike (the policy's follows each replica's own load
    view). `pin_ttl`: the request's ``cache_pin_ttl`` (0: none), for rule 3; the caller
    shares it with the replicas (``SessionTable.learn`` on theirs)."""
    ids, loads, _ = view_columns(view)
    held = table.held(digest, now)
    before = table.get(digest, now)
    wid = table.pick(digest, ids, loads, now, abs_threshold, rel_threshold)
    if wid is not None:
        kept = Decision(wid, "session")
        lost = [False]
        if held and not table.fresh(digest, now):  # held by a pin only: rule 3's yield
            low = min(loads)
            busy = PIN_YIELD + table.margin
            held = not overloaded(loads[ids.index(wid)], low, busy, rel_threshold)

        def keep(decision: Decision) -> Decision:
            if decision.reason == "no_match" and not held:  # rule 3: rule 1's pick
                lost[0] = True
                active = table.active(now)
                pick = rendezvous(
                    digest, ids, loads, abs_threshold, rel_threshold, active, table.agree
                )
                return Decision(pick, "session")
            return kept

        decision = routing.select(request, view, now, amend=keep)
        table.lost += lost[0]
        table.put(digest, decision.worker_id, now, pin_ttl)
        moved = lost[0] and decision.worker_id != wid
        return Placement(decision, lost[0], wid if moved else None)

    def rendezvous_pick(decision: Decision) -> Decision:
        if decision.reason in ("no_match", "balance"):  # rule 1
            active = table.active(now)
            pick = rendezvous(digest, ids, loads, abs_threshold, rel_threshold, active, table.agree)
            if pick != decision.worker_id:
                return Decision(pick, "session")
        return decision

    decision = routing.select(request, view, now, amend=rendezvous_pick)
    # Recorded at decision time: siblings sent before this one is answered follow it.
    table.put(digest, decision.worker_id, now, pin_ttl)
    left = before if before is not None and before != decision.worker_id else None
    return Placement(decision, True, left)
