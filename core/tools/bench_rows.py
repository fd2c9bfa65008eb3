"""The rows ``gradseam bench`` measures, by label, and why a row is not measured on the CPU.

Labels and configs only: nothing here imports torch, so the command line checks ``--row`` /
``--skip-row`` before any heavy import. :mod:`gradseam.tools.bench` measures them.
"""

from __future__ import annotations

import re
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

# gradseam's own planner as a row: "auto" (or "auto @ 24GiB"), planned at its first step within the row's GPU cap
# and bench's --host-memory; asked for by label only (each planning measures every candidate, minutes on a big model)
AUTO_ROW = "auto"
AUTO_CONFIG: dict[str, Any] = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "auto"}
STREAM_SUFFIX = " + stream "  # "<gradseam row> + stream N" / "... + stream all": that row, weights streamed
CAP_SUFFIX = " @ "  # "<gradseam row> @ 24GiB": that row's steps on 24 GiB of the GPU


def is_auto_row(label: str) -> bool:
    """Whether ``label`` is the planner's row, with or without its own cap (``"auto"``, ``"auto @ 24GiB"``)."""
    return label.split(CAP_SUFFIX)[0] == AUTO_ROW

# -- rows the CPU mode does not measure, and why ---------------------------------------------------

NEEDS_CUDA = "needs CUDA"
NOT_ON_CPU_KEPT = "not measured on the CPU (kept kernels)"
NOT_ON_CPU_COMPILED = "not measured on the CPU (compiled)"
# the line under a CPU table for each status it shows
CPU_STATUS_WHY = {
    NEEDS_CUDA: "the row copies activations from GPU memory to pinned host memory (offload), streams weights "
                "from host memory to the GPU, caps the GPU's memory or plans from GPU measurements (auto); a CPU "
                "model has no GPU memory to free, cap or measure",
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
    if label in _PINNED_REFERENCES or STREAM_SUFFIX in label or CAP_SUFFIX in label or is_auto_row(label):
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


# "<gradseam row>[ + stream N|all[ prefetch K]][ @ SIZE]": that row with its weights streamed (N blocks, K ahead)
# and its steps run on SIZE of the GPU (bench --gpu-memory, for one row)
_VARIANT = re.compile(r"(?P<row>.+?)(?: \+ stream (?P<count>all|\d+)(?: prefetch (?P<prefetch>\d+))?"
                      r"(?P<naive> naive)?)?(?: @ (?P<cap>.+))?")  # CAP_SUFFIX
GPU_CAP_KEY = "bench_gpu_memory_gib"  # a row's own GPU cap: read by bench, never passed to gradseam.patch
NAIVE_KEY = "bench_stream_naive"  # the naive streaming reference: read by bench, never passed to gradseam.patch


def row_variant(label: str, known: dict[str, dict[str, Any] | None]) -> tuple[str, dict[str, Any]] | None:
    """``"unsloth-compile + stream all"``: gradseam's row ``unsloth-compile`` with the frozen weights of every
    block streamed from host memory (``+ stream 20``: the first 20 blocks; ``+ stream all prefetch 0``: each
    block's copy waited for; ``+ stream all naive``: the naive reference, each block copied in on the compute
    stream as it runs and copied back out after, :class:`gradseam.offload.weights.WeightStream`'s ``naive``);
    ``" @ 24GiB"`` after any gradseam row runs its steps on 24 GiB of the GPU. None for any other label."""
    from .checks import parse_size

    match = _VARIANT.fullmatch(label)
    if match is None or (match["count"] is None and match["cap"] is None):
        return None
    config = known.get(match["row"])
    if config is None or "compile_blocks" in config or (match["row"] == AUTO_ROW and match["count"] is not None):
        return None  # auto decides which blocks stream itself
    config = dict(config)
    if match["count"] is not None:
        if match["count"] != "all" and int(match["count"]) == 0:
            return None
        config["gradient_checkpointing_stream_weights"] = "all" if match["count"] == "all" else int(match["count"])
        if match["prefetch"] is not None:
            if match["naive"]:
                return None  # the naive reference prefetches nothing
            config["gradient_checkpointing_stream_prefetch"] = int(match["prefetch"])
        if match["naive"]:
            config[NAIVE_KEY] = True
    if match["cap"] is not None:
        try:
            config[GPU_CAP_KEY] = parse_size(match["cap"])
        except ValueError:
            return None
    return label, config


def real_rows(rows: list[str] | None = None) -> list[tuple[str, dict[str, Any] | None]]:
    """The real-model rows, in table order; ``rows`` picks some by label, and may add any of gradseam's rows with
    its weights streamed or its own GPU cap (:func:`row_variant`), measured after the rest, and gradseam's planner
    (:data:`AUTO_ROW`: ``"auto"``, ``"auto @ 24GiB"``), which only a label asks for."""
    chosen: list[tuple[str, dict[str, Any] | None]] = [(n, None) for n in ("none", DIFFUSERS_ROW, "ref: save_on_cpu")]
    chosen += [(n, c) for n, c in COMPILE_ROWS]
    chosen += [(n, c) for n, c in GRADSEAM_ROWS]
    chosen += [(n, c) for n, c in COMPILED_ROWS]
    if rows is not None:
        known = {**dict(chosen), AUTO_ROW: AUTO_CONFIG}
        if AUTO_ROW in rows:
            chosen.append((AUTO_ROW, AUTO_CONFIG))
        chosen += [found for r in rows if r not in known and (found := row_variant(r, known)) is not None]
        unknown = sorted(set(rows) - {n for n, _ in chosen})
        if unknown:
            raise GradseamError(
                f"unknown bench rows {unknown}; known: {', '.join(n for n, _ in chosen)}, {AUTO_ROW} (gradseam's "
                "planner, within the row's GPU cap and --host-memory); and any of gradseam's "
                f"rows followed by '{STREAM_SUFFIX.strip()} N' or '{STREAM_SUFFIX.strip()} all' (its weights streamed; "
                "then optionally ' prefetch K', or ' naive' for the reference that copies each block in and out "
                "on the compute stream) and/or ' @ 24GiB' (its steps on that much of the GPU)."
            )
        chosen = [r for r in chosen if r[0] in rows]
    return chosen
