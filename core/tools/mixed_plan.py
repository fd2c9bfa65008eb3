"""A per-block plan from what ``advise`` measured: each unit of depth runs the candidate that makes the step
fastest while the GPU's and the host's memory both hold (issue 41, the planner's first part).

``advise`` measures every candidate of its ladder uniformly, at two depths, and predicts it at the real
depth from a line per quantity (:class:`gradseam.tools.estimates.UnitCosts`): what one unit of depth adds to
the step time, to the activations held through the step and to the pinned host memory, and what is there
at depth zero. A uniform plan has to fit its worst block into both budgets: on a 64 GB host,
``unsloth-compile`` pins every block's activations and may not fit, while ``compile`` keeps them on a GPU
that cannot hold them all. A mix can hold both budgets and run faster than any uniform candidate that fits.

How the units add up, and why: a plan's **step time** is the sum over units of each candidate's time per
unit, plus its time at depth zero spread evenly over the units (so a uniform plan predicts exactly what its
candidate predicts, and a mix the weighted mean of their fixed parts); its **GPU memory** is the static
memory (weights, inputs), plus what each unit holds through the step, plus the largest depth-zero peak among
the candidates used (one block's recompute and backward working set, which the step's peak adds once, not
per block); its **pinned host memory** adds up like the step time. The search itself is
:func:`gradseam.plan_search.search` (exact under both budgets, deterministic, checked against brute force).

Only candidates a block can run on its own take part: no checkpointing, and gradseam's backends with their
memory budget and attention settings, each resident or with its weights streamed (the keys
``gradient_checkpointing_blocks`` takes). A streamed candidate is measured with every block streamed
(``+ stream all``), and where some take part every unit carries its share of the frozen weights: on the GPU
when it stays resident, in pinned host memory when it streams (the static memory is then counted without
them). Intervals and strides group blocks, the compiler alone compiles every block the same way, and a count
of streamed blocks spread over the model is the model's choice: those stay uniform candidates.

Units map onto blocks as the depth plan of
:mod:`gradseam.tools.depth` cuts the model (Flux: one unit is one double-stream and two single-stream blocks);
where its lists do not shrink in proportion (HunyuanVideo 1.5's two refiner blocks beside 54), only the
longest list is planned per block and the others run the plan's top-level candidate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import BLOCK_KEYS, STREAM_KEY, CheckpointConfig
from ..plan_search import Budget, Group, Option, Plan, search
from .compiled import gradseam_keys
from .estimates import Advice, Trial, UnitCosts

BLOCKS_KEY = "gradient_checkpointing_blocks"
GROUP = "units"  # the one group the search plans: every unit of depth is alike
FASTER = 0.005  # a mix is offered only when it is predicted at least this much faster than the chosen rung


@dataclass
class MixedPlan:
    """A per-block plan, predicted: the keys to paste and what it beats."""

    plan: Plan
    config: dict[str, Any]  # top-level keys and gradient_checkpointing_blocks, as gradseam.patch takes them
    ranges: list[tuple[str, int, int]]  # (candidate label, first unit, end unit), in unit order
    beats: Trial | None  # the uniform candidate advise chose (None: none fits both budgets)
    units: int
    expected_gpu_gib: float | None = None  # the peak in this block order (:func:`expected_peak_gib`); None: unknown

    @property
    def step_ms(self) -> float:
        return self.plan.time_ms

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.as_dict(), "expected_gpu_gib": self.expected_gpu_gib, "config": self.config,
                "units": self.units,
                "ranges": [{"candidate": label, "units": [a, b]} for label, a, b in self.ranges],
                "beats": self.beats.label if self.beats else None,
                "beats_step_ms": self.beats.step_ms if self.beats else None}

    def report(self, keys: bool = True) -> str:
        """What the plan is predicted to take and what it beats, then (``keys``) its config as JSON."""
        import json

        if self.beats is not None:
            gain = 1 - self.plan.time_ms / (self.beats.step_ms or self.plan.time_ms)
            against = f"{gain:.1%} faster than {self.beats.label} ({self.beats.step_ms:.1f} ms)"
        else:
            against = "no uniform candidate fits both budgets"
        lines = [
            f"per-block plan (predicted): {self.plan.describe()}",
            f"   GPU {self.gpu_words()}, pinned host {self.plan.host_gib:.1f} GiB, step {self.plan.time_ms:.1f} ms: "
            + against,
        ]
        if keys:
            lines.append(json.dumps(self.config, indent=2))
        return "\n".join(lines)

    def gpu_words(self) -> str:
        """The GPU figures: the budget's bound, and the peak expected in this block order where it is lower."""
        bound = f"{self.plan.gpu_gib:.2f} GiB"
        if self.expected_gpu_gib is None or self.expected_gpu_gib >= self.plan.gpu_gib - 0.005:
            return bound
        return f"{self.expected_gpu_gib:.2f} GiB expected in this block order ({bound} at most)"


def per_block(trial: Trial) -> bool:
    """Whether a block can run ``trial``'s candidate on its own (inside a per-block plan), and it was predicted.
    A streamed candidate takes part when every block's weights streamed ("+ stream all"): a count of streamed
    blocks spread over the model is the model's choice, not one block's."""
    if trial.unit_costs is None or trial.peak_gib is None or trial.step_ms is None:
        return False
    return runs_per_block(trial.config)


def runs_per_block(config: Mapping[str, Any]) -> bool:
    """Whether a block can run ``config`` on its own, inside a per-block plan (:func:`per_block`, measured or not)."""
    if set(config) - set(gradseam_keys(config)):
        return False  # the compiler alone (every block compiled by torch.compile), or a bench-only key
    if config.get(STREAM_KEY) not in (None, "all"):
        return False
    return set(config) <= set(BLOCK_KEYS)


def streams(trial: Trial) -> bool:
    return trial.config.get(STREAM_KEY) == "all"


def option(trial: Trial, weight_gib: float = 0.0) -> Option:
    """``trial``'s costs per unit for the search (see the module docstring for why they add up this way).

    ``weight_gib``: the frozen weights of one unit, where some candidates stream them. They are then counted
    with the unit itself: on the GPU for a resident candidate, in pinned host memory for a streamed one (whose
    measured peak leaves them out; the blocks in flight are in its depth-zero peak)."""
    costs: UnitCosts = trial.unit_costs  # type: ignore[assignment]
    units = max(costs.units, 1)
    streamed = streams(trial)
    return Option(
        trial.label,
        time_ms=max(costs.step_ms + costs.step_fixed_ms / units, 0.0),
        gpu_gib=max(costs.peak_gib, 0.0) + (0.0 if streamed else weight_gib),
        host_gib=max(costs.pinned_gib + costs.pinned_fixed_gib / units, 0.0) + (weight_gib if streamed else 0.0),
        transient_gib=max(costs.peak_fixed_gib, 0.0),
    )


@dataclass
class _Found:
    """A mix the search found, with what it was searched over: the candidates, each one's costs per unit (by
    label) and the GPU memory fixed at depth zero."""

    plan: Plan
    candidates: list[Trial]
    options: dict[str, Option]
    fixed_gib: float


def plan_units(advice: Advice, units: int) -> _Found | None:
    """The fastest mix of advise's per-block candidates over ``units`` units within its GPU and host budgets.
    Where streamed candidates take part, the static memory is counted without the blocks' frozen weights and
    each unit carries its share (:func:`option`)."""
    candidates = [t for t in advice.trials if per_block(t)]
    if not candidates:
        return None
    weights = sum(advice.block_gib or ()) if any(streams(t) for t in candidates) else 0.0
    if not weights and not all(streams(t) for t in candidates):
        # the weights the streamed ones free are unknown: only resident candidates can be compared. (Where every
        # candidate streams, as under "auto" for a model larger than its GPU, the static memory already leaves
        # the weights out and each unit carries none.)
        candidates = [t for t in candidates if not streams(t)]
    host = advice.pinnable_gib if advice.pinnable_gib is not None else math.inf
    options = {t.label: option(t, weights / units) for t in candidates}
    fixed = max(advice.static_gib - weights, 0.0)  # the weights go with the units where those carry their share
    found = search([Group(GROUP, units, tuple(options.values()))], Budget(advice.gpu_gib, max(host, 1e-9)),
                   fixed_gpu_gib=fixed)
    return _Found(found, candidates, options, fixed) if found is not None else None


def expected_peak_gib(ranges: list[tuple[str, int, int]], options: dict[str, Option], fixed_gib: float) -> float:
    """The step's GPU peak with the units in ``ranges``' order: the fixed memory plus, at the worst unit, what it
    and every unit before it hold plus its own working set.

    Why that shape: backward runs the units last to first, and a unit's recompute and backward (its working set,
    the transient) happen while the units before it still hold what they keep, those after it having freed
    theirs. The search's bound (every unit's held memory plus the largest working set) is what a plan costs
    wherever that largest working set sits; this is the peak where it actually sits. On Wan 2.1 14B at 24 GiB
    (40 blocks streamed: 3 x unsloth, 24 x torch + attention offload, 13 x unsloth-compile 0.05, on an H100)
    the bound was 23.93 GiB, this 19.32 GiB, and the step measured 19.54 GiB."""
    held = peak = 0.0
    for label, start, end in ranges:
        o = options[label]
        held += o.gpu_gib * (end - start)
        peak = max(peak, held + o.transient_gib)
    return fixed_gib + peak


def attach(advice: Advice, model: Any, depth_plan: Any = None) -> None:
    """Set ``advice.per_block`` to a mix predicted faster than the chosen rung, or say in ``per_block_note`` why
    there is none. ``depth_plan``: how the model's lists shrink (read from ``model``'s family if not given)."""
    if depth_plan is None:
        try:
            from ..patcher import family_for
            from .depth import plan_for

            depth_plan = plan_for(model, family_for(model))
        except Exception as exc:  # noqa: BLE001 - a model without a family still gets its uniform advice
            advice.per_block_note = f"not planned: the model's block lists are unknown ({exc})"
            return
    units = next((t.unit_costs.units for t in advice.trials if t.unit_costs is not None), None)
    if units is None:
        advice.per_block_note = "not planned: the candidates were measured at one depth, so no cost per block is known"
        return
    found = plan_units(advice, units)
    chosen = advice.chosen
    if found is None:
        advice.per_block_note = "no mix of the per-block candidates fits both budgets"
        return
    plan, candidates = found.plan, found.candidates
    if chosen is not None and chosen.step_ms is not None and plan.time_ms > chosen.step_ms * (1 - FASTER):
        advice.per_block_note = (f"the best mix ({plan.describe()}, {plan.time_ms:.1f} ms predicted) is not faster "
                                 f"than {chosen.label}")
        return
    ranges = _ranges(plan, candidates, found.options)
    config = config_for(ranges, {t.label: t for t in candidates}, depth_plan)
    expected = expected_peak_gib(ranges, found.options, found.fixed_gib)
    advice.per_block = MixedPlan(plan, config, ranges, chosen, units, min(expected, plan.gpu_gib))


def _ranges(plan: Plan, candidates: list[Trial], options: dict[str, Option]) -> list[tuple[str, int, int]]:
    """Consecutive units per candidate, the largest working set first (ties in the ladder's order): that order
    gives the lowest :func:`expected_peak_gib` of any for these counts. (Swapping two neighbours so the larger
    working set comes first never raises the peak: the larger one then runs with less held up to it, and the
    smaller one with what the larger one had held up to it before, beside a smaller working set.)"""
    counted = [(trial.label, count) for trial, count in zip(candidates, plan.counts[0]) if count]
    counted.sort(key=lambda item: -options[item[0]].transient_gib)  # stable: ties keep the ladder's order
    out, start = [], 0
    for label, count in counted:
        out.append((label, start, start + count))
        start += count
    return out


def config_for(ranges: list[tuple[str, int, int]], trials: dict[str, Trial], depth_plan: Any) -> dict[str, Any]:
    """The keys that run ``ranges``: the candidate with the most units at the top level, an entry of
    ``gradient_checkpointing_blocks`` per other range, each setting every per-block key the top level sets
    otherwise (an entry only overrides what it names)."""
    top_label = max(ranges, key=lambda r: (r[2] - r[1], -r[1]))[0]
    top = gradseam_keys(trials[top_label].config)
    resolved_top = CheckpointConfig.from_dict(top)
    entries = []
    for label, a, b in ranges:
        if label == top_label:
            continue
        resolved = CheckpointConfig.from_dict(gradseam_keys(trials[label].config))
        keys = {k: getattr(resolved, k) for k in BLOCK_KEYS if getattr(resolved, k) != getattr(resolved_top, k)}
        for selector in selectors(depth_plan, a, b):
            entries.append({"blocks": selector, **keys})
    return {**top, BLOCKS_KEY: entries} if entries else dict(top)


def selectors(depth_plan: Any, start: int, end: int) -> list[str]:
    """The block selectors of units ``start`` to ``end``: every list's share of them where the depth plan cuts
    the lists in proportion, else the longest list's blocks (units count its blocks then)."""
    if depth_plan.exact:
        return [f"{path}[{start * n}:{end * n}]" for path, n in depth_plan.unit.items() if n]
    longest = max(depth_plan.totals, key=lambda path: depth_plan.totals[path])
    return [f"{longest}[{start}:{end}]"]
