"""Pinned host buffers, pooled: allocating pinned memory costs ~1 s per GiB, so it is done once.

Buffers are grouped in buckets by (size class, dtype), at most ``max_buckets`` buckets, and reused
across steps; a size with no bucket under the cap, or a failed pinning, falls back to pageable
memory (warning once for the failure). A buffer is handed out again only once every copy into or
out of it has completed (the events recorded against it).

Why not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator rounds every block up
to the next power of two and keeps freed blocks cached for the rest of the process. Under a pool
that already rounds to size classes, that doubled the host memory actually pinned for some shapes
(a 1.25 GiB class became a 2 GiB block), so the pinned figures the pool reported were up to 2x
low, and a second patched model (a second bench row) pinned anew beside the first one's cached
blocks until the host killed the process (Wan 2.1 14B at 40 blocks, H200 host, 125 GiB). So the pool
pins page-aligned memory itself with ``cudaHostRegister``: exactly the bytes it counts, and
unpinned and freed when the pool closes (``remove()``) or is collected.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import warnings
import weakref
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


# Past this fraction of the machine's memory held pinned, gradseam warns (once per process): pinned pages
# cannot be swapped out, and the data loader, the optimizer's host state and the OS need room beside them.
HOST_FRACTION = 0.5
_pinned = {"bytes": 0, "warned": False}  # what this process holds page-locked through register_pinned
_pinned_lock = threading.Lock()


def host_memory_bytes() -> int:
    """The machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def pinned_bytes() -> int:
    """Host memory this process holds pinned through :func:`register_pinned` now: the activation pools' buffers
    and the streamed weights' (:mod:`gradseam.offload.weights`) together."""
    return _pinned["bytes"]


def _admit(nbytes: int) -> None:
    """Count ``nbytes`` about to be pinned; warn once, before it is, if that takes the process's pinned total
    past :data:`HOST_FRACTION` of the machine's memory. One count for every pinning gradseam does, so the
    streamed weights and the offloaded activations are weighed together, as the host feels them."""
    with _pinned_lock:
        after = _pinned["bytes"] + nbytes
        total = host_memory_bytes()
        warn = not _pinned["warned"] and after > HOST_FRACTION * total
        _pinned["bytes"] = after
        _pinned["warned"] = _pinned["warned"] or warn
    if warn:
        warnings.warn(
            f"gradseam: pinning {nbytes / 2**30:.2f} GiB more host memory brings what this process holds pinned "
            f"to {after / 2**30:.1f} GiB, more than {HOST_FRACTION:.0%} of this machine's {total / 2**30:.1f} GiB. "
            "Pinned pages cannot be swapped out, and the data loader, the optimizer and the OS need room beside "
            "them. To pin less: stream fewer blocks' weights (gradient_checkpointing_stream_weights), offload "
            "fewer activations (a backend that keeps them on the GPU, or a lower "
            "gradient_checkpointing_memory_budget with the compiled backends), or copy through pageable memory "
            "(gradient_checkpointing_offload_pin_memory_max_buckets: 0, slower). handle.summary() shows the split.",
            RuntimeWarning, stacklevel=4,
        )


def _forget(nbytes: int) -> None:
    with _pinned_lock:
        _pinned["bytes"] -= nbytes


def register_pinned(nbytes: int) -> torch.Tensor:
    """``nbytes`` (rounded up to whole pages) of host memory, page-locked with ``cudaHostRegister``.

    An anonymous mapping of its own: page-aligned, so the tensor's storage starts on the first pinned
    byte (``is_pinned()`` reads its first address) and no page is shared with other memory (pinning a
    page twice fails). The tensor keeps the mapping alive. Raises ``RuntimeError`` when CUDA refuses.
    Counted in :func:`pinned_bytes` until :func:`unregister_pinned`.
    """
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    buf = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)
    _admit(size)
    try:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), size, 0))
    except BaseException:
        _forget(size)
        raise
    return buf


def unregister_pinned(buf: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    _forget(buf.numel())


def pageable(nbytes: int) -> torch.Tensor:
    """Plain host memory standing in for a pinned buffer (the engine's CPU test mode)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def _unpin_all(owned: list[torch.Tensor], unpin: Callable[[torch.Tensor], None]) -> None:
    """Unpin every buffer the pool made, once nothing may still copy into or out of them."""
    if not owned:
        return
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # no copy in flight touches a buffer while it is unpinned
        for buf in owned:
            unpin(buf)
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may already be gone: nothing left to free
        pass
    owned.clear()  # the memory itself goes when the last tensor viewing it does


class PinnedPool:
    """Reusable host buffers, grouped in buckets by (size class, dtype); at most ``max_buckets`` buckets.

    ``pin=False`` (or ``max_buckets == 0``) hands out plain pageable memory. Buffers are only handed
    out again once the events recorded against them have completed. ``allocate`` makes a bucket
    buffer and ``unpin`` (if given) undoes its pinning when the pool closes; by default buffers are
    registered with CUDA by :func:`register_pinned` (see the module docstring for why).
    """

    def __init__(self, max_buckets: int, pin: bool = True, allocate: Callable[[int], torch.Tensor] | None = None,
                 unpin: Callable[[torch.Tensor], None] | None = None) -> None:
        self._recipe = (max_buckets, pin, allocate, unpin)
        self.max_buckets = max_buckets
        self.pin = pin and max_buckets > 0
        # How a bucket buffer is made; tests substitute plain memory to exercise the pool on the CPU.
        if allocate is None:
            allocate, unpin = register_pinned, unregister_pinned
        self._allocate = allocate
        # Every buffer made, strongly held by the finalizer, so none is freed while still registered.
        self._owned: list[torch.Tensor] = []
        self._close = weakref.finalize(self, _unpin_all, self._owned, unpin) if unpin is not None else None
        self._free: dict[Bucket, list[tuple[torch.Tensor, list[Any]]]] = {}
        self._buckets: set[Bucket] = set()
        self._lock = threading.RLock()
        self.pinned_allocations = 0
        self.pinned_bytes = 0
        self.pageable_allocations = 0
        self.checked_out = 0
        self._warned = False

    def __reduce__(self) -> tuple[Any, ...]:
        # A deep-copied or unpickled pool is a fresh, empty one with the same settings: its buffers are
        # this process's pinned memory, in use by this pool's steps.
        return (PinnedPool, self._recipe)

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
                    self.pinned_bytes += buf.numel()
                    if self._close is not None:
                        self._owned.append(buf)
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

    def close(self) -> None:
        """Unpin and let go of every buffer now (idempotent); later requests get pageable memory.

        Buffers still backing saved tensors (a backward not yet run) stay valid, as pageable memory.
        """
        with self._lock:
            self.pin = False
            self._free.clear()
        if self._close is not None:
            self._close()

    def stats(self) -> dict[str, int]:
        return {
            "buckets": self.buckets,
            "pinned_allocations": self.pinned_allocations,
            "pinned_bytes": self.pinned_bytes,
            "pageable_allocations": self.pageable_allocations,
            "checked_out": self.checked_out,
        }
