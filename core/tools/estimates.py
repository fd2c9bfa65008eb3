"""What measuring candidates tells, and what the ladder concluded from it: the data :mod:`gradseam.tools.advise`
makes and the planners beside it read.

:class:`Estimate` is one candidate at the depth planned for (and :class:`UnitCosts` its two-depth fit per unit of
depth), :class:`Trial` a rung of the ladder with what it measured and whether it fits, :class:`Advice` the whole
ladder and its choice. They live apart from the ladder so that what reads them (the per-block mix, the cost cache,
the plan check, the CLI) does not import the measuring, and the ladder can use the mix without a circle.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import STREAM_KEY
from ..errors import GradseamError
from .compiled import gradseam_keys


@dataclass(frozen=True)
class UnitCosts:
    """What one unit of depth adds to a candidate, and what it costs at depth zero: the two-depth fit's lines.

    A per-block plan (:mod:`gradseam.tools.mixed_plan`) adds these up unit by unit; a uniform plan of
    ``units`` units is exactly the candidate's own prediction (``fixed + units * growth``)."""

    units: int  # the depth predicted for
    step_ms: float  # step time added per unit
    step_fixed_ms: float
    peak_gib: float  # activation peak added per unit (what each unit holds through the step)
    peak_fixed_gib: float  # the peak at depth zero: the largest working set, which one block's run adds once
    pinned_gib: float  # pinned host memory added per unit
    pinned_fixed_gib: float


@dataclass
class Estimate:
    """One candidate at the depth planned for: predicted from two depths, or measured."""

    peak_gib: float
    step_ms: float
    pinned_gib: float = 0.0
    growth_gib: float | None = None  # activation peak added per unit of depth
    source: str = "measured"
    unit_costs: UnitCosts | None = None  # predicted ones: the fit per unit of depth
    # the forward's own time at this depth (GPU rows; None: not timed on its own, or a table from before), what the
    # model of streamed weights' copies splits a step by (:mod:`gradseam.tools.host_link`)
    forward_ms: float | None = None
    # a whole-model run's allocator retries in its timed step (GPU; None: not counted): each frees the caching
    # allocator's cache and synchronizes the device, which the step's time then includes (gradseam.tools.plan_check)
    alloc_retries: int | None = None


# measure(candidate) -> Estimate, or (activation peak GiB, step ms); raises torch.OutOfMemoryError
# (or another out-of-memory error, see measure.is_oom) or UnsupportedStrategyError.
Measure = Callable[[Mapping[str, Any]], "Estimate | tuple[float, float]"]


@dataclass
class Trial:
    label: str
    config: dict[str, Any]
    peak_gib: float | None = None
    step_ms: float | None = None
    status: str = "not tried"  # fits | over GPU memory | over host memory | OOM | unsupported | not tried
    reason: str = ""
    pinned_gib: float | None = None
    growth_gib: float | None = None
    source: str = ""
    unit_costs: UnitCosts | None = None
    forward_ms: float | None = None  # the forward's own share of step_ms, where it was timed (Estimate.forward_ms)
    began_gib: float | None = None  # out of memory: the GPU memory allocated when its step began, where known


@dataclass
class Advice:
    gpu_gib: float  # the GPU memory the strategies had to fit in
    static_gib: float
    trials: list[Trial] = field(default_factory=list)
    chosen: Trial | None = None
    depth_note: str = ""  # the depth the advice was planned for, and how
    pinnable_gib: float | None = None  # pinned host memory the plan allowed
    per_block: Any = None  # a gradseam.tools.mixed_plan.MixedPlan faster than the chosen rung, or None
    per_block_note: str = ""  # why there is no per-block plan, or that none beat the chosen rung
    block_gib: list[float] | None = None  # each block's frozen weights at full depth (what streaming moves), if known
    # the host link's rate as streaming uses it (gradseam.tools.host_link), if measured: a streamed rung's step is
    # then its resident rung's plus what the copy stream's model adds, not its line through two shallow depths
    link_gib_s: float | None = None

    @property
    def streaming_tried(self) -> bool:
        """Whether rungs with streamed weights were in the ladder: they are wherever the weights per block are known."""
        return bool(self.block_gib)

    @property
    def budget_gib(self) -> float:
        """Deprecated: the old name of :attr:`gpu_gib` (the GPU's size, not the compiler's memory budget)."""
        warnings.warn("Advice.budget_gib is deprecated; use Advice.gpu_gib (the GPU memory size in GiB).",
                      DeprecationWarning, stacklevel=2)
        return self.gpu_gib

    @property
    def config(self) -> dict[str, Any]:
        """The recommended gradseam config keys, ready to paste into a trainer config: the per-block plan's
        when no uniform candidate fits and a mix does."""
        if self.chosen is None:
            if self.per_block is not None:
                return dict(self.per_block.config)
            raise GradseamError(self.no_fit_message())
        return gradseam_keys(self.chosen.config)

    @property
    def compile(self) -> str | None:
        """How to compile the blocks, when the recommendation includes compiling them; else None."""
        if self.chosen is None or not self.chosen.config.get("compile_blocks"):
            return None
        budget = self.chosen.config.get("compile_memory_budget")
        how = "compile each transformer block with torch.compile (block.compile())"
        if budget is not None:
            how += f", with torch._functorch.config.activation_memory_budget = {budget:g}"
        return how

    def to_json(self) -> str:
        return json.dumps(self.config, indent=2)

    @property
    def per_block_config(self) -> dict[str, Any] | None:
        """The per-block plan's keys (top-level keys and ``gradient_checkpointing_blocks``), or None."""
        return self.per_block.config if self.per_block is not None else None

    def to_dict(self) -> dict[str, Any]:
        return dict(
            gpu_gib=round(self.gpu_gib, 3),
            static_gib=round(self.static_gib, 3),
            recommended=self.config if self.chosen else None,
            compile=self.compile,  # how to compile the blocks (a sentence), or None
            chosen=self.chosen.label if self.chosen else None,
            depth=self.depth_note,
            pinnable_gib=round(self.pinnable_gib, 1) if self.pinnable_gib is not None else None,
            link_gib_s=round(self.link_gib_s, 2) if self.link_gib_s else None,  # streamed rows' steps modelled from it
            trials=[asdict(t) for t in self.trials],
            per_block=self.per_block.to_dict() if self.per_block is not None else None,
            per_block_note=self.per_block_note or None,
        )

    def no_fit_message(self) -> str:
        # resident candidates: a streamed one's peak leaves its streamed weights out of the static memory
        measured = [t for t in self.trials if t.peak_gib is not None and not t.config.get(STREAM_KEY)]
        if not measured:
            began = [t.began_gib for t in self.trials if t.began_gib is not None]
            held = (f" When their steps began, {min(began):.2f} to {max(began):.2f} GiB of it was allocated already "
                    "(what the model keeps on the GPU, the blocks a candidate keeps resident, and anything a row before "
                    "it left there)." if began else "")
            return (
                f"no strategy could be measured within {self.gpu_gib:.2f} GiB of GPU memory (every candidate "
                f"ran out of memory or was unsupported).{held} Shorten the sequence, truncate the model or use a "
                "bigger GPU."
            )
        best = min(measured, key=lambda t: t.peak_gib or 0.0)
        total = self.static_gib + (best.peak_gib or 0.0)
        over = total - self.gpu_gib
        if over <= 0 and self.pinnable_gib is not None:
            # the GPU would hold one: what is short is the host's pinned memory
            least = min((t for t in measured if t.pinned_gib is not None), key=lambda t: t.pinned_gib or 0.0,
                        default=best)
            return (
                f"nothing fits both budgets: {best.label} fits {self.gpu_gib:.2f} GiB of GPU memory, but every "
                f"candidate that fits needs more pinned host memory than the {self.pinnable_gib:.1f} GiB allowed "
                f"(the least: {least.label}, {least.pinned_gib or 0.0:.1f} GiB). Allow more host memory "
                "(--host-memory), lower gradient_checkpointing_memory_budget with the compiled backends, or use a "
                "backend that keeps its activations on the GPU."
            )
        message = (
            f"nothing fits in {self.gpu_gib:.2f} GiB of GPU memory: the smallest activation peak seen was "
            f"{best.peak_gib:.2f} GiB ({best.label}), which with {self.static_gib:.2f} GiB of static memory "
            f"needs {total:.2f} GiB, {over:.2f} GiB over the GPU size. Use a GPU with at "
            "least that much more memory, or shorten the sequence / lower the batch size."
        )
        if self.static_gib >= over and self.streaming_tried:
            message += (" With frozen weights streamed from host memory nothing fitted either (the rungs ending "
                        "'+ stream N' above say why).")
        elif self.static_gib >= over:
            # the weights are what does not fit: streaming them is the way a card this size trains
            message += (
                f" Or keep frozen weights in host memory: gradient_checkpointing_stream_weights streams the "
                f"weights of N blocks spread over the model (\"all\" for every block), so stream blocks holding at least "
                f"{over:.2f} GiB of the {self.static_gib:.2f} GiB of weights and inputs, plus two blocks' worth "
                "for the ones in flight (docs/strategies.md, weight streaming: Wan 2.1 14B trained in 9.6 GiB). "
                "Streamed rows were not measured here (no block weights given, or quantized weights, which do "
                "not stream yet): gradseam bench '<row> + stream N @ SIZE' measures one."
            )
        return message

    def report(self) -> str:
        lines = [f"GPU memory {self.gpu_gib:.2f} GiB, static memory (weights + inputs) {self.static_gib:.2f} GiB"]
        if self.depth_note:
            lines.append(f"planned for {self.depth_note}")
        if self.link_gib_s and any(t.config.get(STREAM_KEY) for t in self.trials):
            lines.append(f"host link {self.link_gib_s:.1f} GiB/s: each streamed row's step is its resident row's plus "
                         "the copies' waits at that rate (gradseam.tools.host_link)")
        for t in self.trials:
            peak = f"{t.peak_gib:7.2f} GiB" if t.peak_gib is not None else "        -  "
            ms = f"{t.step_ms:9.1f} ms" if t.step_ms is not None else "        -   "
            mark = "->" if t is self.chosen else "  "
            lines.append(f"{mark} {t.label:<42} {peak} {ms}  {t.status}{': ' + t.reason if t.reason else ''}")
        if self.chosen is None and self.per_block is not None:
            lines.append("no uniform candidate fits both budgets; recommended: the per-block plan below")
        elif self.chosen is None:
            lines.append(self.no_fit_message())
        else:
            lines.append(f"recommended ({self.chosen.label}):")
            lines.append(self.to_json())
            if self.compile:
                lines.append(f"and {self.compile}")
        if self.per_block is not None:
            lines.append(self.per_block.report())
        elif self.per_block_note:
            lines.append(f"per-block plan: {self.per_block_note}")
        return "\n".join(lines)


class NoFitError(GradseamError):
    """No candidate fits the GPU; ``.advice`` holds every measurement."""

    def __init__(self, advice: Advice) -> None:
        super().__init__(advice.no_fit_message())
        self.advice = advice
