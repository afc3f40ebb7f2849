"""What each worker holds for a request: the one place the router answers it.

`predict(request, workers, now)` walks the request's key (its text, or its prompt ids
where the router tokenizes, behind its cache namespace: router/holdings/namespace.py)
down one prefix tree of what this router and its replicas routed to each worker
(router/holdings/tree.py; each worker's share capped at the cache it reports, in the
tree's units: chars per token learned from its answers, router/holdings/calibration.py).
Where the workers publish KV events and the request is in its model's default namespace,
the exact index of what each worker reports holding (router/holdings/kv_feed.py) merges
in by the named rules of router/holdings/merge.py: a trusted worker is predicted from its
index plus its routes still in flight, an untrusted one from its tree, a rebuilding one
from both; a host-held token counts at its worker's host weight. Last, a worker whose
answers have not borne out its predicted hits is believed only as far as they did
(router/holdings/claims.py). The answer is a `Prediction` (router/holdings/prediction.py):
per worker device tokens, host tokens and why (tree, index, both), and the same as a match
path for the policies.

The room is told the rest: `routed` (the worker a policy chose: the key goes into its
tree), `observe` (another replica's decision, router/holdings/sync.py), `answered` (what
the answer reported: cached tokens against the prediction, chars per token) and `forget`
(a worker left, restarted or changed model: its tree, caps and evidence go, and the next
prediction names it so a policy's own books follow). Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from router.fleet.view import FleetView, WorkerView, view_columns
from router.holdings.claims import Claims, unconfirmed_claims
from router.holdings.merge import HOST_HIT_WEIGHT, BlockHolders, KvScorer
from router.holdings.namespace import DEFAULT, TEXT_IN_IDS, prefix_of, strip
from router.holdings.prediction import Prediction, RouteRequest
from router.holdings.tree import PrefixTree
from shared.config import RouterConfig
from shared.tokens.prompt_ids import KEY_WIDTH, PromptIds, TokenKey, token_key

Key = str  # text, or a TokenKey (shared/tokens/prompt_ids.py)
# A prediction the index had no part in: one shared empty view, not a dict a request.
_NO_INDEX: Mapping[str, tuple[int, int, str]] = MappingProxyType({})


class Holdings:
    """The room (module docstring). `feed`: the KV-event index, where the router reads
    the workers' streams; `host_weight`: a host-held token's worth per worker."""

    def __init__(
        self,
        config: RouterConfig,
        feed: BlockHolders | None = None,
        host_weight: Callable[[str], float] = lambda _wid: HOST_HIT_WEIGHT,
    ) -> None:
        self._cfg = config
        # With a tokenizer the tree keys on the prompt ids (the worker's own units): matches
        # and caps are in tokens and no chars-per-token guess enters (issue 26). Its keys
        # are TokenKeys, KEY_WIDTH chars an id.
        self.on_tokens = config.tokenizer is not None
        self.tree: PrefixTree = PrefixTree(  # type: ignore[type-arg]
            max_chars=config.tree_max_chars, width=KEY_WIDTH if self.on_tokens else 1
        )
        self._stored = self.tree.tenant_sizes  # (bound once: a prediction carries it)
        self.kv = (
            KvScorer(feed, config.kv_events_inflight, host_weight) if feed is not None else None
        )
        self.claims = Claims()
        self._capacity: dict[str, int] = {}  # last capacity applied per worker, in tokens
        # Chars per token per worker, learned from answers; absent: `tree_chars_per_token`.
        self._chars_per_token: dict[str, float] = {}
        self._ids: Sequence[str] = ()
        self._caps: Sequence[int] | None = None
        self._forgotten: list[str] = []

    # -- the question ------------------------------------------------------------------
    def predict(
        self, request: RouteRequest, workers: Sequence[WorkerView], now: float
    ) -> Prediction:
        # `_follow_capacity`'s test inlined for the router's own view: its ids and
        # capacities are tuples replaced on a change, so the same two mean none.
        if (
            type(workers) is not FleetView
            or workers.ids is not self._ids
            or workers.capacities is not self._caps
        ):
            self._follow_capacity(workers)
        if self.on_tokens or request.namespace != DEFAULT:
            key, n, cut = self._key(request)
        else:  # `_key`'s first case, inlined (the common request)
            key = request.text
            n, cut = len(key), 0
        tree = self.tree
        path = tree.match_path(key) if key else []
        if cut:
            path = strip(path, cut)
        detail: Mapping[str, tuple[int, int, str]] = _NO_INDEX
        kv = self.kv
        if kv is not None and request.tokens is not None and request.namespace == DEFAULT:
            # The workers' own reports (merge.py), in the tree's units.
            path = kv.correct(
                path, request.tokens, request.model, n, now, tree.overflowed_at, tree.monotone
            )
            detail = kv.detail
        claims = self.claims
        if claims.discounted:
            claims.refresh(now)
            path = unconfirmed_claims(path, claims.discounted, now)
        forgotten: tuple[str, ...] = ()
        if self._forgotten:
            forgotten, self._forgotten = tuple(self._forgotten), []
        return Prediction(request, key, n, self.on_tokens, path, forgotten, detail, self._stored)

    def _key(self, request: RouteRequest) -> tuple[Key, int, int]:
        """(tree key, the request's length in the tree's units, the length of what goes
        before it in the key, in units): the routing text, or where the router tokenizes
        the prompt ids' TokenKey. A request the router has no ids for (too long to
        tokenize, the tokenizer busy, ids that are no token ids) is keyed in a tree on
        ids by its text's UTF-8 bytes behind the TEXT_IN_IDS tag, where no prompt's ids
        are, counted at KEY_WIDTH bytes a token."""
        if not self.on_tokens:
            text = request.text
            if request.namespace == DEFAULT:
                return text, len(text), 0
            prefix = prefix_of(request.namespace, False)
            return prefix + text, len(text), len(prefix)  # type: ignore[operator]
        ids = request.tokens
        key = None
        if ids is not None:
            key = ids.tree_key() if type(ids) is PromptIds else token_key(ids)
        if key is None:
            # (UTF-8's encoder passes lone surrogates inline; UTF-32's calls the error
            # handler for each: 80 ms for a 1M-char prompt of them, 2 ms this way.)
            return self._tagged(request.text.encode("utf-8", "surrogatepass"), request)
        n = len(key) // KEY_WIDTH
        if request.namespace == DEFAULT:
            return key, n, 0
        prefix = token_key(prefix_of(request.namespace, True))  # type: ignore[arg-type]
        return TokenKey(prefix + key), n, len(prefix) // KEY_WIDTH  # type: ignore[operator]

    def _tagged(self, text: bytes, request: RouteRequest) -> tuple[Key, int, int]:
        """The key of `text` (UTF-8 bytes) behind its namespace's tags and TEXT_IN_IDS, in
        a tree on ids."""
        tags = (TEXT_IN_IDS,)
        if request.namespace != DEFAULT:
            tags = (*prefix_of(request.namespace, True), TEXT_IN_IDS)  # type: ignore[misc]
        prefix = token_key(tags)
        assert prefix is not None  # tags are ids <= MAX_ID
        key = TokenKey(prefix + text.decode("latin-1"))
        return key, len(text) // KEY_WIDTH, len(tags)

    def affinity(self, request: RouteRequest) -> dict[str, float]:
        """Per worker, the prefix of the request its tree holds (the tree's units, within
        the request's namespace): the fleet queue's affinity (router/queue/fleet_queue.py),
        asked while the request waits, apart from `predict` (no index, no books)."""
        key, _, cut = self._key(request)
        if not key:
            return {}
        held = self.tree.match(key)
        if not cut:
            return held  # type: ignore[return-value]
        return {str(w): float(end - cut) for w, end in held.items() if end > cut}

    def routing_key(self, request: RouteRequest) -> Key:
        """What the tree would key `request` on (namespace included): what replica sync
        shares for a load-only policy's decision."""
        return self._key(request)[0]

    # -- what the room is told ---------------------------------------------------------
    def routed(self, prediction: Prediction, worker_id: str, now: float) -> None:
        """A policy sent the predicted request to `worker_id`."""
        self.tree.insert(prediction.key, worker_id, now)

    def observe(self, worker_id: str, key: Key | Sequence[int], now: float) -> None:
        """Another replica's decision, keyed as its tree keyed it (router/holdings/sync.py:
        a TokenKey where the routers tokenize, with the same tokenizer; plain ids are
        keyed here). A key of the other kind would count chars against a cap in tokens,
        or the reverse: skipped."""
        if not isinstance(key, str):
            key = token_key(key) if self.on_tokens else None  # type: ignore[assignment]
            if key is None:
                return
        if (type(key) is TokenKey) == self.on_tokens and key:
            self.tree.insert(key, worker_id, now)

    def answered(
        self, worker_id: str, predicted: float, cached: int | None,
        chars_per_token: float | None, now: float,
    ) -> None:  # fmt: skip
        """An answer: the `cached` tokens it reports against the `predicted` ones, and the
        worker's chars per token where its answers taught a new one."""
        if cached is not None:
            self.claims.answered(worker_id, predicted, cached, now)
        if chars_per_token is not None:
            # `_calibrate`'s first test inlined: most answers move a known worker's ratio
            # by less than its 10% (no call then).
            old = self._chars_per_token.get(worker_id)
            if old is None or abs(chars_per_token - old) > 0.1 * old:
                self._calibrate(worker_id, chars_per_token)

    def forget(self, worker_id: str) -> None:
        """The worker left, restarted (an empty cache) or changed model."""
        self.tree.remove_tenant(worker_id)
        self._capacity.pop(worker_id, None)
        self._chars_per_token.pop(worker_id, None)
        self.claims.forget(worker_id)
        self._caps = None  # a worker that comes back must get its cap again
        self._forgotten.append(worker_id)

    # -- tree caps ---------------------------------------------------------------------
    def _follow_capacity(self, workers: Sequence[WorkerView]) -> None:
        """Each worker's tree cap follows the capacity its view carries (unknown, 0:
        no change). Fleets change rarely, so comparing the columns (C, identity-fast)
        skips the pass."""
        ids, _, caps = view_columns(workers)
        if ids is not self._ids and ids != self._ids:
            self._ids, self._caps = ids, None
        if caps is self._caps or caps == self._caps:
            self._caps = caps  # (the same next time: `predict`'s identity test passes)
            return
        known = self._capacity
        for wid, cap in zip(ids, caps, strict=True):
            if cap and known.get(wid) != cap:
                self._set_capacity(wid, cap)
        self._caps = caps

    def _set_capacity(self, worker_id: str, cache_tokens: int) -> None:
        self._capacity[worker_id] = cache_tokens
        per_token = (
            1.0
            if self.on_tokens
            else self._chars_per_token.get(worker_id, self._cfg.tree_chars_per_token)
        )
        self.tree.set_cap(worker_id, int(cache_tokens * per_token) if cache_tokens > 0 else None)

    def _calibrate(self, worker_id: str, chars_per_token: float) -> None:
        # The cap follows a change of more than 10% (an EWMA moves a little every answer;
        # re-capping on each would evict a little on each).
        old = self._chars_per_token.get(worker_id, self._cfg.tree_chars_per_token)
        if abs(chars_per_token - old) <= 0.1 * old and worker_id in self._chars_per_token:
            return
        self._chars_per_token[worker_id] = chars_per_token
        cache_tokens = self._capacity.get(worker_id)
        if cache_tokens:
            self._set_capacity(worker_id, cache_tokens)

    # -- reads -------------------------------------------------------------------------
    def worker_stats(self) -> dict[str, dict[str, int]]:
        tree = self.tree
        return {
            str(t): {"tree_chars": tree.tenant_size(t), "tree_nodes": tree.tenant_nodes(t)}
            for t in tree.tenants()
        }
