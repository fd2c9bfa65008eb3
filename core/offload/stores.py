"""The stores an offload engine copies into, by destination name (:class:`gradseam.backends.Destination`'s
values): one factory each, taking the plan's store size. A backend that offloads somewhere new (a file on
NVMe, a weights pool) adds its store here; the engine's packing logic stays as it is."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .engine import Store
from .pinned import PinnedPool, pageable


def host_store(max_buckets: int, *, test_mode: bool = False) -> Store:
    """Pinned host memory, pooled (``max_buckets`` size classes; 0 = pageable). In the CPU test mode plain
    memory stands in for pinned buffers, through the same pool logic."""
    if test_mode:
        return PinnedPool(max_buckets, allocate=pageable)
    return PinnedPool(max_buckets, pin=torch.cuda.is_available())


STORES: dict[str, Callable[..., Store]] = {"host": host_store}
