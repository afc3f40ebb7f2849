"""What the holdings room answers for one request: the request as routed, and per worker
what it probably holds of it (router/holdings/room.py says how that is worked out).

A policy reads the prediction in one of two shapes, both in the tree's units (chars of
the routing text, or prompt ids where the router tokenizes):

- ``path``: the prediction as a match path, root side first: ``(holders, end)`` where
  every worker in ``holders`` holds the request's first ``end`` units and each entry's
  holders include the next one's. ``cache_aware`` reads it from the deep end and stops
  at the first routable holder, with no work per worker for the rest.
- ``holdings()``: per worker, device units, host units and why (``tree``, ``index``
  or ``both``): for reports, metrics and the policies' books.

A host-held unit is on the path at its worker's host weight (a load saves that share of
a prefill); ``priced_tiers`` names the workers whose host tier is priced that way, so
``cost_aware`` prices each tier once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

Path = list[tuple[Mapping[object, float], int]]


class RouteRequest:
    """Read only by convention: built once per request (router/upstream/proxy.py
    `Routed`), a slots class (a frozen dataclass's init cost 0.59 us against 0.14 us,
    timeit).

    `text` is the canonical text to route on. A chat the router routes on its prompt ids
    gives `render` instead, and its text is rendered at the first read: only fallbacks
    read it then (no ids, a waiting ticket's `extends`, `consistent_hash`), and rendering
    a 62-message chat cost 14.9 us a request on the token path (timeit). `text` is a
    plain slot, left unset until then (`__getattr__` renders it): the common request's
    reads cost no call, where a property cost one a read (two a request)."""

    __slots__ = ("_render", "model", "namespace", "session_key", "text", "tokens")

    def __init__(
        self, text: str = "", session_key: str | None = None,
        tokens: Sequence[int] | None = None, model: str = "", namespace: str = "",
        render: Callable[[], str] | None = None,
    ) -> None:  # fmt: skip
        if render is None:
            self.text = text
        else:
            self._render = render
        self.session_key = session_key  # consistent_hash: a header or the OpenAI `user`
        self.tokens = tokens  # the worker's prompt ids (router `tokenizer` set)
        self.model = model
        # What else splits the engine's cache beyond the model
        # (router/holdings/namespace.py): "" for none (no cache_salt, its own template).
        self.namespace = namespace

    def __getattr__(self, name: str) -> str:
        """Only an unset `text` comes here: rendered once, then a slot read."""
        if name != "text":
            raise AttributeError(name)
        self.text = text = self._render()
        return text

    def __repr__(self) -> str:
        return (f"RouteRequest(text={self.text!r}, session_key={self.session_key!r}, "
                f"tokens={self.tokens!r}, model={self.model!r}, namespace={self.namespace!r})")  # fmt: skip


class Holding(NamedTuple):
    device: int  # units of the request held on the worker's device
    host: int  # units held only on its host tier (loaded, not computed)
    why: str  # tree | index | both


@dataclass(eq=False, slots=True)
class Prediction:
    """Read only (not frozen: built on every request, and a frozen init costs more)."""

    request: RouteRequest
    key: str  # what the tree keys the request on (text or a TokenKey, namespace included)
    length: int  # the request's length in the tree's units
    on_tokens: bool  # the units are prompt ids (else chars)
    path: Path
    # Workers the room forgot (left, restarted, changed model) since the last prediction:
    # a policy's own per-worker books follow.
    forgotten: tuple[str, ...] = ()
    # Per worker: (device, host, why) where the index contributed (tree-only holders are
    # read off ``path``).
    index: Mapping[str, tuple[int, int, str]] = field(default_factory=dict)
    # Each worker's stored tree size, for the given ids (no_match: smallest_tree).
    stored: Callable[[Sequence[str]], list[int]] = lambda ids: [0] * len(ids)

    @property
    def priced_tiers(self) -> frozenset[str]:
        """The workers whose host tier the index priced (those it contributed for): made
        on asking, not on every request of every policy (cost_aware reads `index`)."""
        return frozenset(self.index)

    def held(self, worker_id: str) -> int:
        """Units of the request ``worker_id`` holds, as the path says (0: none)."""
        return next((end for held, end in reversed(self.path) if worker_id in held), 0)

    def holdings(self) -> dict[str, Holding]:
        """Per worker holding any of the request: device units, host units, why."""
        out: dict[str, Holding] = {}
        for held, end in self.path:  # root side first: deeper ends overwrite
            for w in held:
                out[str(w)] = Holding(end, 0, "tree")
        for w, (device, host, why) in self.index.items():
            out[w] = Holding(device, host, why)
        return out
