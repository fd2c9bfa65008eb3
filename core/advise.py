"""Pick the fastest strategy that fits a GPU memory budget, by measuring the real model.

``advise(model, example_inputs, budget)`` runs one warm-up and one timed forward + backward per
candidate and walks the practical ladder: no checkpointing, torch-ffn, torch, unsloth-ffn,
unsloth, then the attention-offload combinations. A candidate fits when its measured activation
peak plus the model's static memory (weights, inputs: what is allocated before the step) is
within the budget; the fastest fitting one wins. Once something fits, sparser checkpointing on the
chosen backend (interval 2, then a stride that checkpoints fewer blocks) is tried to win speed
back while still fitting.

The measuring function is injectable (``measure=``), so the ladder logic runs anywhere; the
default one needs a CUDA model, since it reads the GPU allocator. This module imports torch only
inside the functions that need it, so ``import gradseam`` stays cheap.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import GradseamError, UnsupportedStrategyError
from .named_strategies import rows

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


# -- the ladder ---------------------------------------------------------------------------------

# From the least to the most aggressive, out of the one table of named strategies; every rung is
# measured and the fastest that fits is chosen.
LADDER: list[tuple[str, dict[str, Any]]] = [("off", {"gradient_checkpointing": False})] + rows(
    "torch-ffn", "torch", "torch + attention kept", "unsloth-ffn", "unsloth", "attention offload",
    "torch-ffn + attention offload", "unsloth-ffn + attention offload", "torch + attention offload",
    "unsloth + attention offload",
)

# Win-back steps on the chosen backend, from the least extra memory to the most.
INTERVAL_STEP = ("interval 2", {"gradient_checkpointing_interval": 2})
STRIDE_STEPS: list[tuple[str, dict[str, Any]]] = [
    ("3 of every 4 blocks", {"gradient_checkpointing_interval": 3, "gradient_checkpointing_segment_stride": 4}),
    ("every other block", {"gradient_checkpointing_interval": 1, "gradient_checkpointing_segment_stride": 2}),
    ("1 of every 4 blocks", {"gradient_checkpointing_interval": 1, "gradient_checkpointing_segment_stride": 4}),
]

# measure(config) -> (activation peak GiB, step ms); raises torch.OutOfMemoryError (or any
# exception whose class name is OutOfMemoryError) or UnsupportedStrategyError.
Measure = Callable[[Mapping[str, Any]], tuple[float, float]]


@dataclass
class Trial:
    label: str
    config: dict[str, Any]
    peak_gib: float | None = None
    step_ms: float | None = None
    status: str = "not tried"  # fits | over budget | OOM | unsupported | not tried
    reason: str = ""


@dataclass
class Advice:
    budget_gib: float
    static_gib: float
    trials: list[Trial] = field(default_factory=list)
    chosen: Trial | None = None

    @property
    def config(self) -> dict[str, Any]:
        """The recommended config keys, ready to paste into a trainer config."""
        if self.chosen is None:
            raise GradseamError(self.no_fit_message())
        return dict(self.chosen.config)

    def to_json(self) -> str:
        return json.dumps(self.config, indent=2)

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_gib": round(self.budget_gib, 3),
            "static_gib": round(self.static_gib, 3),
            "recommended": self.chosen.config if self.chosen else None,
            "chosen": self.chosen.label if self.chosen else None,
            "trials": [asdict(t) for t in self.trials],
        }

    def no_fit_message(self) -> str:
        measured = [t for t in self.trials if t.peak_gib is not None]
        if not measured:
            return (
                f"no strategy could be measured within the {self.budget_gib:.2f} GiB budget (every candidate "
                "ran out of memory or was unsupported); shorten the sequence, truncate the model or use a "
                "bigger GPU."
            )
        best = min(measured, key=lambda t: t.peak_gib or 0.0)
        total = self.static_gib + (best.peak_gib or 0.0)
        return (
            f"nothing fits in {self.budget_gib:.2f} GiB: the smallest activation peak seen was "
            f"{best.peak_gib:.2f} GiB ({best.label}), which with {self.static_gib:.2f} GiB of static memory "
            f"needs {total:.2f} GiB, {total - self.budget_gib:.2f} GiB over budget. Raise the budget by at "
            "least that much, or shorten the sequence / lower the batch size."
        )

    def report(self) -> str:
        lines = [f"budget {self.budget_gib:.2f} GiB, static memory (weights + inputs) {self.static_gib:.2f} GiB"]
        for t in self.trials:
            peak = f"{t.peak_gib:7.2f} GiB" if t.peak_gib is not None else "        -  "
            ms = f"{t.step_ms:9.1f} ms" if t.step_ms is not None else "        -   "
            mark = "->" if t is self.chosen else "  "
            lines.append(f"{mark} {t.label:<42} {peak} {ms}  {t.status}{': ' + t.reason if t.reason else ''}")
        if self.chosen is None:
            lines.append(self.no_fit_message())
        else:
            lines.append(f"recommended ({self.chosen.label}):")
            lines.append(self.to_json())
        return "\n".join(lines)


class NoFitError(GradseamError):
    """No candidate fits the budget; ``.advice`` holds every measurement."""

    def __init__(self, advice: Advice) -> None:
        super().__init__(advice.no_fit_message())
        self.advice = advice


def _is_oom(exc: BaseException) -> bool:
    return any(k.__name__ == "OutOfMemoryError" for k in type(exc).__mro__)


def _try(trial: Trial, measure: Measure, budget_gib: float, static_gib: float) -> Trial:
    try:
        peak, ms = measure(dict(trial.config))
    except UnsupportedStrategyError as exc:
        trial.status, trial.reason = "unsupported", f"unsupported by family: {exc}"
        return trial
    except Exception as exc:
        if not _is_oom(exc):
            raise
        trial.status, trial.reason = "OOM", "out of memory while measuring"
        return trial
    trial.peak_gib, trial.step_ms = round(float(peak), 3), round(float(ms), 1)
    over = static_gib + trial.peak_gib - budget_gib
    if over > 0:
        trial.status, trial.reason = "over budget", f"over budget by {over:.2f} GiB"
    else:
        trial.status = "fits"
    return trial


def run_ladder(
    measure: Measure, budget_gib: float, static_gib: float = 0.0, *, supports_interval: bool = True
) -> Advice:
    """Walk the ladder with ``measure`` and return the advice (``chosen`` is None when nothing fits)."""
    advice = Advice(budget_gib, static_gib)
    fits: list[Trial] = []
    for i, (label, config) in enumerate(LADDER):
        trial = _try(Trial(label, dict(config)), measure, budget_gib, static_gib)
        advice.trials.append(trial)
        if trial.status == "fits":
            fits.append(trial)
        if i == 0 and trial.status == "fits":
            for rest_label, rest in LADDER[1:]:
                advice.trials.append(Trial(rest_label, dict(rest), reason="no checkpointing fits; nothing is faster"))
            break
    if not fits:
        return advice
    base = min(fits, key=lambda t: t.step_ms or 0.0)

    if base.config.get("gradient_checkpointing"):
        backend = base.config["gradient_checkpointing_backend"]
        steps = list(STRIDE_STEPS)
        if supports_interval and not backend.endswith("-ffn"):
            steps.insert(0, INTERVAL_STEP)
        stopped = False
        for label, extra in steps:
            trial = Trial(f"{base.label}, {label}", {**base.config, **extra})
            if stopped:
                trial.reason = "a denser setting already missed the budget"
                advice.trials.append(trial)
                continue
            _try(trial, measure, budget_gib, static_gib)
            advice.trials.append(trial)
            if trial.status == "fits":
                fits.append(trial)
            elif extra is not INTERVAL_STEP[1]:
                stopped = True  # sparser strides only keep more

    chosen = min(fits, key=lambda t: t.step_ms or 0.0)
    advice.chosen = chosen
    for t in fits:
        if t is not chosen:
            t.reason = f"fits, but slower than chosen ({t.step_ms:.1f} ms vs {chosen.step_ms:.1f} ms)"
    return advice


# -- measuring on the GPU -----------------------------------------------------------------------

def gpu_measure(model: Any, inputs: Mapping[str, Any], loss_fn: Callable[[Any], Any] | None = None) -> Measure:
    """One warm-up and one timed forward + backward of ``model(**inputs)`` under each config."""
    import gc
    import time

    import torch

    import gradseam

    from .workloads import make_step

    def measure(config: Mapping[str, Any]) -> tuple[float, float]:
        handle = None
        step = None
        try:
            if config.get("gradient_checkpointing") or config.get("gradient_checkpointing_offload_attention"):
                handle = gradseam.patch(model, config)
            step = make_step(model, inputs, loss_fn)
            step()  # warm-up
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - start) * 1000
            return (torch.cuda.max_memory_allocated() - base) / GiB, ms
        finally:
            if handle is not None:
                handle.remove()
            step = None
            gc.collect()
            torch.cuda.empty_cache()

    return measure


def advise(
    model: Any,
    example_inputs: Mapping[str, Any],
    budget: str | float,
    loss_fn: Callable[[Any], Any] | None = None,
    *,
    measure: Measure | None = None,
    static_gib: float | None = None,
) -> Advice:
    """The fastest strategy whose measured peak plus the model's static memory fits ``budget``.

    ``example_inputs`` are ``model``'s forward keyword arguments (one real batch, latents with
    ``requires_grad`` for a full backward); ``loss_fn(output)`` defaults to the mean square of every
    floating output. Raises :class:`NoFitError` (with the smallest peak seen and the shortfall) when
    nothing fits. ``measure`` replaces the GPU measurement (``config -> (peak GiB, ms)``).
    """
    budget_gib = parse_budget(budget)
    supports_interval = True
    if measure is None:
        import torch

        device = next((p.device for p in model.parameters()), None)
        if not torch.cuda.is_available() or device is None or device.type != "cuda":
            raise GradseamError(
                "gradseam.advise measures GPU memory and needs the model on a CUDA GPU "
                f"(model is on {device}, CUDA available: {torch.cuda.is_available()}). Move the model and "
                "inputs to the GPU, or pass measure= to supply your own measurements."
            )
        from .patcher import family_for

        supports_interval = family_for(model).supports_interval
        torch.cuda.synchronize()
        if static_gib is None:
            static_gib = torch.cuda.memory_allocated() / GiB
        measure = gpu_measure(model, example_inputs, loss_fn)
    advice = run_ladder(measure, budget_gib, static_gib or 0.0, supports_interval=supports_interval)
    if advice.chosen is None:
        raise NoFitError(advice)
    return advice
