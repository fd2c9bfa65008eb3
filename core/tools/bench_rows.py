"""The rows ``gradseam bench`` measures, by label, and why a row is not measured on the CPU.

Labels and configs only: nothing here imports torch, so the command line checks ``--row`` /
``--skip-row`` before any heavy import. :mod:`gradseam.tools.bench` measures them.
"""

from __future__ import annotations

from typing import Any

from ..errors import GradseamError
from .compiled import BUDGETS, COMPILED, budget_config, budget_label, compiled_rows
from .named_strategies import BY_LABEL, compared, kept_kernel_variants, rows_of

# gradseam's rows, from the one table of named strategies (gradseam.tools.named_strategies), least
# aggressive first: every one the comparing tools measure that patches something and checkpoints
# every block ("none" is among the references; a stride's partial coverage is advise's win-back)
GRADSEAM_ROWS: list[tuple[str, dict[str, Any]]] = rows_of(compared(patches=True, strided=False))
# gradseam's rows that are also measured with compiled blocks on a real model: the variants that keep
# attention kernel outputs, one on the device and one in CPU memory
COMPILED_ROWS = compiled_rows(rows_of(kept_kernel_variants()))
# Rows of a real-model workload (``gradseam bench --family``): the references a user has today
# (no checkpointing, diffusers' own flag, ``save_on_cpu``, the compiler's memory budgets), then
# gradseam's strategies, eager and compiled.
DIFFUSERS_ROW = "ref: diffusers enable_gradient_checkpointing()"
# the compiler's activation memory budgets, as configs (see gradseam.tools.compiled)
COMPILE_ROWS: list[tuple[str, dict[str, Any]]] = [(budget_label(b), budget_config(b)) for b in BUDGETS]
REFERENCE_ROWS = [
    "none",
    "ref: torch.utils.checkpoint",
    "ref: torch.utils.checkpoint (FFN)",
    "ref: naive unsloth",
    "ref: save_on_cpu",
]

# -- rows the CPU mode does not measure, and why ---------------------------------------------------

NEEDS_CUDA = "needs CUDA"
NOT_ON_CPU_KEPT = "not measured on the CPU (kept kernels)"
NOT_ON_CPU_COMPILED = "not measured on the CPU (compiled)"
# the line under a CPU table for each status it shows
CPU_STATUS_WHY = {
    NEEDS_CUDA: "the row copies activations from GPU memory to pinned host memory (offload); a CPU model has no "
                "GPU memory to free, and gradseam refuses offload on one",
    NOT_ON_CPU_KEPT: "the row runs on the CPU (the test suite checks it there), but the attention kernel outputs it "
                     "keeps are held outside autograd's saved tensors, which is what the CPU's memory column "
                     "counts, so its figure would be too low",
    NOT_ON_CPU_COMPILED: "the row runs on the CPU (the test suite checks it there with the aot_eager backend), but "
                         "compiling every block takes minutes on a small machine, and what the row is for, inductor's "
                         "GPU graphs under the compiler's memory budget, is a GPU's memory and time; measure it "
                         "with `gradseam bench` on a CUDA GPU",
}
_PINNED_REFERENCES = ("ref: naive unsloth", "ref: save_on_cpu")  # hand-written offload: copies to host memory


def cpu_status(label: str) -> str | None:
    """Why the CPU mode does not measure the row ``label`` (one of :data:`CPU_STATUS_WHY`'s keys), or None."""
    if label in _PINNED_REFERENCES:
        return NEEDS_CUDA
    if label in {name for name, _ in COMPILE_ROWS}:
        return NOT_ON_CPU_COMPILED
    compiled = label.startswith(COMPILED)
    named = BY_LABEL.get(label.removeprefix(COMPILED))
    if named is None:  # a reference written by hand (torch.utils.checkpoint), or no checkpointing
        return None
    strategy = named.strategy
    if strategy.destinations:
        return NEEDS_CUDA
    if compiled or (strategy.kind is not None and strategy.kind.compiles):
        return NOT_ON_CPU_COMPILED
    if not strategy.cpu_measurable:
        return NOT_ON_CPU_KEPT
    return None


def synthetic_rows(rows: list[str] | None = None) -> list[tuple[str, dict[str, Any] | None]]:
    chosen: list[tuple[str, dict[str, Any] | None]] = [(n, None) for n in REFERENCE_ROWS]
    chosen += [(n, c) for n, c in GRADSEAM_ROWS]
    if rows is not None:
        chosen = [r for r in chosen if r[0] in rows]
    return chosen


def real_rows(rows: list[str] | None = None) -> list[tuple[str, dict[str, Any] | None]]:
    chosen: list[tuple[str, dict[str, Any] | None]] = [(n, None) for n in ("none", DIFFUSERS_ROW, "ref: save_on_cpu")]
    chosen += [(n, c) for n, c in COMPILE_ROWS]
    chosen += [(n, c) for n, c in GRADSEAM_ROWS]
    chosen += [(n, c) for n, c in COMPILED_ROWS]
    if rows is not None:
        unknown = sorted(set(rows) - {n for n, _ in chosen})
        if unknown:
            raise GradseamError(
                f"unknown bench rows {unknown}; known: {', '.join(n for n, _ in chosen)}."
            )
        chosen = [r for r in chosen if r[0] in rows]
    return chosen
