"""A node of the radix tree (worker/engine/radix_cache.py), the result of a match, and
the helpers both tiers of the tree share.

A node's key is its run of token ids as int64 bytes (`kb`): compared with one memcmp.
Its KV lives on the device (`value`), in the host tier (`host_value`,
worker/engine/hiradix_cache.py), or both; slot arrays are read-only once in the tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

TOKEN_BYTES = 8  # bytes per token id in a key (int64)
REUSED, GRANTED = 1, 2  # TreeNode.chance: the second chance's states (radix_cache.py)


def empty_slots() -> np.ndarray:
    return np.empty(0, dtype=np.int64)


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    return arr


def frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False  # a tree's slots must never be edited through a reference
    return a


class TreeNode:
    __slots__ = (
        "bend", "blocks", "chance", "children", "copy_epoch", "dev_children", "heap_tick",
        "host_tick", "host_value", "id", "kb", "last_access", "lock_ref", "parent", "value",
    )  # fmt: skip

    def __init__(
        self, parent: TreeNode | None, kb: bytes, value: np.ndarray | None, tick: int, node_id: int
    ):
        self.children: dict[bytes, TreeNode] = {}
        self.parent = parent
        self.kb = kb  # the key as int64 bytes: compared with one memcmp
        # Device KV slots (int64, read-only, one per token), None while host-resident only.
        self.value = value
        self.host_value: np.ndarray | None = None  # host KV slots: a host-resident copy
        self.dev_children = 0  # children with device slots (a device leaf has none)
        self.lock_ref = 0
        self.last_access = tick
        self.heap_tick = -1  # last_access when its live LRU heap entry was pushed; -1: none
        self.host_tick = -1  # the same for the host LRU heap
        # The second chance (radix_cache.py): 0 none, REUSED matched by an admission,
        # GRANTED requeued once as the newest and counted against the cap.
        self.chance = 0
        self.copy_epoch = 0  # the host tier's plan that copies this node (see host_tier.py)
        self.id = node_id  # tie-break in the LRU heap (ticks repeat along a path)
        self.blocks: tuple[int, ...] = ()  # KV-event block hashes ending here (kv_blocks.py)
        self.bend = 0  # offset of the first block boundary in this node (kv_blocks.py)

    @property
    def key(self) -> np.ndarray:
        """The node's token ids (a read-only int64 view of `kb`)."""
        return np.frombuffer(self.kb, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.kb) // TOKEN_BYTES

    def __repr__(self) -> str:
        tier = "device" if self.value is not None else "host"
        return (
            f"TreeNode(id={self.id}, key={self.key.tolist()[:8]}, lock_ref={self.lock_ref}, "
            f"{tier}{'+host' if tier == 'device' and self.host_value is not None else ''})"
        )


class MatchResult(NamedTuple):
    slots: np.ndarray  # int64 device slots of the matched prefix, len == prefix_len
    last_node: TreeNode  # deepest matched node in either tier (the root when nothing matched)
    prefix_len: int  # device-resident tokens matched; always a multiple of page_size
    # Host-resident tokens matched after them (`HiRadixCache.load` brings them to the device).
    host_len: int = 0
