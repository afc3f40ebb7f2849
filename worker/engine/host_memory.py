"""Whether the host can hold what a start asks for: one check for every engine.

The radix engine's host tier is K and V rows in host memory (`bytes_per_token` of them a
token); the sim engine keeps no KV, only the slot bookkeeping (`SIM_BYTES_PER_SLOT`, an
int64 free-list entry a slot). Either way a tier larger than the host's free memory is
refused at start with the numbers, instead of a numpy or torch allocation failing with
a traceback (`--host-cache-tokens 1000000000000000` asked numpy for 7.11 PiB, issue 31).
Torch-free, so the sim path imports it.
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


def check_host_memory(
    tokens: int, bytes_per_token: int, available: int | None = None,
    key: str = "host_cache_tokens",
) -> None:  # fmt: skip
    """Refuse `tokens` slots the host's free memory cannot hold (ValueError naming `key`
    and the numbers)."""
    available = cpu_available_bytes() if available is None else available
    need = tokens * bytes_per_token
    if need > available:
        raise ValueError(
            f"{key} {tokens} needs {need:,} bytes of host memory "
            f"({bytes_per_token:,} bytes per token) but {available:,} are available; "
            f"at most {available // bytes_per_token} tokens fit"
        )
