"""What the scheduler hands the model runner each step: a `Batch`, one `BatchItem` per
request.

The seam between the torch-free scheduler and the runner that owns every tensor, so
it is pure Python and numpy. How one item's slots line up with its tokens (the one
picture of the slot table; the runner and the attention metadata point here):

    positions  0 .... dirty_from .... start_pos-1 | start_pos ....... start_pos+n-1
    tokens     KV already in the pool             | input_ids (n NEW tokens, run now)
    slots      slots[:start_pos]                  | slots[start_pos:]
               read, never written                | written with the new K/V
    table row  kept | rewritten from slots[dirty_from:] (the runner's device copy) -->|

`dirty_from` (<= start_pos) is the first position whose slot may differ from what the
runner last saw for this `seq_id`: 0 after an admission, or the start of a prefix the
radix tree took over after a prefill chunk (its slots are swapped for the tree's, which
hold the same K/V). A runner that keeps a per-sequence slot table on the device copies
only `slots[dirty_from:]`. `sample` says whether the logits of the item's last
position are wanted (a decode, or the last chunk of a prefill); the runner returns
logits for those items only, in batch order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from worker.engine.req import Req


@dataclass
class BatchItem:
    input_ids: list[int]  # the NEW tokens to run (uncached prompt chunk, or 1 sampled token)
    start_pos: int  # tokens of this sequence that already have KV in the pool
    slots: np.ndarray  # int64 slot of every token 0 .. start_pos + len(input_ids) - 1
    # Stable while the sequence runs (the runner keys its slot table on it); None: a
    # one-step row (every slot copied each step).
    seq_id: int | None = None
    dirty_from: int = 0  # slots[:dirty_from] are what the runner saw last for seq_id
    sample: bool = True  # return the logits of the last position

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.input_ids)


@dataclass
class Batch:
    """One step's work: `items[i]` runs `reqs[i]`."""

    items: list[BatchItem] = field(default_factory=list)
    reqs: list[Req] = field(default_factory=list)
    chunked: list[Req] = field(default_factory=list)  # ran a prefill chunk
    admitted: list[Req] = field(default_factory=list)  # left the queue this step
    preempted: list[Req] = field(default_factory=list)

    @property
    def sampled(self) -> list[Req]:
        """The requests whose next token this step gives, in batch order."""
        return [r for r, item in zip(self.reqs, self.items, strict=True) if item.sample]
