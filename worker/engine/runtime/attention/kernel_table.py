"""Block sizes of the attention kernels, per head dim and element size, in one table.

The kernels (triton_kernels.py) take every tile size, warp count and pipeline depth
from here, so tuning is a change of data, not of code. The values are first
estimates for Hopper (sm_90) chosen so that nothing spills registers and shared
memory stays far under a block's 227 KiB (tests/worker/engine/test_triton_compile.py
compiles every launch for sm_90 here, without a GPU, and checks both). They have
NOT been timed on a GPU: the GPU check's `kernels` section times the candidates
around them on the device and writes the fastest as `kernel-table.json`; setting
RADIX_KERNEL_TABLE to that file makes the kernels use it (missing keys keep these).

    python -m worker.engine.runtime.attention.kernel_table     # print the table in use

Fields:
    decode_block_n      keys per tile in the decode split kernel
    decode_stages       software-pipeline depth of its K/V loads (`num_stages`: the
                        next tiles' loads are issued, cp.async on sm_80+, while the
                        current tile is reduced)
    decode_warps
    min_split_len       flash-decoding: a sequence is cut into at most
                        cdiv(its context, min_split_len) pieces (and at most the
                        launch's split count), so a short sequence is one piece and a
                        long one uses every piece the grid has
    extend_rows         query rows per extend program: a group's query heads x new
                        tokens (rows = BLOCK_M x BLOCK_H), so K/V are read once per
                        group instead of once per query head
    extend_block_n      keys per extend tile
    extend_stages, extend_warps
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ENV = "RADIX_KERNEL_TABLE"


@dataclass(frozen=True)
class Blocks:
    decode_block_n: int
    decode_stages: int
    decode_warps: int
    min_split_len: int
    extend_rows: int
    extend_block_n: int
    extend_stages: int
    extend_warps: int


# (head_dim, bytes per element of q) -> Blocks. 2 bytes: bf16/fp16 (serving); 4:
# fp32 (the exactness runs, IEEE dots: more registers per tile, so smaller tiles and
# 8 warps, which triton 3.6's ptxas needed not to spill at head dims 32-128).
TABLE: dict[tuple[int, int], Blocks] = {
    (32, 2): Blocks(64, 3, 4, 256, 64, 64, 2, 4),
    (64, 2): Blocks(64, 3, 4, 256, 64, 64, 2, 4),
    (80, 2): Blocks(32, 3, 4, 256, 64, 64, 2, 8),
    (96, 2): Blocks(32, 3, 4, 256, 64, 64, 2, 8),
    (128, 2): Blocks(32, 3, 8, 256, 64, 32, 2, 8),
    (256, 2): Blocks(32, 2, 8, 256, 32, 32, 2, 8),
}
# The gathers' 64-bit address tiles cost registers: past head dim 64 fp32 takes half
# the rows (32 spilled with triton 3.9's ptxas at head dim 128).
FP32 = Blocks(32, 2, 8, 256, 32, 32, 1, 8)
FP32_WIDE = Blocks(32, 2, 8, 256, 16, 32, 1, 8)
# Under TRITON_INTERPRET=1 (CPU tests) every program costs Python time and nothing is
# pipelined: big tiles, and short split pieces so the tests' small contexts split.
INTERPRETER = Blocks(32, 1, 4, 16, 64, 32, 1, 4)


def _overrides() -> dict[tuple[int, int], Blocks]:
    path = os.environ.get(ENV)
    if not path:
        return {}
    rows = json.loads(Path(path).read_text())
    out = {}
    for row in rows:
        key = (int(row.pop("head_dim")), int(row.pop("element_size")))
        out[key] = replace(blocks_for(key[0], key[1], tuned=False), **row)
    return out


_cache: dict[tuple[int, int], Blocks] | None = None


def blocks_for(head_dim: int, element_size: int, *, tuned: bool = True) -> Blocks:
    """The table's entry for this head dim (the next larger one listed if absent)."""
    global _cache
    if tuned:
        if _cache is None:
            _cache = _overrides()
        if (head_dim, element_size) in _cache:
            return _cache[(head_dim, element_size)]
    if element_size >= 4:
        return FP32 if head_dim <= 64 else FP32_WIDE
    dims = sorted(d for d, size in TABLE if size == element_size)
    dim = next((d for d in dims if d >= head_dim), dims[-1])
    return TABLE[(dim, element_size)]


def rows() -> list[dict]:
    """The table as JSON rows (the format RADIX_KERNEL_TABLE reads)."""
    out = [{"head_dim": d, "element_size": s, **asdict(b)} for (d, s), b in sorted(TABLE.items())]
    return out + [
        {"head_dim": d, "element_size": 4, **asdict(blocks_for(d, 4, tuned=False))}
        for d, _ in sorted(TABLE)
    ]


if __name__ == "__main__":
    json.dump(rows(), sys.stdout, indent=1)
    print()
