"""KV-cache events in vLLM's schema, as workers publish them and routers index them: the
three events, a batch of them, and the bounds a batch read from the wire keeps.

vLLM (`vllm/distributed/kv_events.py`) and SGLang publish, per engine step, a batch

    [ts, [event, ...], data_parallel_rank]          (msgpack, array_like)

    BlockStored     block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                    lora_name, extra_keys (the last two: newer vLLM, 0.32 here)
    BlockRemoved    block_hashes, medium
    AllBlocksCleared

An engine's block hash is an opaque id (bytes or a 64-bit int): the router keys blocks by
content and parent (shared/wire/kv_events.py `block_key_list`), so it never depends on how
an engine hashes. shared/wire/kv_events.py names all of this too (its importers' module).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeAlias, final

import numpy as np

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUMS = frozenset({MEDIUM_GPU, MEDIUM_CPU, "STORAGE"})

MAX_BATCH_BYTES = 4 * 1024 * 1024  # one stream entry / ZMQ frame
MAX_EVENTS = 4096  # events in one batch
MAX_BLOCKS = 8192  # hashes in one event
# Token ids in one event, and so the longest array msgpack decodes: one event is one
# decode call (BatchReader's step), and 4M ids in one event (inside MAX_BATCH_BYTES, in
# 4,096-token blocks) held the event loop ~140-200 ms to decode and check. 2**18 is two
# 128k-token contexts; vLLM stores a step's blocks per event (a chunked prefill's
# worth), our engine at most this many per event (worker/engine/kv_blocks.py).
MAX_EVENT_TOKENS = 1 << 18
MAX_BLOCK_SIZE = 4096  # tokens per block
MAX_TOKEN_ID = 2**31 - 1
MAX_HASH_BYTES = 64
MAX_EXTRA_KEYS = 8  # items in one block's extra_keys (strings bounded by max_str_len)

BlockHash: TypeAlias = bytes | int

# The events and their batch are values nobody writes to after they are made, but not
# `frozen`: a frozen dataclass sets each field through `object.__setattr__`, and that
# was a third of decoding an event (~1.1 of ~3 us for a 2-block BlockStored; the live
# sim stream's events hold ~2 blocks, ~2.4 of them a routed request). They are final: the
# feed tells them apart by exact type (router/holdings/kv_index.py `apply`).


@final
@dataclass(slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: Sequence[int] | np.ndarray  # len == len(block_hashes) * block_size
    # 0 (and no token ids, no parent): blocks the engine named before, now stored in
    # `medium` too (vLLM's offloading connector writes these for its CPU tier).
    block_size: int
    medium: str | None = MEDIUM_GPU
    # vLLM's `extra_keys`: per block, what its hash mixed in beside the tokens (a LoRA
    # name, a cache_salt on the first block, ...), or None; None for the whole event when
    # no block has any. Bounded: MAX_EXTRA_KEYS items of short strings or ints.
    extra_keys: tuple[tuple[str | int, ...] | None, ...] | None = None
    # The LoRA adapter the blocks were computed with: vLLM's `lora_name`, else its
    # `lora_id` (all an event has where the schema predates `lora_name`); None: the base.
    lora: str | int | None = None
    # `token_ids` as their key text (`ids_text`), where the decoder already packed them to
    # check them: the index keys blocks from it (`block_key_text`) with no conversion.
    # Derived from `token_ids`: not part of the event's value (equality, repr).
    token_text: str | None = field(default=None, compare=False, repr=False)


@final
@dataclass(slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = MEDIUM_GPU


@final
@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: tuple[KVEvent, ...]
