"""The one place that measures a training step: bench, advise, demo and the docs' scripts all use it.

Before this module each tool had its own loop, and they drifted: one warmed up twice, one reset
the peak before the warm-up, one timed a single step. A number in one table could not be set
beside a number in another. Now the protocol is written once:

* the step is one forward + backward (:func:`forward_backward`); the inputs' grads are dropped
  first, so every step allocates the same;
* ``warmup`` steps run outside the median (allocator, kernels, the pinned pool, compiled graphs);
  their times are kept apart (``Measurement.warmup_times_ms``): a compiled row's first step is its
  compile, which a user waits through and a table should say;
* the activation peak is ``max_memory_allocated`` over the timed steps minus what was allocated
  before them (weights, inputs, optimizer state are not activations);
* the step time is the median of the timed steps, each ended by a device synchronize; every
  timed step is kept (``Measurement.step_times_ms``), so a table can say how far apart they were
  and whether a difference between two rows is larger than that (:func:`noise`);
* host memory is what gradseam's pinned pool holds after the timed steps (the pool only grows,
  so that is its peak), and the pinned allocations it made after the warm-up (a healthy pool
  makes none). Not the CUDA host allocator's statistics: on torch 2.11 their peak did not reset
  between rows, so every row seemed to pin what all the rows before it had;
* on the CPU, where there is no allocator peak to read, the memory figure is the bytes autograd
  keeps between forward and backward, counted by saved-tensor hooks (:func:`count_saved_bytes`);
* on a GPU the forward's and the backward's peaks are also read on their own (:class:`Phases`):
  a fixed transient in the forward (Ideogram 4's 3.1 GiB at 1,024²) can set the whole step's peak
  at the shallow depths a fit measures and hide what the backward adds per block, which then
  surfaces only at the real depth (3.9 GiB at 34 blocks where the whole-step fit said 3.1). Each
  phase's own peak grows with depth on its own line, so the fit can see it;
* on a GPU each pass's own time is read too (``Measurement.forward_ms`` / ``backward_ms``): CUDA events
  recorded on the compute stream at the step's start, after the loss and after the backward, read once the
  step has synchronized, so the timing adds no synchronize of its own. A row that streams weights can be
  bound by the host link in one pass and not the other (the forward runs each block once, the backward twice
  with its recompute, against the same two copies of the block's weights), and the step's total cannot say which.
"""

from __future__ import annotations

import gc
import re
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..modules import grad_leaves, tensors
from ..offload.state import plain_parts, state_storages

GiB = 1 << 30
MiB = 1 << 20

# A row whose timed steps lie further apart than this fraction of their median says more about
# the machine than about the strategy: on the 2-core CI machine with other jobs running, the demo's
# rows scattered from 0.56x to 2.76x of no checkpointing between runs. On an idle machine its
# steps agree within a few percent, so a fifth is well clear of ordinary jitter.
NOISY_SPREAD = 0.2


def is_oom(exc: BaseException) -> bool:
    """Out of memory, GPU or pinned host: ``torch.OutOfMemoryError`` (or a class of that name), or
    the ``torch.AcceleratorError`` a failed pinned-host allocation raises ("out of memory"), which
    is not an OutOfMemoryError but means the same to a sweep: this row does not fit."""
    if any(k.__name__ == "OutOfMemoryError" for k in type(exc).__mro__):
        return True
    return type(exc).__name__ == "AcceleratorError" and "out of memory" in str(exc).lower()


_ALLOCATOR_WORDS = (
    re.compile(r"Tried to allocate [\d.]+ [KMGT]?i?B"),
    re.compile(r"this process has [\d.]+ [KMGT]?i?B memory in use"),
    re.compile(r"[\d.]+ [KMGT]?i?B is allocated by PyTorch, and [\d.]+ [KMGT]?i?B is reserved by PyTorch but unallocated"),
)


def oom_detail(exc: BaseException) -> str:
    """What an out-of-memory error says about where the memory went, in one line: GPU or pinned host, in the
    forward or the backward, how much was asked for and how much the process held (torch's own words), and
    gradseam's hint when it raised. A capped row that does not fit is then diagnosable from the JSON alone
    (HunyuanVideo 1.5 under 24 GiB read only "OOM" twice)."""
    text = str(exc)
    where = "pinned host memory" if type(exc).__name__ == "AcceleratorError" else "GPU"
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    phase = "backward" if {"_engine_run_backward", "backward"} & set(frames) else "forward"
    parts = [f"{where}, in the {phase}"]
    parts += [m.group(0) for pattern in _ALLOCATOR_WORDS if (m := pattern.search(text))]
    hint = next((line.strip() for line in text.splitlines() if line.strip().startswith("[gradseam]")), None)
    if hint:
        parts.append(hint)
    return "; ".join(parts)


def default_loss(out: Any) -> torch.Tensor:
    """``sum(t.float().square().mean())`` over the floating output tensors (the anchors' protocol)."""
    found = [t for t in tensors(out) if t.is_floating_point()]
    if not found:
        from ..errors import GradseamError

        raise GradseamError(f"the model output ({type(out).__name__}) holds no floating tensor to build a loss from.")
    return sum(t.float().square().mean() for t in found)  # type: ignore[return-value]


@contextmanager
def count_saved_bytes(model: nn.Module | None = None) -> Iterator[list[int]]:
    """Bytes of distinct storages autograd keeps from forward to backward, ``model``'s own state excluded.

    Around a non-reentrant checkpoint these hooks see only what the checkpoint keeps (its
    inputs), so the count is exactly what a strategy leaves in memory between the two passes.
    The model's state is told apart by storage and by type, as the offload engine tells it
    (:mod:`gradseam.offload.state`): Linear layers save ``weight.t()`` (a view of the parameter's
    bytes), a compiled block with quantized weights saves their inner tensors, plain tensors
    that are still the weights, and a parameter whose bytes moved since the count began (a streamed
    weight loaded for its block) is still a parameter.
    """
    state = state_storages([*model.parameters(), *model.buffers()]) if model is not None else set()
    seen: set[tuple[int, int]] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        # a parameter, or a view of one, is the model's state whatever its bytes are now (as the engine has
        # it): a streamed weight's loaded copy (gradseam.offload.weights), FSDP2's unsharded parameter
        weight = isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
        for part in () if weight else plain_parts(t):
            storage = part.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key[0] not in state and key not in seen and storage.nbytes() > 0:
                seen.add(key)
                total[0] += storage.nbytes()
        # Not ``t`` itself: a saved output holding itself would form a cycle through autograd's C++
        # graph that Python's GC cannot see, leaking every graph that backward never frees. With its
        # version: autograd checks a saved tensor's version only when no hook packed it, so without
        # this a reference step measured here would train on after an in-place edit autograd refuses.
        return t.detach(), t._version

    def unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
        t, version = packed
        if t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a {tuple(t.shape)} {t.dtype} tensor saved at version {version} is at version "
                f"{t._version} (seen by gradseam's saved-bytes count, as autograd would see it)")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield total


@dataclass(frozen=True)
class Phases:
    """The allocator's peak (bytes, as ``torch.cuda.max_memory_allocated`` reads) in one step's
    forward (loss included) and, counted from the end of that forward, in its backward."""

    forward: int
    backward: int
    # CUDA events at the step's start, after its loss and after its backward (None where the inputs are not on a
    # GPU): read after the step synchronizes, they give each pass's time on the compute stream
    events: tuple[Any, Any, Any] | None = field(default=None, compare=False)

    def pass_times_ms(self) -> tuple[float, float] | None:
        """(forward, backward) in ms from the events; call only after the device has synchronized."""
        if self.events is None:
            return None
        start, middle, end = self.events
        return start.elapsed_time(middle), middle.elapsed_time(end)


def forward_backward(
    model: nn.Module,
    inputs: Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    count_saved: bool = False,
    phases: bool | None = None,
) -> Callable[[], int | Phases]:
    """One forward + backward of ``model(**inputs)``.

    The step returns the saved bytes when ``count_saved``; else, with ``phases`` (default: when an
    input is on a CUDA device), the :class:`Phases` peaks, read by resetting the allocator's peak
    between the two passes (host-side bookkeeping, no device synchronize); else 0.
    :func:`measure` takes the whole step's peak from those, so the reset loses nothing.
    """
    loss_fn = loss_fn or default_loss
    leaves = grad_leaves(inputs)
    on_gpu = any(t.is_cuda for t in tensors(dict(inputs)))
    if phases is None:
        phases = not count_saved and on_gpu

    def event() -> Any:  # None off the GPU: no pass times there
        if not on_gpu:
            return None
        made = torch.cuda.Event(enable_timing=True)
        made.record()  # on the current (compute) stream: no synchronize
        return made

    def step() -> int | Phases:
        for t in leaves:
            t.grad = None
        if phases:
            start = event()
            loss = loss_fn(model(**inputs))
            middle = event()
            forward = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
            end = event()
            backward = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            return Phases(forward, backward, (start, middle, end) if on_gpu else None)
        if not count_saved:
            loss_fn(model(**inputs)).backward()
            return 0
        with count_saved_bytes(model) as saved:
            out = model(**inputs)
        loss_fn(out).backward()
        return saved[0]

    return step


@dataclass
class Measurement:
    """What one strategy did on one workload: memory on the device, time, memory on the host."""

    peak_gib: float  # activation peak (GPU) or GiB kept for backward (CPU)
    step_ms: float
    pinned_gib: float = 0.0  # pinned host memory gradseam's pool holds (0 for a row without one)
    pinned_allocations_after_warmup: int | None = None  # None: no gradseam pool in the row
    base_gib: float = 0.0  # allocated before the timed steps (weights, inputs, optimizer state)
    step_times_ms: tuple[float, ...] = field(default=())  # every timed step, in order; step_ms is their median
    # GPU steps made by forward_backward: each pass's own activation peak (peak_gib is the larger)
    forward_peak_gib: float | None = None
    backward_peak_gib: float | None = None
    warmup_times_ms: tuple[float, ...] = field(default=())  # the untimed warm-up steps' times (the first compiles)
    # GPU steps made by forward_backward: the median of each pass's own time on the compute stream (CUDA events)
    forward_ms: float | None = None
    backward_ms: float | None = None
    # GPU steps: how often the caching allocator retried over the timed steps (each retry frees its cache and
    # synchronizes the device to find room: under a memory cap, a step with one runs slower than the others)
    alloc_retries: int | None = None

    @property
    def spread(self) -> float | None:
        """(slowest - fastest) / median of the timed steps; None with fewer than two."""
        return spread(self.step_times_ms)


def spread(times: Sequence[float]) -> float | None:
    """How far apart repeated timings of one step lie: ``(max - min) / median``; None for fewer than
    two timings (one step says nothing about the scatter) or a zero median."""
    if len(times) < 2:
        return None
    middle = statistics.median(times)
    return (max(times) - min(times)) / middle if middle > 0 else None


def noise(times: Sequence[float], reference: Sequence[float], *, recomputes: bool = True) -> str | None:
    """Why a row's step time cannot be read against the reference row's (no checkpointing), or None.

    ``times`` and ``reference`` are the two rows' timed steps. A ratio of medians means something only
    where the steps of each row agree with each other better than the rows differ, so a row is noise
    when

    * either row was timed in a single step: there is no spread to compare the difference with
      ("single step");
    * the row's timed steps lie more than :data:`NOISY_SPREAD` of their median apart ("scattered"),
      or the reference's do ("reference scattered");
    * the two rows' timed steps overlap: some step of the row was as fast as some step of the
      reference and another as slow ("overlaps");
    * the row is faster than the reference although it does more work (``recomputes``: a
      checkpointed row runs a forward again, an offloaded one copies): that is the machine, not the
      strategy ("faster than none").

    Every cause that holds is named, joined by ", " in that order (:func:`causes` splits them), so the
    line under the table can give every reason a row was marked. Pure logic on the lists, so it is
    tested on made-up timings rather than on a timed run.
    """
    if not times or not reference:
        return None
    found = []
    if len(times) < 2 or len(reference) < 2:
        found.append("single step")
    for cause, got in (("scattered", times), ("reference scattered", reference)):
        scatter = spread(got)
        if scatter is not None and scatter > NOISY_SPREAD:
            found.append(cause)
    if (len(times) > 1 or len(reference) > 1) and min(times) <= max(reference) and min(reference) <= max(times):
        found.append("overlaps")
    if recomputes and statistics.median(times) < statistics.median(reference):
        found.append("faster than none")
    return ", ".join(found) or None


def causes(mark: str | None) -> list[str]:
    """The causes in a mark of :func:`noise` / :func:`noise_marks` (none for None)."""
    return mark.split(", ") if mark else []


def noise_marks(rows: Sequence[Sequence[float]], reference: int = 0) -> list[str | None]:
    """:func:`noise` for every row of a table against its reference row (no checkpointing).

    The reference row is only judged on its own scatter (it cannot overlap itself, and its ratio is
    1 by definition, single step or not); every other row is taken to do more work than it, which
    holds for every strategy the demo and bench's CPU table show (recompute or copies, never less work).
    """
    ref = rows[reference] if rows else ()
    marks: list[str | None] = []
    for i, times in enumerate(rows):
        if i == reference:
            scatter = spread(times)
            marks.append("scattered" if scatter is not None and scatter > NOISY_SPREAD else None)
        else:
            marks.append(noise(times, ref))
    return marks


_NOISE_CAUSES = {
    "single step": "it was timed in a single step (--steps 1), so there is no spread to tell its time from noise",
    "scattered": f"its timed steps lie more than {NOISY_SPREAD:.0%} of their median apart",
    "reference scattered": f"no checkpointing's timed steps lie more than {NOISY_SPREAD:.0%} of their median apart",
    "overlaps": "its timed steps overlap those of no checkpointing",
    "faster than none": "it ran faster than no checkpointing, which does less work",
}


def noise_note(marks: Sequence[str | None], exact: str = "the memory and gradient columns") -> str | None:
    """The one sentence a table prints under rows :func:`noise_marks` marked, or None if none is.

    A newcomer reads "0.56x" as "checkpointing is faster"; this says plainly that the times are the
    machine's noise, every reason a row was marked, and which figures do not depend on it (``exact``).
    """
    seen = {cause for mark in marks for cause in causes(mark)}
    if not seen:
        return None
    listed = "; ".join(_NOISE_CAUSES[c] for c in _NOISE_CAUSES if c in seen)
    return (f"* step time within noise ({listed}): on this machine these timings cannot tell the marked rows "
            f"from no checkpointing, so trust {exact}, which are exact, and compare speed on an idle machine or "
            "with more --steps.")


def spread_line(steps: int) -> str:
    """The line under a table with a spread column, saying what the spread is (or that there is none)."""
    if steps < 2:
        return ("spread: none, each row was timed in a single step (--steps 1); its ratios are one step against "
                "one step, marked *.")
    return f"spread: (slowest - fastest) / median of the {steps} timed steps."


@contextmanager
def recorded() -> Iterator[list[Measurement]]:
    """Collect every :class:`Measurement` that :func:`measure` returns inside the block, in order.

    For callers that see a sweep's results but not its measurements (``gradseam bench`` gets rows
    from :mod:`gradseam.tools.bench`, whose records keep only the median): the last entry is the
    measurement of the row just reported.
    """
    log: list[Measurement] = []
    _recorders.append(log)
    try:
        yield log
    finally:
        _recorders.remove(log)


_recorders: list[list[Measurement]] = []


def measure(
    step: Callable[[], Any], *, steps: int = 3, warmup: int = 1, device: str = "cuda", engine: Any = None,
) -> Measurement:
    """Warm up, time ``steps`` steps, read the peaks (the protocol in this module's docstring).

    On ``device="cpu"`` ``step`` must return the bytes it kept for backward (see
    :func:`forward_backward` with ``count_saved=True``); the largest count is reported.
    ``engine``: a patch handle's offload engine, to count the pinned allocations after warm-up.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1 (the median of the timed steps is reported), got {steps}.")
    began = torch.cuda.memory_allocated() if device != "cpu" and torch.cuda.is_available() else None
    try:
        return _measure(step, steps, warmup, device, engine)
    except BaseException as exc:
        if is_oom(exc):
            drop_frames(exc)
            if began is not None:
                setattr(exc, BEGAN_WITH, began)
        raise


# The attribute an out-of-memory error raised while measuring carries: the bytes allocated when the first step began
BEGAN_WITH = "gradseam_allocated_when_measuring_began"


def allocated_when_measuring_began(exc: BaseException) -> float | None:
    """The GiB allocated on the GPU when the measurement that raised ``exc`` began (None: not known). An out-of-memory
    error names what was allocated when it failed; only this tells a step that filled the GPU itself from one that
    began beside memory it did not make (why it was added: :class:`LeftBehind`)."""
    began = getattr(exc, BEGAN_WITH, None)
    return began / GiB if began is not None else None


def drop_frames(exc: BaseException) -> None:
    """Clear the local variables of the finished frames ``exc`` (and the exceptions it chains) holds.

    Why: until an exception is handled, its traceback keeps every frame it passed through alive, and with them a
    failed step's activations. What runs while it unwinds then finds the GPU as full as when it failed: a patch's
    ``remove()`` putting streamed weights back on the GPU ran out of memory itself there and left the model
    half-restored, so every later row of the sweep failed too (issue 41's Wan 2.1 14B run). Where it was raised
    (file, line, function) stays readable; only the frames' variables go."""
    import traceback

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)  # skips the frames still running (the callers)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]


def _measure(step: Callable[[], Any], steps: int, warmup: int, device: str, engine: Any) -> Measurement:
    cuda = device != "cpu"
    warmups = []
    for _ in range(warmup):
        # timed too: a compiled row's first step is its compile, which a user waits through
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        warmups.append((time.perf_counter() - start) * 1000)
    # the engine's store (its pinned pool); no getattr default, so a renamed attribute fails loudly instead of
    # reporting 0 GiB pinned (as it once did)
    pool = engine.store if engine is not None else None
    allocations_before = pool.stats()["pinned_allocations"] if pool is not None else None
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        retries_before = alloc_retries()
    times, kept = [], []
    for _ in range(steps):
        start = time.perf_counter()
        kept.append(step())
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    allocations = pool.stats()["pinned_allocations"] - allocations_before if pool is not None else None
    forward = backward = forward_ms = backward_ms = None
    if cuda:
        if all(isinstance(k, Phases) for k in kept):
            # the step reset the allocator's peak between its passes: the whole peak is the larger one
            forward = (max(k.forward for k in kept) - base) / GiB
            backward = (max(k.backward for k in kept) - base) / GiB
            peak = max(forward, backward)
            passes = [k.pass_times_ms() for k in kept]  # every step synchronized above: the events are done
            if all(p is not None for p in passes):
                forward_ms = statistics.median(p[0] for p in passes)  # type: ignore[index]
                backward_ms = statistics.median(p[1] for p in passes)  # type: ignore[index]
        else:
            peak = (torch.cuda.max_memory_allocated() - base) / GiB
        pinned = pool.stats()["pinned_bytes"] / GiB if pool is not None else 0.0
    else:
        peak = max(int(k or 0) for k in kept) / GiB
        pinned = 0.0
    got = Measurement(peak, statistics.median(times), pinned, allocations, base / GiB if cuda else 0.0,
                      tuple(times), forward, backward, tuple(warmups), forward_ms, backward_ms,
                      alloc_retries() - retries_before if cuda else None)
    for log in _recorders:
        log.append(got)
    return got


def alloc_retries() -> int:
    """The caching allocator's retries so far in this process (``num_alloc_retries``; the peak resets leave it).

    Why bench reads it: on an H100 two of five steps of Flux dev 4k under a 16 GiB cap took ~1.1 s against ~0.6,
    and neither the median nor the peak said why; a profile of the same row on an H200 counted 0.4 retries a step."""
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


def context_lost(device: str = "cuda") -> bool:
    """Whether an error left the device unusable: an illegal memory access (seen in torch's
    ``save_on_cpu`` on the H200) poisons the CUDA context for the rest of the process, and every
    later call fails with the same error."""
    if device == "cpu" or not torch.cuda.is_available():
        return False
    try:
        torch.cuda.synchronize()
    except Exception:  # the sticky error comes back as AcceleratorError (RuntimeError on older torch)
        return True
    return False


def release(device: str = "cuda") -> None:
    """Drop what the last row left behind, so the next row starts from the same allocator state."""
    gc.collect()
    if device != "cpu" and torch.cuda.is_available():
        torch.cuda.empty_cache()
        # Pinned blocks torch's own host allocator cached (``save_on_cpu``'s, a DataLoader's) would
        # otherwise stay pinned beside the next row's; torch builds without CUDA lack the call.
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()


# What a measured row may leave allocated on the GPU after it (the first matmul's cuBLAS workspace, a few MiB of
# compiled kernels' state) before a tool stops measuring (:class:`LeftBehind`): far below a block's activations
LEFT_BEHIND_BYTES = 256 << 20


def state_bytes_on(model: Any, device: Any) -> int:
    """The bytes of ``model``'s parameters, buffers and gradients on ``device`` (each storage once; a quantized weight's
    inner and side tensors included, :func:`gradseam.offload.state.state_parts`): what a row may leave there that is not
    its own, since a parking session or a lent block moves weights on and off the GPU between rows, and a measured
    backward leaves gradients."""
    from ..offload.state import state_bytes

    params = list(model.parameters())
    return state_bytes([*params, *model.buffers(), *(p.grad for p in params if p.grad is not None)], device)


def compute_device(model: Any) -> torch.device:
    """Where the model runs: its first parameter not in host memory (a streamed block's weights are), else the CPU."""
    return next((p.device for p in model.parameters() if p.device.type != "cpu"), torch.device("cpu"))


def allocated_beside(model: Any) -> int | None:
    """The bytes allocated on ``model``'s GPU (:func:`compute_device`) now beside the model's own state there
    (:func:`state_bytes_on`), or None for a model off a GPU (nothing to read)."""
    device = compute_device(model)
    if device.type != "cuda":
        return None
    return torch.cuda.memory_allocated(device) - state_bytes_on(model, device)


@dataclass
class LeftBehind:
    """Stops a tool's run of measured rows at the first that leaves GPU memory allocated that was not before it.

    Every row of ``auto``'s cost table and of ``advise``'s ladder is measured from the memory the first found. One
    that leaves some of its own allocated (a failed step's activations still referenced, a block's weights left on
    the GPU) has each later row measured beside it, run out of memory beside it, and compared (or cached) so. Why it
    exists: on an H100 every one of 28 candidates of ``"auto"`` for Wan 2.1 14B under 12 GiB ran out of memory with
    11.3 to 11.9 GiB allocated (ten of them at 11.59 GiB exactly, eager and compiled, whole-block and FFN alike),
    where the same streamed row measured alone peaked at 9.6 GiB; what each candidate's step began beside was not
    recorded then. ``who`` names the tool in the error, ``then`` says what stopping leaves the user with."""

    model: Any
    who: str
    then: str

    def before(self) -> int | None:
        """What is allocated beside the model's state as a row starts (None off a GPU)."""
        return allocated_beside(self.model)

    def check(self, label: str, before: int | None, *, failed: bool) -> None:
        """Raise :class:`gradseam.errors.GradseamError` where ``label``'s row (``failed``: it ran out of memory) left
        more than :data:`LEFT_BEHIND_BYTES` allocated beside the model's state (off a GPU, where ``before`` is None,
        nothing is read)."""
        from ..errors import GradseamError

        if failed:  # the failed step's tensors are free once its frames are gone: give them back before reading
            release("cuda")
        if before is None:
            return
        after = allocated_beside(self.model)
        if after is None or after - before <= LEFT_BEHIND_BYTES:
            return
        oom = " after it ran out of memory" if failed else ""
        raise GradseamError(
            f"{self.who}: measuring {label}{oom} left {(after - before) / GiB:.2f} GiB allocated on the GPU that was "
            f"not before it ({before / GiB:.2f} GiB before, {after / GiB:.2f} GiB after its memory was released). "
            f"Every candidate after it would be measured beside that memory, so measuring stops here; {self.then}. "
            "This is a bug in gradseam or in what the model's forward keeps (a module holding a tensor of its last "
            "call): please report it with this message.")
