"""The host's free memory, and whether a slot count fits in it: torch-free, for the
sim engine (the radix engine's host tier has its own, pinning-aware check,
worker/engine/runtime/host_memory.py).

The sim engine keeps no KV, only the slot bookkeeping: `SIM_BYTES_PER_SLOT` (one int64
free-list entry a slot, worker/engine/allocator.py) for its device pool and its host
tier alike. A count the host cannot hold is refused at start with the numbers, as the
radix engine refuses its host tier, instead of numpy failing with a traceback
(`--host-cache-tokens 1000000000000000` asked numpy for 7.11 PiB, issue 31).
"""

from __future__ import annotations

import os

SIM_BYTES_PER_SLOT = 8  # worker/engine/allocator.py: one int64 a slot


def cpu_available_bytes() -> int:
    """Memory the kernel could give us without swapping (MemAvailable), or free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_slots_fit(
    key: str, tokens: int, bytes_per_token: int, available: int | None = None
) -> None:
    """Refuse `tokens` slots the host's free memory cannot hold (ValueError naming `key`
    and the numbers, in the radix engine's words)."""
    available = cpu_available_bytes() if available is None else available
    need = tokens * bytes_per_token
    if need > available:
        raise ValueError(
            f"{key} {tokens} needs {need:,} bytes of host memory "
            f"({bytes_per_token:,} bytes per token) but {available:,} are available; "
            f"at most {available // bytes_per_token} tokens fit"
        )
