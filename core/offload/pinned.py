"""Pinned host buffers, pooled: allocating pinned memory costs ~1 s per GiB, so it is done once.

Buffers are grouped in buckets by (size class, dtype), at most ``max_buckets`` buckets, and reused
across steps; a size with no bucket under the cap, or a failed pinning, falls back to pageable
memory (warning once for the failure). A buffer is handed out again only once every copy into or
out of it has completed (the events recorded against it).
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

Bucket = tuple[int, torch.dtype]


def size_class(nbytes: int) -> int:
    """Round up to four steps per power of two (at most 25% waste), so shapes share buffers."""
    if nbytes <= 4096:
        return 4096
    step = 1 << max(int(math.log2(nbytes)) - 2, 0)
    return -(-nbytes // step) * step


class PinnedPool:
    """Reusable host buffers, grouped in buckets by (size class, dtype); at most ``max_buckets`` buckets.

    ``pin=False`` (or ``max_buckets == 0``) hands out plain pageable memory. Buffers are only handed
    out again once the events recorded against them have completed.
    """

    def __init__(self, max_buckets: int, pin: bool = True, allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        self.max_buckets = max_buckets
        self.pin = pin and max_buckets > 0
        # How a bucket buffer is made; tests substitute plain memory to exercise the pool on the CPU.
        self._allocate = allocate or (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        self._free: dict[Bucket, list[tuple[torch.Tensor, list[Any]]]] = {}
        self._buckets: set[Bucket] = set()
        self._lock = threading.RLock()
        self.pinned_allocations = 0
        self.pinned_bytes = 0
        self.pageable_allocations = 0
        self.checked_out = 0
        self._warned = False

    @property
    def buckets(self) -> int:
        return len(self._buckets)

    def acquire(self, nbytes: int, dtype: torch.dtype) -> tuple[torch.Tensor, Bucket | None]:
        """A uint8 host buffer of at least ``nbytes``; returns it with its bucket (None: pageable)."""
        key: Bucket | None = (size_class(nbytes), dtype)
        with self._lock:
            self.checked_out += 1
            if self.pin and key in self._buckets:
                free = self._free.setdefault(key, [])
                for i, (buf, events) in enumerate(free):
                    if all(e.query() for e in events):
                        del free[i]
                        return buf, key
            elif self.pin and len(self._buckets) < self.max_buckets:
                self._buckets.add(key)
            else:
                key = None
        if key is not None and self.pin:
            try:
                buf = self._allocate(key[0])
                with self._lock:
                    self.pinned_allocations += 1
                    self.pinned_bytes += key[0]
                return buf, key
            except RuntimeError as exc:  # pinned memory exhausted or capped (e.g. WSL2)
                self._pinning_failed(exc)
        with self._lock:
            self.pageable_allocations += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=False), None

    def _pinning_failed(self, exc: BaseException) -> None:
        with self._lock:
            self.pin = False
            warn = not self._warned
            self._warned = True
        if warn:
            warnings.warn(
                f"gradseam could not allocate pinned host memory ({str(exc).splitlines()[0]}); offloaded "
                "activations now use pageable memory (slower copies). Lower "
                "gradient_checkpointing_offload_pin_memory_max_buckets or raise the pinned-memory limit.",
                RuntimeWarning,
                stacklevel=4,
            )

    def release(self, buf: torch.Tensor, bucket: Bucket | None, events: list[Any]) -> None:
        with self._lock:
            self.checked_out -= 1
            if bucket is not None and self.pin:
                self._free.setdefault(bucket, []).append((buf, events))

    def stats(self) -> dict[str, int]:
        return {
            "buckets": self.buckets,
            "pinned_allocations": self.pinned_allocations,
            "pinned_bytes": self.pinned_bytes,
            "pageable_allocations": self.pageable_allocations,
            "checked_out": self.checked_out,
        }
