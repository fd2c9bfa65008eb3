"""What the tools check before any heavy import: names, sizes, depths, and whether a CUDA GPU can exist.

Importing torch takes seconds and diffusers tens of seconds on a small or busy machine (25-60 s were
seen); a command that is going to refuse its arguments, or to say that it needs a GPU, must say so
first. Nothing here imports torch or diffusers at import time: a family and its preset are found
in the plugin registry (plain data), a GPU memory size and a pair of depths are parsed as text, the
options that exclude or need each other are checked as values (:class:`OptionError`), and
:func:`cuda_missing` reads what the installed torch was built for and whether a CUDA driver exists
without importing torch (it asks torch itself only where torch is already imported).
:func:`model_class` is the one check that imports diffusers (to find the family's model class), so
the commands call it last.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import parse_size
from ..errors import GradseamError
from ..family import Family, Preset, class_name

__all__ = ["parse_size"]  # read here by the tools; it lives with the config keys that take sizes

GiB = 1 << 30


DEVICES = ("cpu", "cuda")


class OptionError(ValueError):
    """A mistake in a command's options, found before any work: ``option`` is the option whose value is
    wrong, shown as click shows its own checks (``Invalid value for '--steps': ...``); None for options
    that exclude or need each other (the message names them)."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


def parse_depths(text: str | None, full: int, default: tuple[int, int] | None = None) -> tuple[int, int]:
    """``"2,4"`` -> (2, 4); None -> ``default`` where given (the depth plan's own,
    :meth:`gradseam.tools.depth.DepthPlan.default_depths`), else two small depths of the model (2 and 4 units, or
    what it has)."""
    if text is None and default is not None:
        return default
    if text is None:
        if full >= 4:
            return (2, 4)
        if full >= 2:
            return (1, 2)
        raise ValueError("the model has one unit of depth only; there is nothing to fit, measure it with --full.")
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if len(values) != 2 or values[0] == values[1] or min(values) < 1:
        raise ValueError(f"--depths: expected two different depths >= 1 like '2,4', got {text!r}.")
    d1, d2 = sorted(values)
    if d2 > full:
        raise ValueError(f"--depths: {d2} is deeper than the model's full depth {full}.")
    return d1, d2


# -- option checks the commands share: values and combinations, before anything is built --------------


def at_least(option: str, value: int | Sequence[int] | None, what: str, minimum: int = 1) -> None:
    """Refuse a too small count with the value and what is allowed (typer's own ``min=`` check says
    only "Input should be greater than or equal to 1", without the value or the quantity)."""
    for item in value if isinstance(value, Sequence) else [value]:
        if item is not None and item < minimum:
            raise OptionError(f"expected {what} >= {minimum}, got {item}.", option)


def device_name(device: str | None, option: str = "--device") -> None:
    """``cpu``, ``cuda`` or left out (whether CUDA is there is asked later, of torch)."""
    if device not in (None, *DEVICES):
        raise OptionError(f"expected cpu or cuda, got {device!r}.", option)


def host_size(size: str | None) -> float | None:
    """``advise --host-memory``: the training machine's host memory in GiB, or None for this machine's."""
    if size is None:
        return None
    try:
        return parse_size(size, "host memory size")
    except ValueError as exc:
        raise OptionError(str(exc), "--host-memory") from None


def gpu_cap(size: str | None, family: str | None) -> float | None:
    """``bench --gpu-memory``: the GiB the rows run on, or None for the whole GPU."""
    if size is None:
        return None
    if family is None:
        raise OptionError("--gpu-memory caps a real-size model's rows; it needs --family.")
    try:
        return parse_size(size)
    except ValueError as exc:
        raise OptionError(str(exc), "--gpu-memory") from None


def bench_options(*, family: str | None, preset: str | None, depths: str | None, full: bool, depth: int | None,
                  full_rows: Sequence[str] | None, tokens: Sequence[int] | None, rows: Sequence[str] | None,
                  skip_rows: Sequence[str] | None, synthetic: bool, blocks: int | None, dim: int | None,
                  device: str | None, steps: int | None, threads: int | None, base: str | None = None,
                  lora: int | None = None) -> None:
    """``gradseam bench``'s options as values: the counts, the options that exclude or need each other,
    the device's name (what needs the family registry, the rows or torch is checked by the command)."""
    at_least("--steps", steps, "a number of timed steps")
    at_least("--threads", threads, "a number of CPU threads")
    at_least("--tokens", tokens, "a number of tokens")
    at_least("--blocks", blocks, "a number of blocks")
    at_least("--dim", dim, "a model width")
    at_least("--depth", depth, "a depth in units of depth")
    if synthetic and family:
        raise OptionError("--synthetic and --family exclude each other.")
    if family is None and (preset or depths or full or depth or rows or full_rows or skip_rows or base or lora):
        raise OptionError("--preset, --depths, --full, --full-row, --depth, --row, --skip-row, --base and --lora "
                          "need --family.")
    weights_options(base, lora)
    if rows and skip_rows:
        raise OptionError("--row and --skip-row exclude each other: name the rows to run, or the rows to leave out.")
    if full_rows and not full:
        raise OptionError("--full-row names a row measured at the full depth; it needs --full.")
    if family is not None and (blocks or dim or device):
        raise OptionError("--blocks, --dim and --device are for the synthetic stack; they exclude --family.")
    if family is not None and threads is not None:
        raise OptionError("--threads sets the CPU's torch threads; this bench runs on the GPU: --family models "
                          "always run there.")
    device_name(device)


def synthetic_width(dim: int | None, head_dim: int) -> None:
    """``--dim`` splits into the synthetic stack's heads (one per ``head_dim`` of width, at least one)."""
    if dim is None:
        return
    heads = max(dim // head_dim, 1)
    if dim % heads:
        near = sorted({d for d in range(max(1, dim - 2 * head_dim), dim + 2 * head_dim)
                       if d % max(d // head_dim, 1) == 0}, key=lambda d: (abs(d - dim), d))[:2]
        raise OptionError(f"{dim} does not split into the synthetic stack's {heads} heads (one per {head_dim} "
                          f"of width); nearest widths that do: {' and '.join(map(str, sorted(near)))}.", "--dim")


def depths_form(depths: str | None) -> int | None:
    """The form of ``--depths`` (its bound, the model's depth, is checked once the model is built); the
    lower depth, or None where none was given."""
    if depths is None:
        return None
    try:
        low, _ = parse_depths(depths, full=1 << 30)
    except ValueError as exc:
        raise OptionError(str(exc).removeprefix("--depths: "), "--depths") from None
    return low


def weights_options(base: str | None, lora: int | None) -> None:
    """``--base`` names a quantized base of :data:`gradseam.tools.bases.BASES` (an unknown one: the error lists
    them); ``--lora`` is a rank."""
    at_least("--lora", lora, "a LoRA rank")
    if base is not None:
        from .bases import BASES

        if base not in BASES:
            raise OptionError(f"unknown base {base!r}; the quantized bases are: {', '.join(BASES)}.", "--base")


def advise_options(*, gpu: str | None, budget: str | None, depth: int | None, tokens: int | None,
                   base: str | None = None, lora: int | None = None) -> tuple[float, str]:
    """``gradseam advise``'s options as values: the GPU memory size in GiB, and the option that gave it
    (``--gpu``, or ``--budget``, its deprecated old name); the counts, the base and the LoRA rank."""
    weights_options(base, lora)
    if gpu is not None and budget is not None:
        raise OptionError("--budget is the deprecated old name of --gpu; give --gpu only.")
    option, size = ("--gpu", gpu) if budget is None else ("--budget", budget)
    if size is None:  # as click says it of a required option (--gpu is not one: --budget may stand for it)
        raise OptionError("Missing option '--gpu'.")
    at_least("--depth", depth, "a depth in units of depth")
    at_least("--tokens", tokens, "a number of tokens")
    try:
        return parse_size(size), option
    except ValueError as exc:
        raise OptionError(str(exc), option) from None


def known_rows(labels: Sequence[str] | None, option: str = "--skip-row") -> None:
    """Every label names a bench row: an unknown one is an error, not a row silently kept."""
    if labels:
        from .bench_rows import real_rows

        try:
            real_rows(list(labels))
        except GradseamError as exc:
            raise OptionError(str(exc), option) from None


def full_rows_measured(full_rows: Sequence[str] | None, rows: Sequence[str] | None, skip_rows: Sequence[str] | None,
                       extra: Sequence[tuple[str, Any]] = ()) -> None:
    """Every ``--full-row`` names a row the bench measures. ``--full-row`` picks which of the measured rows run at the
    full depth, so one naming no measured row measured nothing, and said nothing: on an H100, ``--row unsloth-compile
    --full-row 'unsloth-compile, budget 0.05 + stream 34 @ 24GiB'`` spent 67 s of device time on the first row's fit
    depths alone. ``extra``: the ``--config-row`` rows, measured whatever ``--row`` names."""
    if not full_rows:
        return
    from .bench_rows import chosen_rows, real_rows

    try:
        measured = {label for label, _ in real_rows(chosen_rows(rows, skip_rows), extra=list(extra))}
    except GradseamError:
        return  # an unknown --row: refused, naming it, where the rows are built
    missing = [label for label in full_rows if label not in measured]
    if missing:
        raise OptionError(
            f"{', '.join(map(repr, missing))} {'is' if len(missing) == 1 else 'are'} not among the rows this bench "
            "measures, and --full-row only picks which measured rows also run at the full depth; add "
            + " ".join(f"--row {label!r}" for label in missing) + " (or leave out the --full-row).", "--full-row")


def find_family(name: str) -> Family:
    import gradseam

    families = {f.name: f for f in gradseam.families()}
    if name not in families:
        raise GradseamError(f"no installed family {name!r}; installed: {', '.join(sorted(families)) or 'none'}.")
    return families[name]


def find_preset(family: Family, name: str | None) -> tuple[str, Preset]:
    if not family.presets:
        raise GradseamError(f"family {family.name!r} declares no presets, so it has no real-size workload.")
    if name is None:
        name = next(iter(family.presets))
    if name not in family.presets:
        raise GradseamError(
            f"family {family.name!r} has no preset {name!r}; presets: {', '.join(family.presets)}."
        )
    return name, family.presets[name]


def model_class(family: Family) -> type:
    """The first declared model class that is importable (bare names are looked up in ``diffusers``,
    which this imports)."""
    tried = []
    for ref in family.models:
        if isinstance(ref, type):
            return ref
        module, _, attr = ref.rpartition(".")
        try:
            found = getattr(importlib.import_module(module or "diffusers"), attr, None)
        except ImportError:
            found = None
        if isinstance(found, type):
            return found
        tried.append(class_name(ref))
    raise GradseamError(
        f"family {family.name!r}: none of its model classes ({', '.join(tried)}) can be imported from the "
        "installed diffusers, so its preset cannot be built here. Install a diffusers that has the class."
    )


# -- is there a CUDA GPU? ---------------------------------------------------------------------------

_BUILT_FOR = re.compile(r"^(cuda|hip|__version__)\s*(?::[^=]*)?=\s*(.+?)\s*$", re.MULTILINE)
_DRIVERS = {"linux": ("libcuda.so.1", "libcuda.so"), "win32": ("nvcuda.dll",)}


def torch_build() -> dict[str, str | None] | None:
    """What the installed torch was built for, read from ``torch/version.py`` without importing torch:
    ``{"__version__": "2.13.0+cpu", "cuda": None, "hip": None}``; None where it cannot be read."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text(encoding="utf-8")
    except OSError:
        return None
    found: dict[str, str | None] = {}
    for key, value in _BUILT_FOR.findall(text):
        value = value.strip()
        found[key] = None if value == "None" else value.strip("'\"")
    return found if "cuda" in found else None


def cuda_missing() -> str | None:
    """Why this process certainly has no CUDA GPU for torch, or None where it may have one.

    Cheap, and without importing torch (unless torch is already imported: then torch is asked):
    a torch built without CUDA or ROCm, ``CUDA_VISIBLE_DEVICES`` set to no device, or a CUDA build
    with no CUDA driver library to load. None means only "not ruled out": the caller asks torch
    (``torch.cuda.is_available()``) before it uses the GPU.
    """
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        return None if torch.cuda.is_available() else "torch sees no CUDA GPU here: torch.cuda.is_available() is False"
    built = torch_build()
    if built is None:
        return None
    if built.get("cuda") is None and built.get("hip") is None:
        return f"the installed torch {built.get('__version__') or ''} is a CPU-only build".replace("  ", " ")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    names = _DRIVERS.get(sys.platform)
    if built.get("hip") is None and names is not None:
        for name in names:
            try:
                ctypes.CDLL(name)
            except OSError:
                continue
            return None
        return f"no CUDA driver is installed (cannot load {names[0]})"
    return None
