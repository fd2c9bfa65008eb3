"""The rows ``gradseam bench`` measures, by label, and why a row is not measured on the CPU.

Labels and configs only: nothing here imports torch, so the command line checks ``--row`` /
``--skip-row`` and reads ``--config-row``'s files (:func:`config_rows`) before any heavy import.
:mod:`gradseam.tools.bench` measures them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..config import STREAM_KEY
from ..errors import GradseamError
from .compiled import BUDGETS, COMPILED, budget_config, budget_label, compiled_rows, gradseam_keys
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


def cpu_status(label: str, config: Mapping[str, Any] | None = None) -> str | None:
    """Why the CPU mode does not measure the row ``label`` (one of :data:`CPU_STATUS_WHY`'s keys), or None.
    A ``--config-row`` row (``config`` marked :data:`CONFIG_ROW_KEY`) is judged by its config, not its label."""
    if config is not None and is_config_row(config):
        return _config_cpu_status(config)
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


def streamed_count(label: str) -> int | None:
    """N for a row label that streams a count of blocks (``"unsloth-compile + stream 40 @ 32GiB"``: 40), else None
    (``+ stream all``, no stream). A count is the same number of blocks at every depth: a cut model with fewer
    blocks streams them all, so its figures do not scale to the full model with N of its blocks streamed."""
    match = _VARIANT.fullmatch(label)
    if match is None or match["count"] in (None, "all"):
        return None
    return int(match["count"])


def row_variant(label: str, known: dict[str, dict[str, Any] | None]) -> tuple[str, dict[str, Any]] | None:
    """``"unsloth-compile + stream all"``: gradseam's row ``unsloth-compile`` with the frozen weights of every
    block streamed from host memory (``+ stream 20``: 20 blocks, placed by size as
    ``gradient_checkpointing_stream_weights: 20`` places them, :func:`gradseam.planning.spread`; ``+ stream all prefetch 0``: each
    block's copy waited for; ``+ stream all naive``: the naive reference, each block copied in on the compute
    stream as it runs and copied back out after, :class:`gradseam.offload.weights.WeightStream`'s ``naive``);
    ``" @ 24GiB"`` after any gradseam row runs its steps on 24 GiB of the GPU. None for any other label."""
    from ..config import parse_size

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


def chosen_rows(rows: Sequence[str] | None, skip_rows: Sequence[str] | None) -> list[str] | None:
    """The labels ``bench`` measures, before its ``--config-row`` rows: ``--row``'s, every built-in row but
    ``--skip-row``'s, or None for every built-in row (:func:`real_rows` reads each)."""
    if skip_rows:
        return [name for name, _ in real_rows() if name not in skip_rows]
    return list(rows) if rows else None


def real_rows(rows: list[str] | None = None, *, extra: Sequence[tuple[str, dict[str, Any]]] | None = None,
              ) -> list[tuple[str, dict[str, Any] | None]]:
    """The real-model rows, in table order; ``rows`` picks some by label, and may add any of gradseam's rows with
    its weights streamed or its own GPU cap (:func:`row_variant`), measured after the rest, and gradseam's planner
    (:data:`AUTO_ROW`: ``"auto"``, ``"auto @ 24GiB"``), which only a label asks for. ``extra``: a user's own
    configs as rows (``bench --config-row``, :func:`config_rows`), always measured, after the others in the order
    given; ``rows`` may name them too (a list naming only them measures only them)."""
    extra = list(extra or ())
    if rows is not None:
        named = {label for label, _ in extra}
        return [*_built_in_rows([r for r in rows if r not in named]), *extra]
    return [*_built_in_rows(None), *extra]


def _built_in_rows(rows: list[str] | None) -> list[tuple[str, dict[str, Any] | None]]:
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


# -- a user's own config as a row: bench --config-row 'LABEL=FILE.json' ---------------------------------

CONFIG_ROW_KEY = "bench_config_row"  # marks a --config-row row: read by bench, never passed to gradseam.patch
_CONFIG_FILE = ("FILE holds a JSON object of gradseam config keys as a trainer config writes them, e.g. "
                '{"gradient_checkpointing": true, "gradient_checkpointing_backend": "torch"}, or the "plan" object an '
                "auto row writes into bench's JSON (its \"config\" is used)")


def built_in_labels() -> set[str]:
    """Every label a built-in row answers to (the real-model rows, the synthetic stack's, the planner's)."""
    return {name for name, _ in [*real_rows(), *synthetic_rows()]} | {AUTO_ROW}


def config_row(spec: str, taken: Sequence[str] = ()) -> tuple[str, dict[str, Any]]:
    """``"mine @ 24GiB=my-plan.json"`` -> ``("mine @ 24GiB", {...the file's keys, GPU_CAP_KEY: 24.0, CONFIG_ROW_KEY:
    True})``: the row a user's own config makes, its keys checked by gradseam's own config parsing
    (:meth:`gradseam.CheckpointConfig.from_dict`) and the file read now, before anything heavy is imported.
    ``taken``: labels of config rows already read (two rows under one label are refused)."""
    from ..config import AUTO, REMEDY_FROM_DICT, CheckpointConfig, parse_size, read_json_keys

    label, sep, path = spec.partition("=")
    label, path = label.strip(), path.strip()
    if not sep or not label or not path:
        raise GradseamError(
            f"config row {spec!r}: expected LABEL=FILE.json, the row's label, '=' and the JSON file of its config, "
            "e.g. 'mine @ 24GiB=my-plan.json' (' @ 24GiB' is optional: that row's own GPU cap).")
    base, cap_sep, cap = label.partition(CAP_SUFFIX)
    known = built_in_labels()
    if label in known or base.strip() in known or row_variant(label, {**dict(real_rows()), AUTO_ROW: AUTO_CONFIG}):
        raise GradseamError(
            f"config row {spec!r}: the label {label!r} is a built-in row's (ask for it with --row {label!r}); give "
            f"your config a label of its own, e.g. 'mine{CAP_SUFFIX + cap if cap_sep else ''}={path}'.")
    if label in taken:
        raise GradseamError(f"config row {spec!r}: the label {label!r} is given twice; give each config row a label "
                            "of its own.")
    config: dict[str, Any] = {}
    if cap_sep:
        try:
            config[GPU_CAP_KEY] = parse_size(cap)
        except ValueError as exc:
            raise GradseamError(
                f"config row {spec!r}: the label's GPU cap {cap!r} (after {CAP_SUFFIX.strip()!r}) is not a size: "
                f"{exc} Write e.g. 'mine @ 24GiB', or leave ' @ SIZE' out.") from None
    try:
        data = read_json_keys(path)  # its JSON checked as gradseam reads config files (duplicate keys refused too)
    except FileNotFoundError:
        raise GradseamError(f"config row {spec!r}: no file {path!r} (looked for {os.path.abspath(path)!r}); "
                            f"check the path. {_CONFIG_FILE}.") from None
    except OSError as exc:  # a directory, no permission
        raise GradseamError(f"config row {spec!r}: cannot read {path!r} ({exc.strerror or exc}). "
                            f"{_CONFIG_FILE}.") from None
    except ValueError as exc:  # not UTF-8, not JSON, not an object
        raise GradseamError(f"config row {spec!r}: {exc} {_CONFIG_FILE}.") from None
    if "config" in data and "gradient_checkpointing" not in data:  # an auto row's "plan", copied from bench's JSON
        data = data["config"]
        if not isinstance(data, dict):
            raise GradseamError(f"config row {spec!r}: {path!r} holds a plan whose \"config\" is "
                                f"{type(data).__name__} {data!r:.60}, not an object of keys. {_CONFIG_FILE}.")
    try:
        settings = CheckpointConfig.from_dict(data)
    except (ValueError, TypeError) as exc:  # gradseam's own message: the key or value, what it accepts
        said = str(exc).replace(" " + REMEDY_FROM_DICT, "")
        raise GradseamError(f"config row {spec!r}: {path!r}: {said}") from None
    if settings.backend == AUTO:
        raise GradseamError(
            f"config row {spec!r}: {path!r} sets gradient_checkpointing_backend \"{AUTO}\"; a config row runs the "
            f"keys it is given. For the planner ask for its row (--row {AUTO_ROW!r}, or '{AUTO_ROW} @ 24GiB'); to "
            "measure what it planned, give the explicit \"config\" of its \"plan\" in bench's JSON.")
    return label, {**data, **config, CONFIG_ROW_KEY: True}


def config_rows(specs: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    """Every ``bench --config-row`` (:func:`config_row`), in the order given."""
    rows: list[tuple[str, dict[str, Any]]] = []
    for spec in specs:
        rows.append(config_row(spec, [label for label, _ in rows]))
    return rows


def full_depth_rows(full_rows: list[str] | None, extra: Sequence[tuple[str, dict[str, Any]]] | None = None,
                    ) -> list[tuple[str, dict[str, Any] | None]] | None:
    """The rows ``--full-row`` names (None: every chosen row): built-in ones by label, and the config rows it
    names (one it does not name is predicted at the full depth, as the other rows are)."""
    if full_rows is None:
        return None
    return real_rows(full_rows, extra=[(label, c) for label, c in extra or () if label in full_rows])


def is_config_row(config: Mapping[str, Any] | None) -> bool:
    """Whether ``config`` is a ``--config-row`` row's (:func:`config_row`)."""
    return bool(config and config.get(CONFIG_ROW_KEY))


def streams_weights(config: Mapping[str, Any] | None) -> bool:
    """Whether a row's config streams frozen weights, at the top level or in a per-block entry."""
    if not config:
        return False
    from ..config import CheckpointConfig

    settings = CheckpointConfig.from_dict(gradseam_keys(config))
    entries = settings.gradient_checkpointing_blocks or ()
    return bool(settings.stream_weights) or any(dict(entry).get(STREAM_KEY) for entry in entries)


def _config_cpu_status(config: Mapping[str, Any]) -> str | None:
    """:func:`cpu_status` of a config row, from what its config runs (each per-block entry's settings included)."""
    from ..config import CheckpointConfig
    from ..spec import strategy_of  # imports torch: only the CPU mode's sweep asks

    if GPU_CAP_KEY in config or streams_weights(config):
        return NEEDS_CUDA
    settings = CheckpointConfig.from_dict(gradseam_keys(config))
    parts = [settings, *(settings.for_blocks((entry,)) for entry in settings.gradient_checkpointing_blocks or ())]
    strategies = [strategy_of(part) for part in parts]
    if any(s.destinations for s in strategies):
        return NEEDS_CUDA
    if any(s.kind is not None and s.kind.compiles for s in strategies):
        return NOT_ON_CPU_COMPILED
    if any(not s.cpu_measurable for s in strategies):
        return NOT_ON_CPU_KEPT
    return None
