"""What the scheduler needs from a prefix cache (`PrefixCache`), and `NoCache`, the same
interface caching nothing. The caches: worker/engine/radix_cache.py (the device tier)
and worker/engine/hiradix_cache.py (with the host tier).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from worker.engine.allocator import SlotAllocator
from worker.engine.tree_node import MatchResult, TreeNode, empty_slots, frozen
from worker.engine.types import KVCopies


class PrefixCache(Protocol):
    """What the scheduler needs from a prefix cache: RadixCache, HiRadixCache or NoCache."""

    allocator: SlotAllocator
    page_size: int
    root: TreeNode
    hit_tokens: int
    miss_tokens: int

    def match_prefix(
        self, tokens: Sequence[int] | np.ndarray, *, record: bool = True
    ) -> MatchResult: ...
    def insert(
        self, tokens: Sequence[int] | np.ndarray, slots: np.ndarray, cached_len: int = 0
    ) -> int: ...
    def load(self, node: TreeNode) -> np.ndarray: ...
    def take_copies(self) -> KVCopies | None: ...
    def lock(self, node: TreeNode) -> None: ...
    def unlock(self, node: TreeNode) -> None: ...
    def evict(self, num_tokens: int) -> int: ...
    def reset(self) -> None: ...
    @property
    def evictable_size(self) -> int: ...
    @property
    def protected_size(self) -> int: ...
    @property
    def total_size(self) -> int: ...
    def cached_slots(self) -> np.ndarray: ...
    def check_integrity(self) -> None: ...


class NoCache:
    """The same interface caching nothing: the correctness baseline and the ablation switch."""

    def __init__(self, allocator: SlotAllocator, page_size: int = 1) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.root = TreeNode(None, b"", frozen(empty_slots()), 0, 0)
        self.hit_tokens = 0
        self.miss_tokens = 0

    def match_prefix(
        self, tokens: Sequence[int] | np.ndarray, *, record: bool = True
    ) -> MatchResult:
        if record:
            self.miss_tokens += len(tokens)
        return MatchResult(empty_slots(), self.root, 0)

    def insert(
        self, tokens: Sequence[int] | np.ndarray, slots: np.ndarray, cached_len: int = 0
    ) -> int:
        if len(slots) != len(tokens):
            raise ValueError(f"{len(slots)} slots for {len(tokens)} tokens")
        if cached_len != 0:
            raise ValueError("NoCache holds nothing, so cached_len must be 0")
        self.allocator.free(np.asarray(slots, dtype=np.int64))
        return 0

    def lock(self, node: TreeNode) -> None:
        pass  # only the root exists, and the root is never locked

    def unlock(self, node: TreeNode) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def reset(self) -> None:
        pass

    @property
    def evictable_size(self) -> int:
        return 0

    @property
    def protected_size(self) -> int:
        return 0

    @property
    def total_size(self) -> int:
        return 0

    def cached_slots(self) -> np.ndarray:
        return empty_slots()

    def load(self, node: TreeNode) -> np.ndarray:
        return empty_slots()

    def take_copies(self) -> KVCopies | None:
        return None

    def check_integrity(self) -> None:
        assert not self.root.children, "NoCache holds entries"
