"""How much host memory this machine can pin, read without extra dependencies.

Offload configurations keep what they move in pinned host memory, and at a real model's depth
that is tens of GiB (Wan 2.1 14B with attention kept in CPU memory: ~40 GiB). A configuration whose
pinned memory does not fit the host is worse than slow: pinning past the limit fails, or starves
the rest of the machine. So bench and advise rule such rows out, and say why.
"""

from __future__ import annotations

import os

GiB = 1 << 30
# Leave a quarter of what is available to the data loader, the trainer and the OS.
MARGIN = 0.75


def available_gib() -> float | None:
    """MemAvailable from /proc/meminfo (Linux), else physical pages; None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / GiB
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GiB
    except (ValueError, OSError, AttributeError):
        return None


def pinnable_gib(available: float | None = None) -> float | None:
    """What gradseam plans to pin at most: the available host memory less the margin."""
    available = available_gib() if available is None else available
    return None if available is None else available * MARGIN
