"""The offload engine: saved tensors to pinned host memory and back, on side streams.

It knows nothing of diffusers, families or backends (see :mod:`gradseam.offload.engine` for every
stream decision, :mod:`gradseam.offload.pinned` for the pinned pool). The run layer opens one
engine group per region call; what goes into it is the run layer's decision.
"""

from __future__ import annotations

from .device import cpu_allowed, cpu_test_mode, engine_for
from .engine import KEEP_RECENT, MIN_OFFLOAD_BYTES, OffloadEngine, Store, strict_inplace
from .pinned import Bucket, PinnedPool, size_class
from .stores import STORES, host_store

__all__ = [
    "KEEP_RECENT",
    "MIN_OFFLOAD_BYTES",
    "Bucket",
    "OffloadEngine",
    "PinnedPool",
    "STORES",
    "Store",
    "host_store",
    "cpu_allowed",
    "cpu_test_mode",
    "strict_inplace",
    "engine_for",
    "size_class",
]
