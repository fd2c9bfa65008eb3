"""What the tools check before any heavy import: names, sizes, depths, and whether a CUDA GPU can exist.

Importing torch takes seconds and diffusers tens of seconds on a small or busy machine (25-60 s were
seen); a command that is going to refuse its arguments, or to say that it needs a GPU, must say so
first. Nothing here imports torch or diffusers at import time: a family and its preset are found
in the plugin registry (plain data), a budget and a pair of depths are parsed as text, and
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
from pathlib import Path

from ..errors import GradseamError
from ..family import Family, Preset, class_name

GiB = 1 << 30
_UNITS = {
    "": GiB, "g": GiB, "gb": 10**9, "gib": GiB, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
    "t": 1 << 40, "tb": 10**12, "tib": 1 << 40, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10,
}


def parse_budget(value: str | float | int) -> float:
    """A memory budget in GiB: ``42.5`` (GiB), ``"40GiB"``, ``"40 GB"`` (10^9 bytes), ``"40960MiB"``."""
    if isinstance(value, bool):
        raise ValueError(f"memory budget: expected a size like '40GiB' or a number of GiB, got {value!r}.")
    if isinstance(value, (int, float)):
        gib = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        unit = match.group(2).lower() if match else ""
        if not match or unit not in _UNITS:
            raise ValueError(
                f"memory budget: cannot read {value!r}; write a number with a unit, e.g. '40GiB', '40 GB', "
                "'40960MiB', or a plain number of GiB like 42.5."
            )
        gib = float(match.group(1)) * _UNITS[unit] / GiB
    if not gib > 0 or gib == float("inf"):
        raise ValueError(f"memory budget: must be a positive finite size, got {value!r}.")
    return gib


def parse_depths(text: str | None, full: int) -> tuple[int, int]:
    """``"2,4"`` -> (2, 4); None -> two small depths of the model (2 and 4 units, or what it has)."""
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
