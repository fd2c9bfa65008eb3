"""What one benchmark sweep measured: a row per (workload, depth, strategy), and the run around it.

Apart from :mod:`gradseam.tools.bench`, which measures, and :mod:`gradseam.tools.bench_report`,
which turns these into tables, JSON and charts: both read the same records, neither needs the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .depth import DepthPlan


@dataclass
class Result:
    workload: str
    tokens: int
    strategy: str
    peak_gib: float | None
    step_ms: float | None
    status: str = "ok"  # "ok", "OOM", "needs CUDA", "not measured on the CPU (...)", "ruled out: ...", "unsupported: ...", "error: ..."
    pinned_allocations_after_warmup: int | None = None
    pinned_gib: float | None = None  # pinned host memory in use at its peak (GPU rows)
    depth: int | None = None  # real models: the depth measured (units of gradseam.tools.depth)
    blocks: str | None = None  # real models: the blocks kept per list at that depth, e.g. "2 + 4 blocks"
    forward_peak_gib: float | None = None  # GPU rows: the forward's own activation peak (loss included)
    backward_peak_gib: float | None = None  # GPU rows: the backward's own peak (peak_gib is the larger)
    forward_ms: float | None = None  # GPU rows: the forward's own time (loss included), median of the timed steps
    backward_ms: float | None = None  # GPU rows: the backward's own time (recomputes included)
    first_step_ms: float | None = None  # compiled rows: the first (warm-up) step, where they compile; auto: it plans
    gpu_peak_gib: float | None = None  # GPU rows: the whole GPU peak (weights on it, inputs, activations, loads)
    pinned_weights_gib: float | None = None  # rows that stream weights: their pinned host copies (in pinned_gib too)
    alloc_retries: int | None = None  # GPU rows: the allocator's retries over the timed steps (measure.alloc_retries)
    failure: str | None = None  # OOM rows: where and what the allocator said (measure.oom_detail)
    # auto rows: the plan, {"source": "measured" | "cached" | "default", "config": the explicit keys it runs,
    # "report": the planner's lines (what it measured, the plan, what it beat)}
    plan: dict | None = None
    # bench --config-row rows: the gradseam keys the row ran, as its file gave them (the JSON leaves it out of others)
    config: dict | None = None


@dataclass
class RealRun:
    """What :func:`gradseam.tools.bench.real` measured, and what it needs to speak for the full depth."""

    plan: DepthPlan
    fit_depths: tuple[int, int]
    full_depth: int  # the depth predictions are made for (the preset's, or the one asked for)
    results: list[Result] = field(default_factory=list)
    static_gib: float = 0.0  # weights + inputs at the deepest depth built
    weights_gib: float = 0.0  # the full model's weights as stored (a quantized base's, not their bf16 size)
    host_available_gib: float | None = None
