"""Saved-tensor offload: move what autograd keeps for backward to host memory, and back in time.

This module knows nothing of diffusers or families. An engine packs tensors into *groups* (one
per region call) and unpacks them in backward; :mod:`gradseam.run.scopes` decides what is packed:

* around a checkpoint call, saved-tensor hooks see only the checkpoint's inputs (non-reentrant
  checkpoint saves them through ``save_for_backward``), so offloading there is the *unsloth* strategy;
* around an un-checkpointed attention call, they see everything attention saves;
* inside a checkpointed region, the attention kernels' outputs are packed as they are produced and
  handed back when backward recomputes the region (:mod:`gradseam.run.kernels`).

How the copies stay off the critical path (each point is a decision, not an accident):

* **Device-to-host on a side stream, one batch per group.** At pack time the producing kernel has
  only been enqueued. A group's copies are issued together when it closes: the copy stream waits
  once for the compute stream up to that point (every producer is enqueued by then), copies each
  span, and records one event for the batch, while the compute stream runs on. Issuing them per
  tensor cost a stream wait, a stream switch and an event each: 94-105 us of CPU per saved
  tensor on an H100's host, against 30-32 us batched (``docs/scripts/pack_cost.py``). A compiled
  block saves a dozen or more tensors in one burst after ~3 ms of GPU work (Flux at 4k tokens),
  so the CPU, not the GPU, paced the offload rows. Waiting for the close delays no copy that
  matters: the sources stay referenced until the next group closes anyway (below), and bytes
  edited in place after their pack are refused in backward (the version check below), as they
  were when each copy was issued at its pack. ``record_stream`` on the copy stream tells the
  caching allocator not to reuse a source before the copy has read it.
* **The CPU stays at most two groups ahead of the GPU.** Sources let go of while their copies are
  still queued wait in the allocator, busy; a CPU far ahead (packing is cheap now) piles them up,
  and under a memory cap the allocator then synchronizes to find room. Each close that copied
  records an event on the compute stream and waits for the one two closes back
  (``GROUPS_AHEAD``; the measurements are in ``_bound_lead``).
* **The newest group keeps its sources.** Backward starts with the last group of the forward,
  usually before its copy out has even run (the copy queue lags the compute stream), so its
  sources stay referenced and are used as they are: no wait behind the copy queue, no round trip.
  Every older group lets go of its sources when the next group closes. Reaping sources from the
  CPU once their copies complete would not work: the CPU runs far ahead of the GPU, so at pack
  time almost no copy has completed yet, and nothing would ever be freed in time.
* **One copy per storage.** q, k and v are often views of one projection; the Linear layers of one
  attention save the same input three times. Packs are keyed by storage and version (within a
  group), the storage span is copied once, and each view is rebuilt with its own size, stride and
  offset. A save after an in-place edit has another version, so it gets a copy of its own.
* **The engine copies into a store it is given** (:class:`Store`): the pool of pinned host memory
  today (:mod:`gradseam.offload.stores` makes one per destination). Packing, dedup, streams and
  prefetch are the engine's; where the bytes live is the store's.
* **Pinned buffers from a pool.** Pinning costs ~1 s/GiB, so buffers are pooled by size class and
  dtype (at most ``max_buckets`` classes) and reused across steps; a size with no bucket under the
  cap, or a failed pinning, falls back to pageable memory (warning once for the failure). The pool
  pins memory itself (``cudaHostRegister``), not through torch's pinned allocator, which would round
  each buffer up to a power of two and keep it cached after ``remove()`` (``pinned.py`` says more).
* **Host-to-device prefetch in backward.** Backward visits groups in reverse forward order. When
  the first tensor of group *g* is needed, the rest of *g* and all of group *g-1* (the last group
  before it that copied anything; each group links to it) are queued on the load stream, so the transfer overlaps group *g*'s backward. A storage whose views have all
  been unpacked is never loaded again by a prefetch (only on demand, for a second backward). Loaded tensors are allocated on the load stream and
  marked with ``record_stream`` for the compute stream that consumes them.
* **A pinned buffer returns to the pool** only after the device-to-host copy into it and every
  host-to-device copy out of it have completed (tracked with events).

Autograd's in-place check does not run on hooked tensors, so each pack remembers the tensor's
version counter and unpack raises the same error autograd would if it changed.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from .state import is_wrapper, state_storages, storages


class Store(Protocol):
    """Where the engine copies offloaded bytes: host buffers handed out and taken back.

    ``acquire`` returns a uint8 buffer of at least ``nbytes`` and a token (None: the buffer is not
    pinned, so copies into it are synchronous); ``release`` takes it back once the recorded events
    (copies into and out of it) complete. A store must pickle as a fresh, empty store with the same
    settings (a deep-copied patched model gets its own engine).
    """

    max_buckets: int

    def acquire(self, nbytes: int, dtype: torch.dtype) -> tuple[torch.Tensor, Any]: ...
    def release(self, buf: torch.Tensor, token: Any, events: list[Any]) -> None: ...
    def close(self) -> None: ...
    def stats(self) -> dict[str, int]: ...

MIN_OFFLOAD_BYTES = 1 << 20  # smaller tensors cost more in launch and bookkeeping than they save
_WHOLE_STORAGE_FACTOR = 4  # copy the whole storage when a view covers at least 1/4 of it
_ALIGN = 512  # the caching allocator's block alignment
KEEP_RECENT = 1  # closed groups whose GPU sources stay referenced (see OffloadEngine._close)
GROUPS_AHEAD = 2  # how far the CPU may run ahead of the compute stream, in groups that copied (see _bound_lead)
_strict: list[bool] = []  # non-empty inside strict_inplace()


@contextmanager
def strict_inplace() -> Iterator[None]:
    """Catch every in-place edit of an offloaded saved tensor, as autograd does, at the cost of its GPU memory.

    The engine watches a saved tensor and its base weakly (holding them would hold the memory it frees),
    so one edit goes unseen: through a ``detach()``ed alias, which shares the version counter but is not
    a view, after both Python objects are gone. Inside this block each packed tensor keeps such an
    alias, so the check always sees the counter; the tensors' GPU memory stays until backward, so the
    block saves no memory: a debugging aid, for a few steps of a new training loop.
    """
    _strict.append(True)
    try:
        yield
    finally:
        _strict.pop()


class _Done:
    """An already-completed event (CPU path)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@dataclass(eq=False)
class _Stored:
    """One storage span copied to the host; shared by every view packed from it."""

    group: _Group
    nbytes: int
    device: torch.device
    host: torch.Tensor | None = None
    bucket: Any = None  # the store's token for the buffer (None: not pinned)
    copied: Any = None  # event: device-to-host copy done
    loads: list[Any] = field(default_factory=list)  # events of host-to-device copies out of the buffer
    gpu: torch.Tensor | None = None  # loaded bytes, kept until every view has been unpacked
    loaded: Any = None  # event: host-to-device copy done
    src: torch.Tensor | None = None  # the GPU bytes themselves, while the copy out may still be running
    users: int = 0
    unpacked: int = 0
    consumed: bool = False  # every view was unpacked once: prefetching it again would be wasted

    def __del__(self) -> None:
        host = self.host
        if host is not None:
            self.host = None
            events = [e for e in [self.copied, *self.loads] if e is not None]
            self.group.engine.store.release(host, self.bucket, events)


class _Packed:
    """What autograd holds instead of a tensor: how to rebuild it from its storage copy."""

    __slots__ = ("alias", "base", "conj", "dtype", "neg", "offset", "ref", "size", "stored", "stride", "version")

    def __init__(self, t: torch.Tensor, stored: _Stored, offset: int) -> None:
        self.stored = stored
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        # A lazy conjugate or negation is a bit on the view, not in the bytes: the copy of the storage
        # loses it, so it is put back on unpack. Compiled blocks save complex RoPE tables as conjugate
        # views (the backward of a complex product needs the conjugate); without the bit their gradients
        # came back silently wrong (Wan Animate 2 with unsloth-compile, input gradients off by ~10%).
        self.conj = t.is_conj()
        self.neg = t.is_neg()
        self.offset = offset  # in elements, relative to the copied span
        self.version = t._version
        # Autograd's in-place check reads the version counter that every view of a base shares. We
        # may not keep the tensor (its memory is what we free), so we watch it weakly, and its base
        # too: the saved view often dies at once, but any alias that could still write the bytes
        # is the base or a view of it, and a view keeps its base (and the base's Python object,
        # which torch preserves while C++ holds it) alive. A weakly held alias costs no memory.
        self.ref = weakref.ref(t)
        self.base = weakref.ref(t._base) if t._base is not None else None
        self.alias = t.detach() if _strict else None  # strict_inplace(): a strong alias of the counter

    def live(self) -> torch.Tensor | None:
        """Some tensor that still shares the saved tensor's version counter, if any is alive."""
        if self.alias is not None:
            return self.alias
        found = self.ref()
        if found is None and self.base is not None:
            found = self.base()
        return found


class _Group:
    """The tensors packed by one region call (one block, chunk, FFN seam or attention call)."""

    __slots__ = ("__weakref__", "by_storage", "closed", "engine", "pending", "prefetched", "previous", "stored")

    def __init__(self, engine: OffloadEngine) -> None:
        self.engine = engine
        self.by_storage: dict[tuple[int, int, int, int], _Stored] = {}
        self.stored: list[weakref.ref[_Stored]] = []
        self.pending: list[_Stored] = []  # packed, copy not issued yet: issued together at close (_flush)
        self.closed = False
        self.prefetched = False
        # The group that packed something last before this one: backward visits groups in reverse, so
        # it is the one to prefetch while this one's backward runs. Weak: a consumed group may go.
        self.previous: weakref.ref[_Group] | None = None


class OffloadEngine:
    """Offloads saved tensors of a model's regions into ``store``; one engine per patched model and destination.

    ``device_test_mode`` lets the CPU stand in for the device (host copies are made as for a GPU,
    streams and events become no-ops) so the engine's logic is tested exactly without CUDA.
    """

    def __init__(self, store: Store, *, min_bytes: int = MIN_OFFLOAD_BYTES, device_test_mode: bool = False) -> None:
        self.store = store
        self.min_bytes = min_bytes
        self.test_mode = device_test_mode
        self._last: weakref.ref[_Group] | None = None  # the newest group that copied something
        self._streams: dict[torch.device, tuple[Any, Any]] = {}
        # The most recently closed groups keep their GPU sources (see the module docstring).
        self._recent: deque[_Group] = deque()
        self._lead: deque[Any] = deque()  # compute-stream events at the closes of the last groups that copied
        self.offloaded_bytes = 0
        self.copies = 0
        self.loads = 0
        # The watched model (weakly) and the storages of its parameters and buffers (see watch()).
        self._model: weakref.ref[nn.Module] | None = None
        self._key_refs: list[weakref.ref[torch.Tensor]] | None = None  # the first few, to notice moves
        self._excluded_key: tuple[int, ...] = ()
        self._excluded: set[int] = set()

    def __reduce__(self) -> tuple[Any, ...]:
        # A deep-copied or unpickled model gets a fresh engine with the same settings: buffers,
        # streams, locks and in-flight groups belong to the process and the steps that made them.
        model = self._model() if self._model is not None else None
        return (_fresh_engine, (self.store, self.min_bytes, self.test_mode, model))

    # -- streams ---------------------------------------------------------------------------
    def _side_streams(self, device: torch.device) -> tuple[Any, Any]:
        streams = self._streams.get(device)
        if streams is None:
            # Separate streams for the two directions: a prefetch must never queue behind a
            # device-to-host copy of the forward (gradient accumulation interleaves them).
            streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
            self._streams[device] = streams
        return streams

    def watch(self, model: nn.Module) -> None:
        """Never offload this model's parameters or buffers (they stay on the GPU regardless), nor the inner and
        attached tensors of quantized weights (:mod:`gradseam.offload.state`)."""
        self._model = weakref.ref(model)
        self._key_refs, self._excluded_key, self._excluded = None, (), set()

    def refresh(self) -> None:
        """A model forward starts: list the parameters again at the next group (the patcher calls this).

        Listing them walks every module, ~2 ms for 16 Flux blocks; done per group (every block, every
        attention call) it made the offload forwards CPU-bound. Once per forward is enough: inside
        one, parameters are not replaced, or only by parameters (FSDP2's unsharded ones), which
        ``_offloadable`` recognises by type.
        """
        self._key_refs = None

    def state_storages(self) -> set[int]:
        model = self._model() if self._model is not None else None
        if model is None:
            return set()
        # Parameters move (``.to()``, loading weights): the set is re-read when the first ones changed
        # address. Weak references, so the engine never keeps a dropped model's weights alive.
        if self._key_refs is not None:
            firsts = [r() for r in self._key_refs]
            if all(t is not None for t in firsts) and _first_storages(firsts) == self._excluded_key:
                return self._excluded
        tensors = [*model.parameters(), *model.buffers()]
        self._excluded = state_storages(tensors)
        self._key_refs = [weakref.ref(t) for t in tensors[:4]]
        self._excluded_key = _first_storages(tensors[:4])
        return self._excluded

    def _offloadable(self, t: torch.Tensor, state: set[int]) -> bool:
        if (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or t.layout is not torch.strided
                or is_wrapper(t)):
            return False
        if t.device.type != "cuda" and not (self.test_mode and t.device.type == "cpu"):
            return False
        if t.numel() * t.element_size() < self.min_bytes:
            return False
        return t.untyped_storage().data_ptr() not in state

    # -- grouping --------------------------------------------------------------------------
    def open_group(self) -> _Group:
        """A new group for one region call; pass it to :meth:`pack`, then :meth:`close` it."""
        return _Group(self)

    def pack(self, group: _Group, t: torch.Tensor, state: set[int] | None = None) -> Any:
        """What to keep for ``t``: a handle to its host copy, or ``t`` itself when it stays on the device."""
        if not self._offloadable(t, self.state_storages() if state is None else state):
            return t
        return self._pack(group, t)

    def unpack(self, packed: Any) -> torch.Tensor:
        """The tensor a :meth:`pack` result stands for, back on its device (waiting for it if needed)."""
        return self._unpack(packed)

    @contextmanager
    def group(self, select: Callable[[torch.Tensor], bool] | None = None, *, hooks: bool = True) -> Iterator[_Group]:
        """Offload what autograd saves inside this block (optionally only tensors ``select`` accepts).

        ``hooks=False`` opens the group without saved-tensor hooks, for callers that pack themselves
        (kept attention kernel outputs).
        """
        group = self.open_group()
        if not hooks:
            try:
                yield group
            finally:
                self._close(group)
            return
        state = self.state_storages()

        # Never traced by dynamo: a graph break inside a compiled block (HiDream's MoE routes tokens with
        # boolean masks) runs the ops after it eagerly, still inside the compiled function's frame, and
        # dynamo then compiled the hook itself: on CUDA its record_stream landed in an inductor graph,
        # which refuses it (seen on the H200). The hooks are host-side bookkeeping, eager by nature.
        @torch.compiler.disable
        def pack(t: torch.Tensor) -> Any:
            if not self._offloadable(t, state) or (select is not None and not select(t)):
                return t
            return self._pack(group, t)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                yield group
        finally:
            self._close(group)

    def _pack(self, group: _Group, t: torch.Tensor) -> _Packed:
        storage = t.untyped_storage()
        item = t.element_size()
        span_lo = t.storage_offset() * item
        span_hi = span_lo + (1 + sum((s - 1) * st for s, st in zip(t.size(), t.stride()) if s > 0)) * item
        if storage.nbytes() <= _WHOLE_STORAGE_FACTOR * (span_hi - span_lo):
            span_lo, span_hi = 0, storage.nbytes()
        else:  # keep the view's alignment in the reloaded copy (kernels pick vector widths by address)
            span_lo -= span_lo % _ALIGN
        # The version is part of the key: a tensor saved, edited in place, then saved again (a processor that
        # scales its query in place between two uses) holds other bytes the second time, so it is a copy of
        # its own; the first pack keeps the bytes it saw, and its version check still guards its backward.
        key = (storage.data_ptr(), span_lo, span_hi, t._version)
        stored = group.by_storage.get(key)
        if stored is None:
            stored = self._copy_out(group, t, storage, span_lo, span_hi)
            group.by_storage[key] = stored
            if not group.stored:  # the group's first copy: link it behind the last group that copied
                group.previous, self._last = self._last, weakref.ref(group)
            group.stored.append(weakref.ref(stored))
        stored.users += 1
        return _Packed(t, stored, t.storage_offset() - span_lo // item)

    def _copy_out(self, group: _Group, t: torch.Tensor, storage: Any, lo: int, hi: int) -> _Stored:
        nbytes = hi - lo
        host, bucket = self.store.acquire(nbytes, t.dtype)
        stored = _Stored(group, nbytes, t.device, host, bucket)
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        # held at least until the group closes (see _close); the copy itself is issued by _flush
        stored.src = src if lo == 0 and hi == storage.nbytes() else src[lo:hi]
        group.pending.append(stored)
        self.offloaded_bytes += nbytes
        self.copies += 1
        return stored

    def _flush(self, group: _Group) -> list[torch.device]:
        """Issue the copies of everything ``group`` packed since the last flush, one batch per device (a model
        spread over devices copies on each device's own stream); the devices copied on."""
        by_device: dict[torch.device, list[_Stored]] = {}
        for stored in group.pending:
            by_device.setdefault(stored.device, []).append(stored)
        group.pending = []
        for device, batch in by_device.items():
            self._issue(device, batch)
        return list(by_device)

    def _issue(self, device: torch.device, batch: list[_Stored]) -> None:
        if device.type != "cuda":
            for stored in batch:
                assert stored.host is not None and stored.src is not None
                stored.host[: stored.nbytes].copy_(stored.src)
                stored.copied = _Done()
            return
        d2h, _ = self._side_streams(device)
        d2h.wait_stream(torch.cuda.current_stream(device))  # every producer of the batch is enqueued by now
        with torch.cuda.stream(d2h):
            for stored in batch:
                assert stored.host is not None and stored.src is not None
                stored.host[: stored.nbytes].copy_(stored.src, non_blocking=stored.bucket is not None)
            copied = torch.cuda.Event()
            copied.record(d2h)
        for stored in batch:
            stored.copied = copied
            # The allocator must not reuse these bytes before the copy has read them, whenever we let go.
            stored.src.record_stream(d2h)  # type: ignore[union-attr]

    # Never traced by dynamo, as the pack hook (see group): a block compiled after patching (`compile_repeated_blocks`)
    # runs the region's `with engine.group()` inside its compiled frame, and closing the group issues the copies, so
    # dynamo traced `_issue` into the graph and inductor refused its record_stream (`gradseam advise` on Flux dev, the
    # `compiled: unsloth + attention offload` rung, an H200, 2026-12-06; the CPU's copies have no record_stream).
    @torch.compiler.disable
    def _close(self, group: _Group) -> None:
        for device in self._flush(group):
            if device.type == "cuda":
                self._bound_lead(device)
        group.closed = True
        group.by_storage.clear()  # same-address dedup is only valid while the group's sources live
        # Keep the sources of the last KEEP_RECENT groups: backward starts with them, usually before
        # their copies are done, and uses them as they are instead of waiting behind the copy queue
        # and bringing them back. Older groups let go; record_stream keeps that safe while copying.
        self._recent.append(group)
        while len(self._recent) > KEEP_RECENT:
            for ref in self._recent.popleft().stored:
                stored = ref()
                if stored is not None:
                    stored.src = None

    def _bound_lead(self, device: torch.device) -> None:
        """Keep the CPU at most :data:`GROUPS_AHEAD` groups ahead of the compute stream.

        Sources let go of (see :meth:`_close`) while their copies are still queued go back to the
        caching allocator marked busy until the copy stream reaches them. The further the CPU runs
        ahead, the more such memory is waiting, and under a memory cap the allocator then frees its
        cache and synchronizes the device to find room (an allocator retry): on an H200 with Flux dev
        4k's ``unsloth-compile + stream 30`` under 16 GiB, 0.4 retries a step once packing stopped
        pacing the CPU; on an H100 (retries not counted there) two steps of five took ~1.1 s against ~0.6. Two groups
        ahead keep the GPU fed (a block's launches take less CPU time than its kernels take GPU time)
        and that row steady (544.7 ms, against 559.6 unbounded and 557.3 at one group ahead, which
        also slowed the uncapped row by 6%; docs/benchmarks.md). A group that copied nothing holds
        nothing and does not count.
        """
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        self._lead.append(done)
        while len(self._lead) > GROUPS_AHEAD:
            self._lead.popleft().synchronize()

    # -- backward --------------------------------------------------------------------------
    @torch.compiler.disable  # as the pack hook (see group): never traced into a compiled graph
    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        live = packed.live()
        if live is not None and live._version != packed.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{packed.dtype} {list(packed.size)}] is at version {live._version}; expected "
                f"version {packed.version} instead (detected by gradseam's activation offload)."
            )
        stored = packed.stored
        group = stored.group
        if stored.copied is None:  # unpacked before its group closed (a backward inside the region)
            self._flush(group)
        data = stored.src
        if data is None:
            if stored.gpu is None:
                self._copy_in(stored)
            data = self._ready(stored)
        if not group.prefetched:  # first touch of this group: bring the rest of it and the one before
            group.prefetched = True
            self._load_group(group)
            before = group.previous() if group.previous is not None else None
            if before is not None and not before.prefetched:
                self._load_group(before)
        item = packed.dtype.itemsize
        out = torch.empty(0, dtype=packed.dtype, device=data.device).set_(
            data.untyped_storage(), data.storage_offset() // item + packed.offset, packed.size, packed.stride
        )
        if packed.conj:
            out = out.conj()
        if packed.neg:
            out = out._neg_view()
        stored.unpacked += 1
        if stored.unpacked >= stored.users:  # every view has its tensor: drop our references
            stored.gpu = stored.src = None
            stored.unpacked = 0
            stored.consumed = True
        return out

    def _load_group(self, group: _Group) -> None:
        for ref in group.stored:
            stored = ref()
            if stored is not None and stored.gpu is None and stored.src is None and not stored.consumed:
                self._copy_in(stored)

    def _copy_in(self, stored: _Stored) -> None:
        host = stored.host
        assert host is not None, "offloaded tensor unpacked after its group was released"
        assert stored.copied is not None, "a pending copy is brought back from its source (see _unpack)"
        self.loads += 1
        if stored.device.type != "cuda":
            stored.gpu = host[: stored.nbytes].clone()
            stored.loaded = _Done()
            return
        _, h2d = self._side_streams(stored.device)
        with torch.cuda.stream(h2d):
            h2d.wait_event(stored.copied)  # the host buffer is complete
            try:
                gpu = torch.empty(stored.nbytes, dtype=torch.uint8, device=stored.device)
            except torch.OutOfMemoryError as exc:
                raise torch.OutOfMemoryError(
                    f"{exc}\n[gradseam] out of GPU memory while reloading offloaded activations "
                    f"({stored.nbytes / 2**20:.1f} MiB). Backward needs room to bring them back: try a "
                    "smaller batch or resolution, or a strategy that keeps less on the GPU (e.g. 'unsloth' "
                    "instead of 'unsloth-ffn', or gradient_checkpointing_segment_stride equal to the interval)."
                ) from None
            gpu.copy_(host[: stored.nbytes], non_blocking=stored.bucket is not None)
            loaded = torch.cuda.Event()
            loaded.record(h2d)
        stored.loads.append(loaded)
        stored.gpu = gpu
        stored.loaded = loaded

    def _ready(self, stored: _Stored) -> torch.Tensor:
        gpu = stored.gpu
        assert gpu is not None
        if gpu.device.type == "cuda":
            compute = torch.cuda.current_stream(gpu.device)
            compute.wait_event(stored.loaded)
            gpu.record_stream(compute)  # allocated on the load stream, consumed on this one
        return gpu

    def close(self) -> None:
        """Give the store's memory back (``remove()``): what a later backward still needs stays readable."""
        self.store.close()

    def stats(self) -> dict[str, int]:
        return {**self.store.stats(), "offloaded_bytes": self.offloaded_bytes, "copies": self.copies,
                "loads": self.loads}


def _first_storages(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """Where the first few parameters' bytes live: when they moved, the model's state is listed again."""
    return tuple(ptr for t in tensors for ptr in storages(t))


def _fresh_engine(store: Store, min_bytes: int, device_test_mode: bool, model: nn.Module | None) -> OffloadEngine:
    engine = OffloadEngine(store, min_bytes=min_bytes, device_test_mode=device_test_mode)
    if model is not None:  # the copy of the watched model (deepcopy and pickle map it through their memo)
        engine.watch(model)
    return engine
