"""Tenants: who a request is for, as its API key names it (config `tenants`).

A key listed under a tenant is that tenant's; every other request (a key only in
`api_keys`, or no key where none is required) is the tenant `default`, whose weight
and bounds a `tenants.default` entry may set. Each tenant keeps what the fleet queue
(router/queue/fleet_queue.py) needs of it: its weight, its two bounds, its deficit
round robin credit and its waiting requests, one FIFO per class.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

from shared.config import RouterConfig
from shared.serving.auth import bearer_token
from shared.wire.service_class import CLASSES

DEFAULT = "default"


class Tenant:
    __slots__ = ("credit", "max_queue", "max_wait_s", "name", "queues", "waiting", "weight")

    def __init__(self, name: str, weight: float, max_queue: int, max_wait_s: float) -> None:
        self.name, self.weight = name, weight
        self.max_queue, self.max_wait_s = max_queue, max_wait_s
        # Deficit round robin credit, in requests (fleet_queue.py's rule, step 1).
        self.credit = 0.0
        # Waiting tickets (fleet_queue.py's, which imports this module), one FIFO per
        # class (CLASSES order: most urgent first).
        self.queues: tuple[deque[Any], ...] = tuple(deque() for _ in CLASSES)
        self.waiting = 0


class Tenants:
    """Every tenant, and the key → tenant lookup (keys were checked by auth already)."""

    def __init__(self, config: RouterConfig) -> None:
        def tenant(name: str) -> Tenant:
            own = config.tenants.get(name)
            weight = own.weight if own is not None else 1.0
            max_queue = own.max_queue if own is not None and own.max_queue is not None else None
            max_wait = own.max_queue_wait_s if own is not None else None
            return Tenant(
                name, weight,
                config.max_queue if max_queue is None else max_queue,
                config.queue_timeout if max_wait is None else max_wait,
            )  # fmt: skip

        self.by_name: dict[str, Tenant] = {name: tenant(name) for name in config.tenants}
        if DEFAULT not in self.by_name:
            self.by_name[DEFAULT] = tenant(DEFAULT)
        self.default = self.by_name[DEFAULT]
        self._by_key: Mapping[str, Tenant] = {
            key: self.by_name[name] for name, t in config.tenants.items() for key in t.keys
        }
        # Whether any tenant names keys: if not, every request is `default`'s (a caller
        # that reads this first makes no `of_headers` call a request).
        self.keyed = bool(self._by_key)

    def of_headers(self, headers: Mapping[str, str]) -> Tenant:
        """The tenant of a request's Bearer key (no key, or one of no tenant: default)."""
        if not self._by_key:
            return self.default
        key = bearer_token(headers)
        return self._by_key.get(key, self.default) if key is not None else self.default

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self.by_name.values())
