"""``"auto"``'s plan run once on the whole model before the first training step runs it, and planned again where it
did not do what its costs predicted.

Why: the costs are measured at two shallow depths and the plan's full-depth figures are lines through them. Most
rows land within a few percent, but not all, and the two that did not on an H100 (2026-12-05) were the kind a user
cannot afford:

- Flux dev 4k under 16 GiB: a mix of 12 units of ``unsloth-ffn`` and 7 of ``compile``, every block's weights
  streamed, expected at 14.49 GiB, ran out of memory in its first backward with 15.33 GiB allocated: the training
  run died at its first step.
- Flux dev 4k under 80 GiB: ``unsloth-compile`` at budget 0.3, predicted at 431 ms from depths 2 and 4 (faster than
  no checkpointing, 523 ms), took 603 ms at the real depth, where ``unsloth-compile`` at its default budget took
  541 ms: ``auto`` chose the slowest compiled row.

So before the first step runs a plan, :func:`settle` runs it on the whole model, as that step will (a warm-up, two
where blocks compile, then one timed step: :func:`gradseam.tools.advise.full_depth_check`), and reads what it measured against the budgets and the
prediction:

- **Over a budget, or out of memory**: the plan is made again under a GPU budget lowered by what it overshot (by
  :data:`MARGIN` of the budget where it ran out of memory and the overshoot is unknown); a uniform candidate's costs
  also become what it measured at the real depth (for an out-of-memory one: at least the budget), for the rest of
  this planning (:attr:`gradseam.tools.cost_cache.Table.moved`: the table keeps what the two depths measured).
- **More than** :data:`SLOWER` **slower than predicted**: a uniform candidate's costs become what it measured and the
  planner chooses again (the same choice again ends it); a mix gives way to the best uniform candidate where that is
  predicted faster than the mix measured.
- **Held, but crowded**: a plan whose timed step retried at least :data:`CROWDED` allocations (each frees the
  allocator's cache and synchronizes the device) is planned again under a GPU budget that leaves twice the room it
  left, and the faster of the two as measured runs. The costs were measured under the same budget and paid for the
  crowding too, so only the whole model's run shows it: on an H100 under a 32 GiB cap, HunyuanVideo 1.5's
  ``unsloth-compile`` at budget 0.05 (27.2 GiB, 4.8 GiB free) retried 113 allocations in its step and took 40,968 ms;
  the same with 20 blocks' weights streamed (20.2 GiB) retried 2 and took 36,774 ms, its forward 4.0 s shorter
  (thirty-eighth session). Wan 2.1 14B's ``budget 0.05 + stream 34`` retried 18 a step under 16 GiB and 2 under 24
  GiB, 1.6% faster there.
- At most :data:`ROUNDS` plans are run. The answer is the fastest one that held both budgets as measured, with its
  measured figures beside its predicted ones in the report; where none held, the error names each plan and what it
  took.

A plan that cannot be run here (a replay from the table, a rank of a distributed run) gives way to the fastest that
ran and held, where one did: only with none does a prediction stand unrun.

What each plan measured is kept in the cost table (:attr:`gradseam.tools.cost_cache.Table.checked`), saved as soon as
it has run, so a restart, or every rank of a distributed run, replays the same rounds from it and settles on the same
plan without running one. A plan that ran out of memory is kept with the GPU budget it ran under (another budget runs
it again); a measured one for every budget, since the peak and the time do not depend on the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..config import STREAM_KEY
from ..errors import GradseamError
from . import cost_cache
from .advise import spread_weights_gib
from .compiled import gradseam_keys
from .estimates import Advice, Estimate, Measure, NoFitError

ROUNDS = 3  # plans run on the whole model at most, before the fastest that held is taken
SLOWER = 0.05  # a plan measured this much slower than predicted is planned again from what it measured
MARGIN = 0.05  # of the GPU budget: how much lower a mix that ran out of memory (overshoot unknown) is planned again
STEP = 0.01  # of the GPU budget: lowered this much more than a mix overshot, so the next mix is not the same one
CROWDED = 10  # allocator retries in the plan's timed step at which it is planned again with more room (above)

# (GPU budget GiB, host budget GiB or None) -> the planner's advice from the table as it is now (raises NoFitError)
Rechoose = Callable[[float, "float | None"], Advice]


@dataclass
class Settled:
    """The plan the first step runs, and what it did when run on the whole model (None: it could not be run)."""

    advice: Advice
    measured: Estimate | None
    lines: list[str]  # one per plan run or read, in order

    def report(self) -> str:
        if not self.lines:
            return ""
        said = "; checked on the whole model before the first step: " + "; ".join(self.lines)
        if any(RETRIED in line for line in self.lines):
            said += f" (the allocator's retries: {RETRIES_WHY})"  # once, however many plans retried
        return said


def config_of(advice: Advice) -> dict[str, Any]:
    """The keys the plan patches with: the mix's, else the uniform candidate's."""
    if advice.per_block is not None:
        return dict(advice.per_block.config)
    assert advice.chosen is not None
    return gradseam_keys(advice.chosen.config)


def predicted(advice: Advice) -> dict[str, float] | None:
    """The plan's predicted GPU peak (the static memory in it; a mix's in its block order,
    :attr:`gradseam.tools.mixed_plan.MixedPlan.expected_gpu_gib`), pinned host memory and step; None where the
    chosen candidate was not predicted."""
    mix = advice.per_block
    if mix is not None:
        gpu = mix.expected_gpu_gib if mix.expected_gpu_gib is not None else mix.plan.gpu_gib
        return {"gpu_gib": gpu, "host_gib": mix.plan.host_gib, "step_ms": mix.plan.time_ms}
    chosen = advice.chosen
    if chosen is None or chosen.peak_gib is None or chosen.step_ms is None:
        return None
    # the static memory counts every block's weights; those the candidate streams are in host memory (its fit was
    # judged so): left in, Flux dev 4k's "compile + stream 31" under 16 GiB read 26.85 GiB predicted, 15.09 measured
    streamed = spread_weights_gib(advice.block_gib or [], chosen.config.get(STREAM_KEY))
    return {"gpu_gib": advice.static_gib - streamed + chosen.peak_gib, "host_gib": chosen.pinned_gib or 0.0,
            "step_ms": chosen.step_ms}


def _said(advice: Advice) -> dict[str, float]:
    said = predicted(advice)
    assert said is not None, "a plan the planner chose is predicted"
    return said


def name_of(advice: Advice) -> str:
    if advice.per_block is not None:
        return f"the mix {advice.per_block.plan.describe()}"
    assert advice.chosen is not None
    return advice.chosen.label


def _failure_key(config: dict[str, Any], gpu: float) -> str:
    return f"{cost_cache.config_id(config)} under {gpu:.2f} GiB"


def _outcome(table: cost_cache.Table, config: dict[str, Any], gpu: float, check: Measure | None,
             saved: Callable[[], Any] | None = None) -> Estimate | str | None:
    """What the plan measured on the whole model: read from the table, else run (None: it cannot be run here), and
    ``saved()`` once it is in the table."""
    found = table.checked.get(cost_cache.config_id(config)) or table.checked.get(_failure_key(config, gpu))
    if found is not None or check is None:
        return found
    got = check(config)
    outcome = got if isinstance(got, Estimate | str) else Estimate(*got)  # a Measure may answer (peak, ms)
    if isinstance(outcome, Estimate):
        table.checked[cost_cache.config_id(config)] = outcome
    else:
        table.checked[_failure_key(config, gpu)] = outcome
    if saved is not None:
        saved()
    return outcome


def measured_costs(estimate: Estimate, peak_gib: float, step_ms: float, pinned_gib: float, why: str) -> Estimate:
    """``estimate`` moved onto what the whole model measured: the same fixed parts, the per-unit costs that meet the
    measured figures at the real depth (so a mix built from them sees them too)."""
    units = estimate.unit_costs
    if units is None or units.units <= 0:
        return Estimate(peak_gib, step_ms, pinned_gib, estimate.growth_gib, why, units)
    n = units.units
    costs = replace(units, step_ms=(step_ms - units.step_fixed_ms) / n,
                    peak_gib=(peak_gib - units.peak_fixed_gib) / n,
                    pinned_gib=(pinned_gib - units.pinned_fixed_gib) / n)
    return Estimate(peak_gib, step_ms, pinned_gib, costs.peak_gib, why, costs)


def _next_after_mix(advice: Advice, measured: Estimate | None, over_gpu: bool, over_host: bool, rechoose: Rechoose,
                    gpu_gib: float, host_gib: float | None, *, last: bool = False) -> Advice | None:
    """After a mix that did not do as predicted: planned again under budgets lowered by what it overshot, or the
    best uniform candidate where the mix held but ran slower than that one is predicted (None: keep the mix). With
    ``last`` (one plan left to run), a mix over a budget gives way to the uniform candidate, predicted to hold,
    rather than to another mix."""
    if not (over_gpu or over_host):
        chosen = advice.chosen
        assert measured is not None
        if chosen is None or chosen.step_ms is None or chosen.step_ms >= measured.step_ms:
            return None
        return replace(advice, per_block=None, per_block_note=(
            f"the mix measured {measured.step_ms:.1f} ms on the whole model, slower than {chosen.label}'s "
            f"{chosen.step_ms:.1f} ms predicted"))
    # lowered below what this mix was searched under (the search holds its bound, not the expected peak) by what it
    # took beyond its prediction, and a step more, so the next search cannot return the same mix
    mix = advice.per_block
    gpu, host = min(advice.gpu_gib, mix.plan.gpu_gib), advice.pinnable_gib if advice.pinnable_gib is not None else host_gib
    if over_gpu:  # out of memory: it took at least the whole budget, and by an unknown amount more
        gpu = _lowered(advice, gpu, measured, gpu_gib)
    if over_host and measured is not None and host is not None:
        host = min(host, mix.plan.host_gib) - (measured.pinned_gib - mix.plan.host_gib) - STEP * host
    if last or gpu <= advice.static_gib or (host is not None and host <= 0):
        if advice.chosen is None:  # nothing uniform held either: no room left to plan a mix in
            return None
        return replace(advice, per_block=None, per_block_note="the mixes did not hold the budgets on the whole model")
    return rechoose(gpu, host)


def _next_after_uniform(advice: Advice, table: cost_cache.Table, measured: Estimate | None, over_gpu: bool,
                        rechoose: Rechoose, gpu_gib: float, depth: str) -> Advice | None:
    """After a uniform candidate that did not do as predicted: its costs become what it measured on the whole model
    (out of memory: at least the budget), and the planner chooses again (None: its costs are not in the table).
    Over the GPU budget, it chooses under a budget lowered as after a mix (:func:`_lowered`).

    Why lowered too: a streamed candidate's prediction is capped at what its resident rung holds plus the weights in
    flight (:func:`gradseam.tools.advise.at_most_resident_and_in_flight`), so the costs written here come back capped,
    and the planner chose the same plan again. On an H100, Flux dev 4k's ``unsloth-compile + stream 32`` under 12 GiB
    was predicted at 11.84 GiB (the peak the allocator counts, as measured for ``+ stream 35``: 10.68 predicted, 10.66
    on the whole model) and ran out of memory under the cap with its allocator's own overhead; ``auto`` then stopped
    with "no plan held the budgets" where streaming three blocks more fits."""
    assert advice.chosen is not None
    label = advice.chosen.label
    estimate = table.current(label)
    if not isinstance(estimate, Estimate):
        return None
    why = f"measured at the real depth ({depth or 'the whole model'}) when auto checked its plan"
    if measured is None:
        at_least = max(estimate.peak_gib, gpu_gib - advice.static_gib + 1e-3)
        table.moved[label] = measured_costs(estimate, at_least, estimate.step_ms, estimate.pinned_gib, why)
    else:
        table.moved[label] = measured_costs(estimate, measured.peak_gib, measured.step_ms, measured.pinned_gib, why)
    gpu = _lowered(advice, advice.gpu_gib, measured, gpu_gib) if over_gpu else advice.gpu_gib
    if gpu <= 0:
        return None
    return rechoose(gpu, advice.pinnable_gib)


def _lowered(advice: Advice, gpu: float, measured: Estimate | None, gpu_gib: float) -> float:
    """``gpu`` less what the plan took beyond its prediction (out of memory: the budget less the prediction, and
    :data:`MARGIN` of the budget, the overshoot being unknown), and :data:`STEP` of the budget more, so the next search
    cannot return the same plan. (The search holds its own bound, not the expected peak: ``gpu`` is that bound.)"""
    expected = _said(advice)["gpu_gib"]
    beyond = advice.static_gib + measured.peak_gib - expected if measured is not None \
        else gpu_gib - expected + MARGIN * gpu_gib
    return gpu - beyond - STEP * gpu_gib


# why a plan's allocator retries are named, with the measurement that priced them
RETRIES_WHY = ("each frees the allocator's cache and synchronizes the device; on an H100 under a 32 GiB cap, "
               "HunyuanVideo 1.5's unsloth-compile at budget 0.05 retried 113 times in a step at 27.2 GiB and took "
               "40,968 ms, and with 20 blocks' weights streamed for room, 2 times at 20.2 GiB in 36,774 ms")


RETRIED = "allocator retries in its step"


def _retried(outcome: Estimate) -> str:
    """The plan's allocator retries in its timed step, where it had any: the budgets held, but the step paid for
    finding room, which the costs measured under the same budget paid too, so the planner cannot see it."""
    return f", {outcome.alloc_retries} {RETRIED}" if outcome.alloc_retries else ""


def _crowded(outcome: Estimate) -> bool:
    """Whether the plan's timed step retried enough allocations to plan it again with more room (a table written
    before retries were kept has none to read: its plans stand)."""
    return (outcome.alloc_retries or 0) >= CROWDED


def _roomier(advice: Advice, measured: Estimate, rechoose: Rechoose, gpu_gib: float, host_gib: float | None
             ) -> tuple[Advice, float] | None:
    """The plan made again under a GPU budget that leaves twice the room ``measured`` left under ``gpu_gib`` (and
    :data:`STEP` more, so the search cannot return the same plan), with the bound it was made under; None where no
    plan fits it. Where a model can stream its frozen weights, the planner frees the room that way, the cheapest for
    a video model, whose blocks compute far longer than their weights take to copy."""
    used = advice.static_gib + measured.peak_gib
    bound = used - (gpu_gib - used) - STEP * gpu_gib
    if bound <= 0:
        return None
    host = advice.pinnable_gib if advice.pinnable_gib is not None else host_gib
    try:
        return rechoose(bound, host), bound
    except NoFitError:
        return None


def _with_room(advice: Advice, held: Estimate, rechoose: Rechoose, gpu_gib: float, host_gib: float | None,
               lines: list[str]) -> Advice | None:
    """The next plan to run where ``advice`` held the budgets but its step was crowded (:func:`_crowded`): made
    again with more room (:func:`_roomier`), which ``lines``' last line then says. None where the step was not
    crowded, or no other plan leaves more room (said too)."""
    if not _crowded(held):
        return None
    roomier = _roomier(advice, held, rechoose, gpu_gib, host_gib)
    if roomier is not None and config_of(roomier[0]) != config_of(advice):
        lines[-1] += f": planned again to leave more room (under {roomier[1]:.2f} GiB)"
        return roomier[0]
    lines[-1] += ": no other plan leaves more room within the budgets"
    return None


def settle(advice: Advice, table: cost_cache.Table, check: Measure | None, rechoose: Rechoose, *,
           gpu_gib: float, host_gib: float | None, depth: str = "", saved: Callable[[], Any] | None = None) -> Settled:
    """The plan the first step runs (see the module docstring). ``check`` runs a config on the whole model (None:
    only what the table holds is read, and a plan it lacks runs unchecked). ``saved()`` is called after each plan
    run, once the table holds it: a run stopped during the next one (a time limit's SIGTERM ends Python without its
    ``finally``; HunyuanVideo 1.5's plans take over two minutes each on an H100) keeps what ran, and the next run
    replays it instead of running it again."""
    held: list[tuple[Advice, Estimate]] = []
    lines: list[str] = []
    for round_ in range(1, ROUNDS + 1):
        config = config_of(advice)
        outcome = _outcome(table, config, gpu_gib, check, saved)
        if outcome is None:  # nothing to check with (a replay from the table, a rank of a distributed run)
            if held:  # a plan measured to hold beats one only predicted to
                lines.append(f"{name_of(advice)}: not run here, so the plan that ran stands")
                break
            return Settled(advice, None, lines)  # the prediction stands
        said = _said(advice)
        step = said["step_ms"]
        name = name_of(advice)
        if isinstance(outcome, str):
            lines.append(f"{name}: {outcome.splitlines()[0]} (predicted GPU {said['gpu_gib']:.2f} GiB)")
            measured, over_gpu, over_host = None, True, False
        else:
            measured = outcome
            gpu_used = advice.static_gib + outcome.peak_gib
            over_gpu, over_host = gpu_used > gpu_gib, host_gib is not None and outcome.pinned_gib > host_gib
            lines.append(f"{name}: GPU {gpu_used:.2f} GiB (predicted {said['gpu_gib']:.2f}), pinned host "
                         f"{outcome.pinned_gib:.2f} GiB (predicted {said['host_gib']:.2f}), step {outcome.step_ms:.1f} ms "
                         f"(predicted {step:.1f})" + _retried(outcome) + (": over the GPU budget" if over_gpu else "")
                         + (": over the host budget" if over_host else ""))
            if not (over_gpu or over_host):
                held.append((advice, outcome))
                roomier = _with_room(advice, outcome, rechoose, gpu_gib, host_gib, lines) if round_ < ROUNDS else None
                if roomier is not None:
                    advice = roomier
                    continue
                if outcome.step_ms <= step * (1 + SLOWER):
                    break  # as predicted
        try:
            if advice.per_block is not None:
                after = _next_after_mix(advice, measured, over_gpu, over_host, rechoose, gpu_gib, host_gib,
                                        last=round_ == ROUNDS - 1)
                if after is None:
                    break
                advice = after
                continue
            again = _next_after_uniform(advice, table, measured, over_gpu, rechoose, gpu_gib, depth)
            if again is None or config_of(again) == config:
                break  # the same choice from what it measured
            advice = again
        except NoFitError:
            break
    if not held:
        raise GradseamError(
            "gradient_checkpointing_backend \"auto\": no plan held the budgets when run on the whole model "
            f"(GPU {gpu_gib:.2f} GiB" + (f", host {host_gib:.2f} GiB" if host_gib is not None else "") + "): "
            + "; ".join(lines) + ". Raise gradient_checkpointing_gpu_memory, or name a backend that holds less "
            "(\"unsloth\", with gradient_checkpointing_stream_weights: \"all\").")
    best, measured = min(held, key=lambda pair: pair[1].step_ms)
    return Settled(best, measured, lines)
