"""Side-by-side measurements of strategies: activation peak, step time and host memory, on the real GPU.

The reference rows run in the same process as gradseam's rows, so every comparison shares one
machine state: no checkpointing, what users write by hand (``torch.utils.checkpoint``, a naive
unsloth-style checkpoint, ``save_on_cpu``), diffusers' own flag, and ``torch.compile`` with the
compiler's activation memory budget (:mod:`gradseam.tools.compiled`). The protocol is the one in
:mod:`gradseam.tools.measure`.

A family's real-size model (:func:`real`) is measured at two depths and its peaks, pinned host
memory and step times are fitted per unit of depth (:mod:`gradseam.tools.depth`), so the figure a
user reads first is the one at the model's real depth: measured with ``full=True`` where the full
model fits, predicted and marked otherwise. The synthetic stack (:func:`synthetic`) has no real
depth beyond its own: its rows are measured at the depth asked for.

Without CUDA (or with ``device="cpu"``) the workloads run on the CPU in float32 at a small size
(:data:`CPU_SHAPES`): the rows that only use torch are measured, and the memory column is the bytes
autograd keeps between forward and backward (see :func:`gradseam.tools.measure.count_saved_bytes`),
not an allocator peak. Rows that copy to pinned host memory are reported as ``"needs CUDA"``; kept
attention kernels and compiled rows, which run on the CPU too, as ``"not measured on the CPU (...)"``
(:data:`gradseam.tools.bench_rows.CPU_STATUS_WHY` says why, and the CPU table prints it).
The JSON it writes is described in :mod:`gradseam.tools.bench_report`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradseam

from ..family import Family
from . import measure as measuring
from .bench_rows import (
    DIFFUSERS_ROW,
    GPU_CAP_KEY,
    NAIVE_KEY,
    NEEDS_CUDA,
    STREAM_SUFFIX,
    cpu_status,
    full_depth_rows,
    is_auto_row,
    is_config_row,
    real_rows,
    streamed_count,
    streams_weights,
    synthetic_rows,
)
from .compiled import applied, compiles, gradseam_keys
from .depth import at_depth
from .parking import parking
from .results import RealRun, Result

GiB = measuring.GiB

# Rows the CPU mode cannot measure because they need a GPU (offload); the others it leaves out say
# why in their status (bench_rows.cpu_status: kept kernels escape its count, compiling is a GPU matter).
CUDA_ONLY_ROWS = frozenset(label for label, _ in [*synthetic_rows(), *real_rows()] if cpu_status(label) == NEEDS_CUDA)
# every row the CPU mode leaves out, with its status
CPU_SKIPPED = {label: status for label, _ in [*synthetic_rows(), *real_rows()] if (status := cpu_status(label))}


# -- reference strategies (hand-written, as users write them today) ----------------------------


class DeviceLostError(gradseam.GradseamError):
    """A row broke the CUDA context (an illegal memory access): no later row can run in this process."""

    def __init__(self, row: str, cause: BaseException) -> None:
        super().__init__(
            f"row {row!r} broke the GPU's context ({type(cause).__name__}: {str(cause).splitlines()[0]}), so "
            f"no later row can run in this process; the rows measured so far are in the JSON. Run again "
            f"without it: --skip-row {row!r}."
        )
        self.row = row


class _NaiveUnsloth(torch.autograd.Function):
    """Checkpoint a block, keeping its input in a pinned buffer copied on the compute stream."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, block: nn.Module, buffers: dict[int, torch.Tensor]) -> torch.Tensor:
        buf = buffers.get(id(block))
        if buf is None or buf.shape != x.shape:
            buf = buffers[id(block)] = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        buf.copy_(x, non_blocking=True)
        ctx.block, ctx.buf, ctx.device = block, buf, x.device
        with torch.no_grad():
            return block(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        x = ctx.buf.to(ctx.device, non_blocking=True).requires_grad_(True)
        with torch.enable_grad():
            out = ctx.block(x)
        torch.autograd.backward(out, grad)
        return x.grad, None, None


class _ReferenceWrap(nn.Module):
    """Wraps each block of a list with a hand-written reference strategy (for comparison rows)."""

    def __init__(self, block: nn.Module, mode: str, buffers: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.block, self.mode, self.buffers = block, mode, buffers

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.mode == "checkpoint":
            return checkpoint(self.block, *args, use_reentrant=False, **kwargs)
        (x,) = args  # the naive unsloth row is only defined for single-input blocks
        return _NaiveUnsloth.apply(x, self.block, self.buffers)


@contextmanager
def reference(model: nn.Module, blocks_attr: str, mode: str, submodule: str | None = None) -> Iterator[None]:
    """Wrap every block (or its ``submodule``, e.g. the FFN) with a hand-written reference strategy."""
    blocks = getattr(model, blocks_attr)
    owners = [b._modules for b in blocks] if submodule else [blocks._modules] * len(blocks)
    keys = [submodule] * len(owners) if submodule else list(blocks._modules)
    original = [owner[key] for owner, key in zip(owners, keys)]
    buffers: dict[int, torch.Tensor] = {}
    for owner, key, module in zip(owners, keys, original):
        owner[key] = _ReferenceWrap(module, mode, buffers)
    try:
        yield
    finally:
        for owner, key, module in zip(owners, keys, original):
            owner[key] = module


def _strategy_context(
    model: nn.Module, name: str, config: dict[str, Any] | None, blocks_attr: str,
    compile_blocks: list[nn.Module] | None,
) -> Any:
    if is_config_row(config):  # a user's own config (--config-row): patched as a trainer would, whatever its keys
        return gradseam.patch(model, gradseam_keys(config))  # turn on (applied() patches only a top-level switch)
    if config is not None:  # gradseam's rows and the compiler's, whose configs say what to compile
        return applied(model, config, compile_blocks)
    if name == "none":
        return nullcontext()
    if name == "ref: torch.utils.checkpoint":
        return reference(model, blocks_attr, "checkpoint")
    if name == "ref: torch.utils.checkpoint (FFN)":
        return reference(model, blocks_attr, "checkpoint", submodule="ffn")
    if name == "ref: naive unsloth":
        return reference(model, blocks_attr, "naive-unsloth")
    if name == "ref: save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    if name == DIFFUSERS_ROW:
        return _diffusers_checkpointing(model)
    raise ValueError(f"unknown strategy {name!r}")


@contextmanager
def _diffusers_checkpointing(model: nn.Module) -> Iterator[None]:
    enable = getattr(model, "enable_gradient_checkpointing", None)
    if enable is None or not getattr(model, "_supports_gradient_checkpointing", False):
        raise gradseam.UnsupportedStrategyError(f"{type(model).__name__} has no diffusers gradient checkpointing")
    enable()
    try:
        yield
    finally:
        model.disable_gradient_checkpointing()


def _gib(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None


def _ms(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def _compiles(handle: Any) -> bool:
    """Whether a patch compiles any of its blocks, read from what it installed (a per-block entry may compile where
    the top-level keys do not): such a row warms up twice, its second call of a block may compile again."""
    return handle is not None and any(kind.compiles for kind in handle.plan.kinds)


@dataclass(frozen=True)
class _Sweep:
    """What every row of one :func:`run_rows` call shares: the workload's words and the model to measure."""

    workload: str
    tokens: int
    model: nn.Module
    make_step: Callable[[], Callable[[], Any]]
    steps: int
    blocks_attr: str
    device: str
    compile_blocks: list[nn.Module] | None
    depth: int | None
    blocks: str | None
    gpu_cap_gib: float | None = None
    host_gib: float | None = None  # the auto rows' host memory budget (None: the planner's default)

    def unmeasured(self, name: str, status: str) -> Result:
        """The row ``name`` with a status and no figures."""
        return Result(self.workload, self.tokens, name, None, None, status, depth=self.depth, blocks=self.blocks)


def run_rows(
    workload: str,
    tokens: int,
    model: nn.Module,
    make_step: Callable[[], Callable[[], Any]],
    rows: list[tuple[str, dict[str, Any] | None]],
    *,
    steps: int = 5,
    blocks_attr: str = "blocks",
    on_row: Callable[[Result], None] | None = None,
    device: str = "cuda",
    compile_blocks: list[nn.Module] | None = None,
    rule_out: Callable[[str], str | None] | None = None,
    depth: int | None = None,
    blocks: str | None = None,
    gpu_cap_gib: float | None = None,
    host_gib: float | None = None,
) -> list[Result]:
    """Measure every row on ``model``; a failing cell becomes a row with a status, never an exception.

    On ``device="cpu"`` the steps made by ``make_step`` return their saved bytes and the rows the CPU
    mode does not measure are reported with their status (:func:`gradseam.tools.bench_rows.cpu_status`).
    ``rule_out(name)`` may return why a row must not run (say, it would need more pinned host memory
    than the machine has); the row is then reported with that reason instead of being tried. A row
    that breaks the GPU's context ends the sweep with :class:`DeviceLostError`, after it is reported.
    ``gpu_cap_gib``: each row's steps run with the process limited to this much GPU memory (a smaller card).
    ``host_gib``: the host memory budget the ``auto`` rows plan within.
    """
    sweep = _Sweep(workload, tokens, model, make_step, steps, blocks_attr, device, compile_blocks, depth, blocks,
                   gpu_cap_gib, host_gib)
    results: list[Result] = []

    def report(result: Result) -> None:
        results.append(result)
        if on_row is not None:
            on_row(result)

    for name, config in rows:
        reason = (cpu_status(name, config) if device == "cpu" else None) or (rule_out(name) if rule_out else None)
        if reason is not None:
            report(sweep.unmeasured(name, reason))
            continue
        try:
            result = _measure_row(sweep, name, config)
        except Exception as exc:  # one broken cell must not lose the sweep; the row says what broke
            failed = sweep.unmeasured(name, _failure(exc))
            if measuring.is_oom(exc):
                failed.failure = measuring.oom_detail(exc)
            failed.plan = getattr(exc, PLAN_ATTRIBUTE, None)  # an auto row's plan, where it had one
            report(failed)
            if _context_lost(exc, device):
                raise DeviceLostError(name, exc) from exc
            continue
        report(result)
    return results


def _measure_row(sweep: _Sweep, name: str, config: dict[str, Any] | None) -> Result:
    """One row, measured: the strategy applied, ``sweep.steps`` timed steps (two warm-ups where it compiles)."""
    measuring.release(sweep.device)
    # bench's own keys (a row's cap, the naive reference): gradseam_keys() leaves them out of the patch
    cap = (config or {}).get(GPU_CAP_KEY, sweep.gpu_cap_gib)
    if is_auto_row(name):
        return _measure_auto(sweep, name, dict(config or {}), cap)
    naive = bool((config or {}).get(NAIVE_KEY))
    step = None
    try:
        ctx = _strategy_context(sweep.model, name, config, sweep.blocks_attr, sweep.compile_blocks)
        with ctx:
            step = sweep.make_step()
            handle = getattr(ctx, "handle", None) or gradseam.handle_of(sweep.model)
            if naive:
                handle.weights.naive = True
            compiled = compiles(config) or _compiles(handle)
            with capped(cap):
                got, streamed_pinned = _timed(sweep, step, handle, compiled)
    finally:
        step = None  # the step holds the model's activations: drop it before the next row, even on failure
    return _result(sweep, name, got, streamed_pinned, pinned=name != "ref: save_on_cpu",
                   first_step_ms=got.warmup_times_ms[0] if compiled and got.warmup_times_ms else None,
                   config=gradseam_keys(config) if is_config_row(config) else None)


def _timed(sweep: _Sweep, step: Callable[[], Any], handle: Any, compiled: bool) -> tuple[measuring.Measurement, float | None]:
    """``sweep.steps`` timed steps after the warm-ups (two where blocks compile: the second call may compile again),
    and the GiB the patch's streamed weights pin (None where nothing streams). ``measuring.measure`` is looked up
    per call, so tests can replace it."""
    got = measuring.measure(step, steps=sweep.steps, warmup=2 if compiled else 1, device=sweep.device,
                            engine=getattr(handle, "engine", None))
    stream = getattr(handle, "weights", None)
    return got, stream.pinned_bytes / GiB if stream is not None else None


def _result(sweep: _Sweep, name: str, got: measuring.Measurement, streamed_pinned: float | None, *, pinned: bool = True,
            first_step_ms: float | None = None, plan: dict[str, Any] | None = None,
            config: dict[str, Any] | None = None) -> Result:
    """A measured row. ``streamed_pinned``: the GiB its streamed weights pin (None: nothing streams), counted in its
    pinned host memory too; ``pinned=False``: a row whose pinned memory is not the engine's to read (save_on_cpu);
    ``config``: a ``--config-row`` row's gradseam keys, as its file gave them."""
    cpu = sweep.device == "cpu"
    # CPU counts are small (KiB to MiB): keep them to the byte
    return Result(sweep.workload, sweep.tokens, name, round(got.peak_gib, 9 if cpu else 3), round(got.step_ms, 1),
                  pinned_allocations_after_warmup=got.pinned_allocations_after_warmup,
                  pinned_gib=None if cpu or not pinned else round(got.pinned_gib + (streamed_pinned or 0.0), 3),
                  pinned_weights_gib=None if cpu or streamed_pinned is None else round(streamed_pinned, 3),
                  depth=sweep.depth, blocks=sweep.blocks,
                  forward_peak_gib=_gib(got.forward_peak_gib), backward_peak_gib=_gib(got.backward_peak_gib),
                  forward_ms=_ms(got.forward_ms), backward_ms=_ms(got.backward_ms),
                  first_step_ms=round(first_step_ms, 1) if first_step_ms is not None else None,
                  gpu_peak_gib=None if cpu else round(got.base_gib + got.peak_gib, 3), plan=plan, config=config,
                  alloc_retries=got.alloc_retries)


def _measure_auto(sweep: _Sweep, name: str, config: dict[str, Any], cap: float | None) -> Result:
    """The ``auto`` row as a user runs it: patched with ``"auto"``, the GPU budget its cap (or the planner's default)
    and the host budget bench's; the first step plans (its time, measuring included, is ``first_step_ms``), then the
    plan warms up (twice where it compiles) and ``sweep.steps`` steps are timed. A model whose weights are more than
    the GPU budget is patched on the CPU and then moved, as it would be loaded (built on the GPU, it could never
    start under the cap); it goes back to the GPU after."""
    keys = gradseam_keys(config)
    if cap is not None:
        keys["gradient_checkpointing_gpu_memory"] = cap
    if sweep.host_gib is not None:
        keys["gradient_checkpointing_host_memory"] = sweep.host_gib
    model = sweep.model
    device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device(sweep.device))
    via_cpu = device.type == "cuda" and _larger_than_gpu(model, cap)
    step = None
    handle = None
    try:
        if via_cpu:
            model.to("cpu")
            measuring.release(sweep.device)
        handle = gradseam.patch(model, keys)
        if via_cpu:
            if handle.weights is None:
                raise gradseam.GradseamError("auto: the model on the CPU was not streamed from patch time")
            model.to(device)
        with capped(cap):
            step = sweep.make_step()
            start = time.perf_counter()
            step()  # planned inside this step's forward
            if sweep.device != "cpu":
                torch.cuda.synchronize()
            planning_ms = (time.perf_counter() - start) * 1000
            planned = handle.auto.planned
            assert planned is not None, "auto did not plan at the first training step"
            # the plan installed, block by block
            got, streamed_pinned = _timed(sweep, step, handle, _compiles(handle))
    except Exception as exc:
        # a plan that fails its steps (out of memory, above all) is what the row must show: its keys and prediction
        planned = handle.auto.planned if handle is not None and handle.auto is not None else None
        if planned is not None:
            setattr(exc, PLAN_ATTRIBUTE, _plan_record(planned))
        raise
    finally:
        step = None
        if handle is not None:
            handle.remove()
        if via_cpu:
            model.to(device)
    return _result(sweep, name, got, streamed_pinned, first_step_ms=planning_ms, plan=_plan_record(planned))


PLAN_ATTRIBUTE = "gradseam_bench_plan"  # set on an auto row's exception: the plan it was running, for the row


def _plan_record(planned: Any) -> dict[str, Any]:
    """An ``auto`` row's plan as its JSON holds it (``plan``): its keys, the report, predicted and checked figures."""
    return {"source": planned.source, "config": planned.config.to_dict(), "report": planned.report,
            "predicted": planned.predicted, "checked": planned.measured}


def _larger_than_gpu(model: nn.Module, cap: float | None) -> bool:
    """Whether ``model``'s weights are more than the GPU memory the row runs on (its cap, or the whole GPU)."""
    from .bases import weight_bytes

    budget = cap if cap is not None else torch.cuda.get_device_properties(next(model.parameters()).device).total_memory / GiB
    return weight_bytes(model) / GiB > budget


@contextmanager
def capped(gib: float | None) -> Iterator[None]:
    """The process limited to ``gib`` of GPU memory (``torch.cuda.set_per_process_memory_fraction``), as on a
    card that size; the limit is lifted again afterwards, so patching and ``remove()`` (which brings streamed
    weights back) run on the whole GPU. What the model already holds counts against the limit."""
    if gib is None:
        yield
        return
    total = torch.cuda.get_device_properties(0).total_memory
    measuring.release("cuda")  # what patching freed (streamed weights) leaves the cache: the cap counts it
    torch.cuda.set_per_process_memory_fraction(min(gib * GiB / total, 1.0))
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def _failure(exc: Exception) -> str:
    """A failed row's status: unsupported (and why), OOM, or the error."""
    if isinstance(exc, gradseam.UnsupportedStrategyError):
        return f"unsupported: {exc}"
    return "OOM" if measuring.is_oom(exc) else f"error: {type(exc).__name__}: {exc}"[:300]


def _context_lost(exc: Exception, device: str) -> bool:
    """Whether a row's error broke the GPU's context, so that no later row can run in this process."""
    if isinstance(exc, gradseam.UnsupportedStrategyError) or measuring.is_oom(exc):
        return False
    return measuring.context_lost(device)


# -- the synthetic workload ---------------------------------------------------------------------

SYNTHETIC_SHAPES = [(8, 1024, 3072), (8, 4096, 3072), (8, 16384, 3072), (32, 3072, 4096)]
# (blocks, tokens, dim) on the CPU: seconds, not minutes, for the whole sweep
CPU_SHAPES = [(2, 256, 256)]
CPU_STEPS = 2


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def synthetic(
    shapes: list[tuple[int, int, int]] | None = None,
    rows: list[str] | None = None,
    steps: int | None = None,
    on_row: Callable[[Result], None] | None = None,
    device: str | None = None,
    threads: int | None = None,
) -> list[Result]:
    """Every row on the synthetic stack: bf16 on the GPU, or float32 at :data:`CPU_SHAPES` on the CPU.

    ``threads``: torch's CPU threads for the sweep (restored after it); None keeps torch's setting.
    On a small or busy machine one thread gives steadier times than one per core (see the demo).
    """
    device = device or default_device()
    if threads is not None and device == "cpu":
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return synthetic(shapes, rows, steps, on_row, device)
        finally:
            torch.set_num_threads(before)
    from .synthetic import SyntheticStack, ensure_registered

    cpu = device == "cpu"
    if shapes is None:
        shapes = CPU_SHAPES if cpu else SYNTHETIC_SHAPES
    if steps is None:
        steps = CPU_STEPS if cpu else 5
    dtype = torch.float32 if cpu else torch.bfloat16
    ensure_registered()
    chosen = synthetic_rows(rows)
    results = []
    for blocks, tokens, dim in shapes:
        torch.manual_seed(0)
        with torch.device(device):
            model = SyntheticStack(blocks, dim).to(dtype).requires_grad_(False)
        x = torch.randn(1, tokens, dim, device=device, dtype=dtype)
        inputs = {"hidden_states": x.requires_grad_(True)}

        def make_step(model: nn.Module = model, inputs: dict[str, Any] = inputs) -> Callable[[], Any]:
            return measuring.forward_backward(model, inputs, count_saved=cpu)

        workload = f"synthetic {blocks}x{tokens}x{dim}"
        results += run_rows(workload, tokens, model, make_step, chosen, steps=steps, on_row=on_row, device=device)
        del model, x
    return results


def synthetic_title(device: str) -> str:
    if device == "cpu":
        return "gradseam bench (CPU, float32): synthetic block stack"
    return "gradseam bench: synthetic block stack"


# -- a family's real-size model, at two depths (and the full one where it fits) ------------------


def real(
    family: str | Family,
    preset: str | None = None,
    *,
    depths: str | tuple[int, int] | None = None,
    full: bool = False,
    full_depth: int | None = None,
    full_rows: list[str] | None = None,
    tokens: list[int | None] | None = None,
    rows: list[str] | None = None,
    steps: int = 3,
    on_row: Callable[[Result], None] | None = None,
    device: str = "cuda",
    dtype: torch.dtype | None = None,
    on_build: Callable[[RealRun], None] | None = None,
    base: str | None = None,
    lora: int | None = None,
    gpu_memory_gib: float | None = None,
    host_memory_gib: float | None = None,
    config_rows: list[tuple[str, dict[str, Any]]] | None = None,
) -> RealRun:
    """Every row on a family preset's real-size model (random weights, built on ``device``).

    Each row is measured at the two fit ``depths`` (default: 2 and 4 units, see
    :mod:`gradseam.tools.depth`), and with ``full=True`` also at the full depth. Rows whose
    pinned host memory, predicted from the fit, would exceed what the machine can pin are ruled
    out at the full depth rather than tried; ``full_rows`` limits the rows measured at the full
    depth (compiling a full model per row is slow), the others are predicted there. ``base`` and
    ``lora``: a quantized base and a LoRA trained on it (:func:`gradseam.tools.workloads.build`).
    ``gpu_memory_gib``: every row's steps run on this much of the GPU (a smaller card, :func:`capped`); the
    model is built on the whole GPU, so a row whose weights stay resident fails there when they do not fit.
    ``host_memory_gib``: the host memory the ``auto`` rows plan within. With ``full=True`` those rows are measured at
    the full depth only: each plans the model it is given, and a plan for a cut model says nothing of the full one.
    ``config_rows``: a user's own configs as rows (:func:`gradseam.tools.bench_rows.config_rows`), measured after the
    others; ``full_rows`` names them by label as it names the others.
    """
    from .bases import weight_bytes
    from .host import available_gib
    from .workloads import build

    chosen = real_rows(rows, extra=config_rows)
    at_full = full_depth_rows(full_rows, config_rows)
    if at_full is None:
        at_full = chosen
    dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    workload = build(family, preset, device=device, dtype=dtype, depth=None if full else "fit", depths=depths,
                     base=base, lora=lora)
    plan = workload.plan
    fit_depths = workload.fit_depths or plan.fit_depths(depths)
    target = full_depth or plan.full
    run = RealRun(plan, fit_depths, target, host_available_gib=available_gib(),
                  weights_gib=weight_bytes(workload.model) / GiB + workload.dropped_gib)
    if on_build is not None:
        on_build(run)
    measured_depths = [*fit_depths, *([plan.full] if full and plan.full not in fit_depths else [])]
    cpu = device == "cpu"
    # a capped row at a fit depth runs beside the blocks it does not: they wait in host memory. Without --full too:
    # the model is built at the deeper fit depth, so at the shallower one the blocks between the two cuts stayed on
    # the GPU against the cap (Wan 2.1 14B's `unsloth-compile + stream all @ 12GiB`, an H100: a 10.17 GiB GPU peak
    # at 2 blocks beside 1.31 GiB of blocks 3 and 4, 8.88 GiB at 4)
    with parking(workload.model, _parking_line) if not cpu and parks_at_fit_depths(chosen, gpu_memory_gib, full) \
            else nullcontext():
        _measure_depths(run, workload, tokens, measured_depths, fit_depths, chosen, at_full, full, device, steps,
                        on_row, gpu_memory_gib, host_memory_gib)
    return run


def _parking_line(line: str) -> None:
    print(f"bench: {line}", file=sys.stderr, flush=True)


def _measure_depths(run: RealRun, workload: Any, tokens: list[int | None] | None, measured_depths: list[int],
                    fit_depths: tuple[int, int], chosen: list[tuple[str, dict[str, Any] | None]],
                    at_full: list[tuple[str, dict[str, Any] | None]], full: bool, device: str, steps: int,
                    on_row: Callable[[Result], None] | None, gpu_memory_gib: float | None,
                    host_memory_gib: float | None) -> None:
    """:func:`real`'s rows at every depth, for every token count."""
    from .workloads import blocks as list_blocks
    from .workloads import sequence_length

    plan, cpu = workload.plan, device == "cpu"
    for count in tokens or [None]:
        inputs = workload.inputs(count)
        seq = sequence_length(workload.model, workload.family, inputs)
        label = f"{workload.family.name} {workload.preset_name} ({seq} seq{workload.weights_note})"
        if not cpu:
            torch.cuda.synchronize()
            run.static_gib = torch.cuda.memory_allocated() / GiB
        for depth in measured_depths:
            rule_out = None
            if depth not in fit_depths:
                rule_out = ruled_out_at(run, label, depth, device, gpu_memory_gib,
                                        streamed={name for name, config in at_full if streams_weights(config)})
            elif full and depth != plan.full:
                rule_out = capped_at_fit_depth(chosen, gpu_memory_gib)
            rule_out = refused_before(run.results, label, rule_out)
            with at_depth(workload.model, plan, depth):
                # Built again for the model as cut: an input that holds something per block (the SANA-WM
                # refiner's KV cache, one layer cache per block) must match the blocks this depth runs, and
                # diffusers refuses a cache built for the deeper model ("holds 4 layer caches but the model
                # has 2 transformer blocks", on an H100). The last depth's inputs are let go first.
                del inputs
                inputs = workload.inputs(count)

                def step_factory(inputs: dict[str, Any] = inputs) -> Callable[[], Any]:
                    return measuring.forward_backward(workload.model, inputs, count_saved=cpu)

                run.results += run_rows(
                    label, seq, workload.model, step_factory, chosen if depth in fit_depths else at_full, steps=steps, on_row=on_row, device=device,
                    compile_blocks=list_blocks(workload.model, workload.family), rule_out=rule_out,
                    depth=depth, blocks=plan.describe(depth), gpu_cap_gib=gpu_memory_gib, host_gib=host_memory_gib,
                )
        del inputs


def refused_before(results: list[Result], workload: str,
                   rule_out: Callable[[str], str | None] | None) -> Callable[[str], str | None]:
    """``rule_out``, and a row gradseam refused at a shallower depth is not tried again: the deeper model holds every
    block the shallower one ran, so the refusal stands. Tried again, it did not say so: AnyFlow-FAR's
    ``unsloth`` + attention offload was refused at depth 2 (dynamo failed inside the attention's own
    ``torch.compile``), and at depth 4 dynamo, having given up on that frame, ran flex attention eagerly and the row
    read OOM (134.83 GiB asked for, on an H100)."""
    def rule(name: str) -> str | None:
        for r in results:
            if r.workload == workload and r.strategy == name and r.status.startswith("unsupported"):
                return f"{r.status} (refused at depth {r.depth}; not tried again deeper)"
        return rule_out(name) if rule_out is not None else None

    return rule


def parks_at_fit_depths(rows: list[tuple[str, dict[str, Any] | None]], gpu_memory_gib: float | None,
                        full: bool = True) -> bool:
    """Whether a run parks the blocks outside its fit depths: where a row runs there under a GPU memory cap (its
    own, or ``--gpu-memory``'s). Not for a full run whose capped rows are all left to the full depth
    (:func:`capped_at_fit_depth`): an ``auto @ 24GiB`` row alone parked HunyuanVideo 1.5's 14.8 GiB for nothing, 12 s
    of copies on an H100. A run without ``full`` builds the model at the deeper fit depth, so only the blocks between
    the two cuts park, where a capped row other than ``auto`` runs (an ``auto`` row plans the cut model it is given,
    and parks what its own cuts leave out)."""
    def not_auto(name: str) -> str | None:
        return "plans the model it is given" if is_auto_row(name) else None

    rule_out = capped_at_fit_depth(rows, gpu_memory_gib) if full else not_auto
    return any((config or {}).get(GPU_CAP_KEY, gpu_memory_gib) is not None and rule_out(name) is None
               for name, config in rows)


def capped_at_fit_depth(rows: list[tuple[str, dict[str, Any] | None]],
                        gpu_memory_gib: float | None) -> Callable[[str], str | None]:
    """Why a row is not measured at a fit depth of a full-depth run. Not an ``auto`` row: it plans the model it is
    given. Not a capped row that streams a count of blocks: N blocks are N at every depth (all of a cut model's where
    it has fewer), so its figures there would be left out of the report (:func:`gradseam.tools.bench_report`) after
    minutes of measuring. Every other capped row is measured, the blocks outside the cut parked in host memory
    (:mod:`gradseam.tools.parking`; until the thirty-second session they stayed on the GPU against the cap, and
    capped rows were measured at the full depth only, with no growth per block)."""
    from .cost_cache import streams_a_count

    caps = {name: (config or {}).get(GPU_CAP_KEY, gpu_memory_gib) for name, config in rows}
    counted = {name for name, config in rows if streamed_count(name) is not None or streams_a_count(config or {})}

    def rule_out(name: str) -> str | None:
        if is_auto_row(name):
            return ("not measured at a fit depth of a --full run: auto plans the model it is given, and a plan for "
                    "this cut model says nothing of the full one; see the full depth")
        if caps.get(name) is None or name not in counted:
            return None
        return (f"not measured at a fit depth of a --full run: '{name}' streams a count of blocks, the same count at "
                "every depth (all of a cut model's where it has fewer), so its figures there do not scale to the full "
                "depth; see the full depth")

    return rule_out


def ruled_out_at(run: RealRun, workload: str, depth: int, device: str, gpu_memory_gib: float | None = None,
                 streamed: Collection[str] = ()) -> Callable[[str], str | None]:
    """Why a row must not be tried at ``depth``, from its fit: too much pinned host memory or GPU memory.
    ``streamed``: the rows whose weights stream without saying so in their label (a config row's keys).

    A row that would pin more host memory than the machine can spare is not run at all (pinning
    past the limit can take the machine down); one whose predicted peak is beyond the GPU by more
    than the fit's error margin would only run out of memory after minutes, so it is skipped too.
    """
    from .depth import predict, predict_peak
    from .host import pinnable_gib

    pinnable = pinnable_gib(run.host_available_gib)
    gpu_free = None
    if device != "cpu" and torch.cuda.is_available():
        gpu_free = (gpu_memory_gib or torch.cuda.get_device_properties(0).total_memory / GiB) - run.static_gib

    def rule_out(name: str) -> str | None:
        # save_on_cpu moves to the host everything no checkpointing keeps on the GPU
        pinned = predict(run.results, workload, "none" if name == "ref: save_on_cpu" else name, run.fit_depths,
                         depth, "peak_gib" if name == "ref: save_on_cpu" else "pinned_gib")
        if pinned is not None and pinnable is not None and pinned[0] > pinnable:
            return (f"ruled out: needs ~{pinned[0]:.1f} GiB of pinned host memory at depth {depth}, more than "
                    f"the {pinnable:.1f} GiB this machine can pin")
        peak = predict_peak(run.results, workload, name, run.fit_depths, depth)
        # its weights leave the GPU: the resident model's static memory does not apply
        streams = STREAM_SUFFIX in name or name in streamed
        if peak is not None and gpu_free is not None and not streams and peak[0] > 1.1 * gpu_free:
            return f"ruled out: predicted peak {peak[0]:.1f} GiB at depth {depth}, {gpu_free:.1f} GiB free on the GPU"
        return None

    return rule_out


def main() -> None:  # python -m gradseam.tools.bench [json-path]
    import json
    import sys

    from .bench_report import to_markdown, with_ratios

    results = synthetic(on_row=lambda r: print(r, flush=True))
    table = with_ratios(results)
    print(to_markdown(table, cpu=default_device() == "cpu"))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
