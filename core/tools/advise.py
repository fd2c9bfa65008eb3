"""Pick the fastest strategy that fits a GPU's memory, by measuring the real model at two depths.

``advise(model, example_inputs, gpu)`` walks the practical ladder, from the least aggressive strategy
to the most: no checkpointing, then every named strategy that checkpoints every block, in the
catalog's order (:mod:`gradseam.tools.named_strategies`: the eager backends, attention offload alone
and beside them, the compiled backends), the compiler alone under its activation memory budgets
(blocks compiled one by one) and gradseam on compiled blocks. Each candidate runs one
warm-up and one timed forward + backward at two shallow depths of the model (the blocks stay
allocated; see :mod:`gradseam.tools.depth`), and its activation peak, step time and pinned host
memory are predicted at the model's real depth from the fit: a peak measured on a truncated model
alone would hide what each block adds, and recommend what cannot fit the real model.

A candidate fits when its predicted peak plus the model's static memory (weights, inputs) is within
the GPU's memory (``gpu``) and its pinned host memory within what the machine can pin (:mod:`gradseam.tools.host`);
the fastest fitting one wins. Once something fits, sparser checkpointing on the chosen backend
(interval 2, then a stride that checkpoints fewer blocks) is tried to win speed back.

When nothing fits because the weights do not (the model's frozen weights per block are known:
``block_gib``), each checkpointing rung that was over the GPU is tried again with the frozen weights of
as few blocks as free the shortfall streamed from host memory (:mod:`gradseam.offload.weights`, spread
over the model as the runtime spreads them), measured at the two depths like any rung: its static memory
is the model's less what streams, its pinned host memory the activations' and the streamed weights'.
Wherever the weights per block are known, the two fastest candidates a block can run on its own are also
measured with every block's weights streamed (``+ stream all``): uniform candidates like the rest, and what
lets the per-block plan stream some units and keep others resident.

The measuring function is injectable (``measure=``), so the ladder logic runs anywhere; the
default one needs a CUDA model, since it reads the GPU allocator. This module imports torch only
inside the functions that need it, so ``import gradseam`` stays cheap.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import replace
from typing import Any

from ..backends import Scope
from ..config import STREAM_KEY, CheckpointConfig
from ..errors import GradseamError, UnsupportedStrategyError
from ..kinds import KINDS
from ..spec import strategy_of
from .bench_rows import COMPILED_ROWS
from .checks import parse_size
from .compiled import BUDGETS, budget_config, budget_name, compiles
from .estimates import Advice, Estimate, Measure, NoFitError, Trial, UnitCosts
from .named_strategies import compared, rows_of

GiB = 1 << 30


# -- the ladder ---------------------------------------------------------------------------------

OFF: dict[str, Any] = {"gradient_checkpointing": False}  # no checkpointing, as a config says it

# From the least to the most aggressive, out of the one table of named strategies: every one that
# checkpoints every block in its own regions (interval chunks and strides are the win-back's steps
# below), then the compiler alone under each memory budget, then gradseam on compiled blocks. Every
# rung is measured and the fastest that fits is chosen.
LADDER: list[tuple[str, dict[str, Any]]] = [
    (label, config or dict(OFF)) for label, config in rows_of(compared(chunked=False, strided=False))
] + [
    (budget_name(b), {**OFF, **budget_config(b)}) for b in BUDGETS
] + COMPILED_ROWS

# Win-back steps on the chosen backend, from the least extra memory to the most.
INTERVAL_STEP = ("interval 2", {"gradient_checkpointing_interval": 2})
STRIDE_STEPS: list[tuple[str, dict[str, Any]]] = [
    ("3 of every 4 blocks", {"gradient_checkpointing_interval": 3, "gradient_checkpointing_segment_stride": 4}),
    ("every other block", {"gradient_checkpointing_interval": 1, "gradient_checkpointing_segment_stride": 2}),
    ("1 of every 4 blocks", {"gradient_checkpointing_interval": 1, "gradient_checkpointing_segment_stride": 4}),
]

def _try(trial: Trial, measure: Measure, gpu_gib: float, static_gib: float,
         pinnable_gib: float | None = None) -> Trial:
    try:
        got = measure(dict(trial.config))
    except UnsupportedStrategyError as exc:
        trial.status, trial.reason = "unsupported", f"unsupported by family: {exc}"
        return trial
    except Exception as exc:
        from .measure import allocated_when_measuring_began, is_oom

        if not is_oom(exc):
            raise
        trial.status, trial.began_gib = "OOM", allocated_when_measuring_began(exc)
        trial.reason = "out of memory while measuring" + (
            f" ({trial.began_gib:.2f} GiB allocated when its step began)" if trial.began_gib is not None else "")
        return trial
    if not isinstance(got, Estimate):
        got = Estimate(*got)
    trial.peak_gib, trial.step_ms = round(float(got.peak_gib), 3), round(float(got.step_ms), 1)
    trial.pinned_gib, trial.source = round(max(float(got.pinned_gib), 0.0), 2), got.source
    trial.growth_gib = round(got.growth_gib, 3) if got.growth_gib is not None else None
    trial.unit_costs = got.unit_costs
    trial.forward_ms = round(got.forward_ms, 1) if got.forward_ms is not None else None
    over = static_gib + trial.peak_gib - gpu_gib
    if over > 0:
        trial.status, trial.reason = "over GPU memory", f"over the GPU size by {over:.2f} GiB"
    elif pinnable_gib is not None and trial.pinned_gib > pinnable_gib:
        trial.status = "over host memory"
        trial.reason = (f"needs {trial.pinned_gib:.1f} GiB of pinned host memory, more than the "
                        f"{pinnable_gib:.1f} GiB this machine can pin")
    else:
        trial.status = "fits"
    return trial


def run_ladder(
    measure: Measure, gpu_gib: float, static_gib: float = 0.0, *, supports_interval: bool = True,
    pinnable_gib: float | None = None, ladder: list[tuple[str, dict[str, Any]]] | None = None,
    block_gib: Sequence[float] | None = None, win_back: bool = True, streamed_per_block: int | None = None,
    link_gib_s: float | None = None,
) -> Advice:
    """Walk the ladder with ``measure`` within ``gpu_gib`` of GPU memory and return the advice (``chosen``
    is None when nothing fits): every rung, then (``win_back``) the win-back steps on the fastest one that fits. With
    ``block_gib`` (each block's frozen weights at full depth, in forward order), rungs that are over the GPU
    only because the weights are too are tried again with some weights streamed (:func:`_streamed`), and unless no
    the fastest candidate measured fits, the fastest per-block candidates with every block streamed
    (:func:`_streamed_per_block`, ``streamed_per_block`` of them, default :data:`STREAMED_PER_BLOCK`), for the
    per-block plan to stream some units. ``link_gib_s``: the host link's rate (:mod:`gradseam.tools.host_link`),
    which the streamed rungs' steps are modelled from where given."""
    advice = Advice(gpu_gib, static_gib, pinnable_gib=pinnable_gib, block_gib=list(block_gib) if block_gib else None,
                    link_gib_s=link_gib_s)

    def try_one(trial: Trial) -> Trial:
        return _try(trial, measure, gpu_gib, static_gib, pinnable_gib)

    fits = _climb(advice, LADDER if ladder is None else ladder, try_one)
    if not fits and block_gib:
        fits = _streamed(advice, list(block_gib), measure)
    if fits and win_back:
        base = min(fits, key=lambda t: t.step_ms or 0.0)
        fits += _win_back(advice, base, try_one, supports_interval)
    measured = [t for t in advice.trials if t.step_ms is not None]
    fastest_fits = bool(measured) and min(measured, key=lambda t: t.step_ms or 0.0).status == "fits"
    if block_gib and not fastest_fits:  # for the per-block plan (streaming only adds copies to what already fits)
        fits += _streamed_per_block(advice, list(block_gib), measure,
                                    STREAMED_PER_BLOCK if streamed_per_block is None else streamed_per_block)
    if not fits:
        return advice
    chosen = min(fits, key=lambda t: t.step_ms or 0.0)
    advice.chosen = chosen
    for t in fits:
        if t is not chosen:
            t.reason = f"fits, but slower than chosen ({t.step_ms:.1f} ms vs {chosen.step_ms:.1f} ms)"
    return advice


STREAM_TRIES = 2  # streamed rungs measured that fit, fastest resident step first: then the rest are not tried


def blocks_to_stream(block_gib: Sequence[float], over_gib: float, ahead: int = 1) -> int | None:
    """The fewest blocks whose frozen weights, streamed (spread as the runtime spreads them), free ``over_gib``
    of GPU memory with the ``1 + ahead`` blocks in flight on the GPU counted back; None if not even all do."""
    total = len(block_gib)
    for count in range(1, total + 1):
        chosen = spread_blocks_gib(block_gib, count)
        if sum(chosen) - (1 + ahead) * max(chosen) >= over_gib:
            return count
    return None


def spread_blocks_gib(block_gib: Sequence[float], count: Any) -> list[float]:
    """The frozen weights of each block that streams when ``count`` do (``"all"`` or a number of the full model's
    blocks, spread as the runtime spreads a top-level count), in forward order. A per-block plan's streamed blocks
    are the plan's to say (:func:`gradseam.tools.auto_planner.streamed_weights_gib` reads them from it)."""
    return [block_gib[i] for i in streamed_indices(block_gib, count)]


def streamed_indices(block_gib: Sequence[float], count: Any) -> list[int]:
    """Which blocks (indices in forward order) stream when ``count`` do: :func:`spread_blocks_gib`'s blocks."""
    from ..planning import spread

    if count == "all":
        return list(range(len(block_gib)))
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        return []
    return spread(count, block_gib)


def spread_weights_gib(block_gib: Sequence[float], count: Any) -> float:
    """The frozen weights in host memory when ``count`` blocks stream (:func:`spread_blocks_gib`): what a streamed
    candidate's static memory is counted without."""
    return sum(spread_blocks_gib(block_gib, count))


def _streamed(advice: Advice, block_gib: list[float], measure: Measure) -> list[Trial]:
    """Each checkpointing rung that was over the GPU (not its host), fastest first, again with the fewest
    blocks' weights streamed that free its shortfall, measured; stops once :data:`STREAM_TRIES` fit. The
    trial's static memory is the model's less the streamed weights, and its pinned memory has them added."""
    over_gpu = sorted((t for t in advice.trials if t.status == "over GPU memory" and t.peak_gib is not None
                       and t.config.get("gradient_checkpointing") and not t.config.get("compile_blocks")),
                      key=lambda t: t.step_ms or 0.0)
    fits: list[Trial] = []
    for rung in over_gpu:
        over = advice.static_gib + (rung.peak_gib or 0.0) - advice.gpu_gib
        count = blocks_to_stream(block_gib, over)
        if count is None:
            continue  # streaming every block would not free enough: the activations are what does not fit
        name = "all" if count == len(block_gib) else str(count)
        trial = Trial(f"{rung.label} + stream {name}", {**rung.config, STREAM_KEY: name if count == len(block_gib)
                                                         else count})
        advice.trials.append(trial)
        if len(fits) >= STREAM_TRIES:
            trial.reason = f"not measured: {STREAM_TRIES} streamed rungs with faster resident steps fit"
            continue
        if _try_streamed(trial, advice, measure, spread_weights_gib(block_gib, count), rung):
            fits.append(trial)
    return fits


def at_least_resident(streamed: Estimate, resident: UnitCosts | None) -> Estimate:
    """``streamed``'s prediction with each unit holding at least what the same candidate holds resident, and taking
    at least as long (``resident``: its fit per unit). Streaming moves the weights, not the activations, and a
    block that saves a weight for its backward (attention kept by the ``-ffn`` backends, no checkpointing) holds its
    streamed copy too, so a streamed unit never holds less; it runs the same kernels and waits for copies besides,
    so it is never faster. Fitted through two shallow depths with the weights in flight, the streamed lines can come
    out lower. On an H100, Flux dev 4k's ``compile + stream all`` grew 0.089 GiB a unit where ``compile`` grows
    0.177, and ``auto``'s plan of it peaked 43% over the prediction at the full depth (4.91 GiB measured, 3.43
    predicted); ``torch-ffn + attention offload + stream 41`` fitted -11.4 ms a unit (its deeper step ran faster
    than its shallower one) and was predicted to take 36.5 ms a step, against 767.6 resident."""
    mine = streamed.unit_costs
    if mine is None or resident is None:
        return streamed
    costs, peak, step = mine, streamed.peak_gib, streamed.step_ms
    if mine.peak_gib < resident.peak_gib:
        costs = replace(costs, peak_gib=resident.peak_gib)
        peak += (resident.peak_gib - mine.peak_gib) * mine.units
    if mine.step_ms < resident.step_ms:
        costs = replace(costs, step_ms=resident.step_ms)
        step += (resident.step_ms - mine.step_ms) * mine.units
    if costs is mine:
        return streamed
    growth = costs.peak_gib if costs.peak_gib != mine.peak_gib else streamed.growth_gib
    return replace(streamed, peak_gib=peak, step_ms=step, growth_gib=growth, unit_costs=costs)


def in_flight_gib(block_gib: Sequence[float], config: Mapping[str, Any]) -> float:
    """The most frozen weight ``config``'s streaming holds on the GPU at once over the whole model: the block that
    runs and the ``prefetch`` streamed blocks copied ahead of it, at the worst place in forward order (the same
    windows run back to front in the backward)."""
    from ..config import DEFAULT_STREAM_PREFETCH

    streamed = spread_blocks_gib(block_gib, config.get(STREAM_KEY))
    return most_at_once(streamed, int(config.get("gradient_checkpointing_stream_prefetch", DEFAULT_STREAM_PREFETCH) or 0))


def most_at_once(streamed: Sequence[float], prefetch: int) -> float:
    """The most of the ``streamed`` blocks' weights (GiB, in forward order) on the GPU at once: the block that runs
    and the ``prefetch`` copied ahead of it, at the worst place."""
    window = 1 + prefetch
    return max((sum(streamed[i:i + window]) for i in range(len(streamed))), default=0.0)


def keeps_no_weight_on_the_gpu(config: Mapping[str, Any]) -> bool:
    """Whether nothing ``config``'s checkpointed blocks keep on the GPU for their backward can be a block's weight, as
    the backend's kind says (:meth:`gradseam.kinds.base.RegionKind.may_keep_weights`): a whole-block recompute
    keeps the block's inputs, and ``unsloth-compile`` moves what it keeps to host memory; ``compile`` and the
    ``-ffn`` backends (attention's saved tensors) may keep a weight."""
    if not config.get("gradient_checkpointing"):
        return False
    backend = strategy_of(CheckpointConfig.from_dict(dict(config))).backend
    return backend is not None and not KINDS[backend.kind].may_keep_weights(backend)


def at_most_resident_and_in_flight(streamed: Estimate, resident: Trial, in_flight: float) -> Estimate:
    """``streamed``'s prediction no higher than the ``resident`` rung's at the full depth plus the weights in flight
    (``in_flight``), for a candidate whose blocks keep no weight on the GPU (:func:`keeps_no_weight_on_the_gpu`):
    nothing else on the GPU depends on where the weights live. The per-unit growth becomes the resident one, the
    weights in flight a fixed part.

    Why: the model cut to two shallow depths streams a share of its blocks, spread as in the whole model, and with
    blocks of two sizes the largest pair in flight changes between the depths. Flux dev 4k's ``+ stream 32`` holds a
    double and a single block in flight at depth 2 (0.90 GiB) and two double blocks at depth 4 (1.27 GiB): the fit
    read the difference as 0.184 GiB a unit, and on an H100 predicted ``unsloth-compile + stream 32`` at 4.79 GiB of
    activations where ``+ stream 35`` measured 2.03 on the whole model (the resident 0.78 and 1.27 in flight: 2.05).
    Under 12 GiB the planner then ruled those rows out and chose a mix that ran 770 ms, against 709 for the
    hand-chosen ``unsloth-compile + stream 35``."""
    if resident.peak_gib is None or resident.unit_costs is None or streamed.unit_costs is None:
        return streamed
    cap = resident.peak_gib + in_flight
    if streamed.peak_gib <= cap:
        return streamed
    growth = resident.unit_costs.peak_gib
    costs = replace(streamed.unit_costs, peak_gib=growth, peak_fixed_gib=cap - growth * streamed.unit_costs.units)
    return replace(streamed, peak_gib=cap, growth_gib=growth, unit_costs=costs)


def with_link_waits(streamed: Estimate, resident: Trial, block_gib: Sequence[float], config: Mapping[str, Any],
                    link_gib_s: float) -> Estimate:
    """``streamed``'s step as its ``resident`` rung's at the full depth plus what the copy stream's model
    (:func:`gradseam.tools.host_link.added_ms`) says the streamed blocks' copies add at the link's rate, spread
    evenly over the units; the memory and pinned figures stay as measured. Why not the line through the two
    depths: see :mod:`gradseam.tools.host_link` (on an H100 it missed Flux's streamed rows by -20% to +36%)."""
    from ..config import DEFAULT_STREAM_PREFETCH
    from .host_link import FORWARD_SHARE, added_ms

    if resident.step_ms is None or resident.unit_costs is None or streamed.unit_costs is None or not block_gib:
        return streamed
    forward = resident.forward_ms if resident.forward_ms is not None else resident.step_ms * FORWARD_SHARE
    prefetch = int(config.get("gradient_checkpointing_stream_prefetch", DEFAULT_STREAM_PREFETCH) or 0)
    chosen = streamed_indices(block_gib, config.get(STREAM_KEY))
    ahead, behind = added_ms(block_gib, chosen, forward, resident.step_ms - forward, link_gib_s, prefetch)
    units = streamed.unit_costs.units
    costs = replace(streamed.unit_costs, step_ms=resident.unit_costs.step_ms + (ahead + behind) / units,
                    step_fixed_ms=resident.unit_costs.step_fixed_ms)
    source = (f"{streamed.source}; step: {resident.label}'s {resident.step_ms:.1f} ms + the copies' waits modelled at "
              f"{link_gib_s:.1f} GiB/s ({ahead:.1f} ms forward, {behind:.1f} ms backward, each streamed block's own "
              "costs in)")
    return replace(streamed, step_ms=resident.step_ms + ahead + behind, unit_costs=costs, source=source,
                   forward_ms=forward + ahead)


def _try_streamed(trial: Trial, advice: Advice, measure: Measure, streamed: float, resident: Trial) -> bool:
    """Measure a rung with ``streamed`` GiB of frozen weights in host memory: its static memory is the model's less
    them, its pinned memory has them added (checked against the host's), and each unit holds at least what the
    ``resident`` rung's units hold and take at least its time (:func:`at_least_resident`), and where its blocks keep
    no weight on the GPU, at most what they hold plus the weights in flight (:func:`at_most_resident_and_in_flight`);
    where the link's rate is known, its step is the resident rung's plus the copies' modelled waits
    (:func:`with_link_waits`); whether it fits."""
    in_flight = in_flight_gib(advice.block_gib or [], trial.config) \
        if keeps_no_weight_on_the_gpu(trial.config) else None

    def floored(config: Mapping[str, Any]) -> Estimate:
        got = measure(config)
        got = at_least_resident(got if isinstance(got, Estimate) else Estimate(*got), resident.unit_costs)
        if in_flight is not None:
            got = at_most_resident_and_in_flight(got, resident, in_flight)
        if advice.link_gib_s:
            got = with_link_waits(got, resident, advice.block_gib or [], config, advice.link_gib_s)
        return got

    _try(trial, floored, advice.gpu_gib, advice.static_gib - streamed)
    if trial.pinned_gib is not None:
        trial.pinned_gib = round(trial.pinned_gib + streamed, 2)  # the streamed weights are pinned too
        if trial.status == "fits" and advice.pinnable_gib is not None and trial.pinned_gib > advice.pinnable_gib:
            trial.status = "over host memory"
            trial.reason = (f"needs {trial.pinned_gib:.1f} GiB of pinned host memory ({streamed:.1f} GiB of it "
                            f"streamed weights), more than the {advice.pinnable_gib:.1f} GiB the host allows")
    if trial.status == "fits":
        trial.reason = f"{streamed:.2f} GiB of frozen weights in host memory"
    return trial.status == "fits"


STREAMED_PER_BLOCK = 2  # per-block candidates measured again with every block's weights streamed, fastest first


def _streamed_per_block(advice: Advice, block_gib: list[float], measure: Measure,
                        count: int = STREAMED_PER_BLOCK) -> list[Trial]:
    """The fastest checkpointing candidates a block can run on its own, measured again with every block's weights
    streamed ("+ stream all"), for the per-block plan (:mod:`gradseam.tools.mixed_plan`) to stream some units and
    keep others resident; uniform candidates too. The ones that fit.

    After the measured ones, those that ran out of memory with the cut model's weights on the GPU: streamed, the
    weights they ran beside leave. Wan 2.1 14B at 480p under 12 GiB (an H200, the thirty-third session) ran every
    candidate out of memory at its resident depths 2 and 4 (2.7 GiB of weights at depth 4 beside ~9 GiB the
    compiled candidates take when streamed), and ``auto`` found no plan; measured streamed, with nothing resident to
    compare them with, they are what the plan is made of."""
    from .mixed_plan import per_block, runs_per_block

    have = {t.label for t in advice.trials}

    def wanted(t: Trial) -> bool:
        return bool(t.config.get("gradient_checkpointing")) and not t.config.get(STREAM_KEY) \
            and f"{t.label} + stream all" not in have

    measured = sorted((t for t in advice.trials if per_block(t) and wanted(t)), key=lambda t: t.step_ms or 0.0)
    beside_weights = [t for t in advice.trials if t.status == "OOM" and runs_per_block(t.config) and wanted(t)]
    streamed = sum(block_gib)
    fits = []
    for rung in [*measured, *beside_weights][:count]:
        trial = Trial(f"{rung.label} + stream all", {**rung.config, STREAM_KEY: "all"})
        advice.trials.append(trial)
        if _try_streamed(trial, advice, measure, streamed, rung):
            fits.append(trial)
    return fits


def _climb(advice: Advice, ladder: list[tuple[str, dict[str, Any]]], try_one: Callable[[Trial], Trial]) -> list[Trial]:
    """Measure every rung; the ones that fit. When the first, no checkpointing, fits, only the compiled rungs are
    measured after it: no eager checkpointing is faster than none, but compiled blocks can be (Flux dev at 4k
    tokens on the H200: ``compile`` 0.96x none, measured by ``auto``), and an advice that stopped at none would
    never offer them."""
    fits: list[Trial] = []
    none_fits = False
    for i, (label, config) in enumerate(ladder):
        if none_fits and not compiles(config):
            advice.trials.append(Trial(label, dict(config), reason="no checkpointing fits; eager checkpointing is "
                                                                   "not faster"))
            continue
        trial = try_one(Trial(label, dict(config)))
        advice.trials.append(trial)
        if trial.status == "fits":
            fits.append(trial)
        none_fits = none_fits or (i == 0 and trial.status == "fits")
    return fits


def _win_back_steps(base: Trial, supports_interval: bool) -> list[tuple[str, dict[str, Any]]]:
    """Sparser checkpointing on ``base``'s backend, from the least extra memory to the most: interval 2
    where the family and the backend's whole-block regions allow it, then strides where its kind takes
    them; none for no checkpointing or compiled blocks."""
    if not base.config.get("gradient_checkpointing") or base.config.get("compile_blocks"):
        return []
    if base.config.get(STREAM_KEY):
        return []  # streamed blocks take no interval, and a block a stride leaves out holds its weights anyway
    backend = strategy_of(CheckpointConfig.from_dict(base.config)).backend
    if backend is None or not KINDS[backend.kind].takes_interval:
        return []
    interval = [INTERVAL_STEP] if supports_interval and backend.scope is Scope.BLOCK else []
    return [*interval, *STRIDE_STEPS]


def _win_back(advice: Advice, base: Trial, try_one: Callable[[Trial], Trial], supports_interval: bool) -> list[Trial]:
    """Try the win-back steps on ``base``; once a stride misses, sparser ones are not tried. The ones that fit."""
    fits: list[Trial] = []
    stopped = False
    for label, extra in _win_back_steps(base, supports_interval):
        trial = Trial(f"{base.label}, {label}", {**base.config, **extra})
        if stopped:
            trial.reason = "a denser setting already did not fit the GPU"
            advice.trials.append(trial)
            continue
        advice.trials.append(try_one(trial))
        if trial.status == "fits":
            fits.append(trial)
        elif extra is not INTERVAL_STEP[1]:
            stopped = True  # sparser strides only keep more
    return fits


# -- measuring on the GPU, at two depths ----------------------------------------------------------


def depth_measure(
    model: Any,
    inputs: Mapping[str, Any],
    loss_fn: Callable[[Any], Any] | None = None,
    *,
    family: Any = None,
    depths: tuple[int, int] | None = None,
    target: int | None = None,
    device: str = "cuda",
    plan: Any = None,
) -> tuple[Measure, str]:
    """A :data:`Measure` that runs each candidate at two depths of ``model`` and predicts it at ``target``.

    Returns the measure and a sentence saying which depth it plans for and how. A model with too
    few units of depth to fit from is measured as it is.
    """
    from ..patcher import family_for
    from .depth import fit, highest, peak_lines, plan_for

    family = family or family_for(model)
    plan = plan or plan_for(model, family)  # a truncated workload passes its full model's plan
    target = target or plan.full
    depths = measured_depths(plan, depths)
    if depths is None:
        note = f"the model as given ({plan.describe(plan.full)}), measured directly"
    else:
        note = (f"depth {target} ({plan.describe(min(target, plan.full))}; {plan.unit_note()}), predicted from "
                f"measurements at depths {depths[0]} and {depths[1]}")
        if plan.leading_note() and depths == plan.default_depths():
            note += f" ({plan.leading_note()}: the fit starts past them)"
        unseen = plan.unseen_note(depths)
        if unseen:
            note += f" (note: {unseen})"

    def once(config: Mapping[str, Any], depth: int, steps: int = 1) -> Any:  # a measure.Measurement
        return measure_once(model, inputs, config, depth, loss_fn, family=family, plan=plan, device=device, steps=steps)

    def measure(config: Mapping[str, Any]) -> Estimate:
        if depths is None:
            got = once(config, plan.full)
            return Estimate(got.peak_gib, got.step_ms, got.pinned_gib, forward_ms=getattr(got, "forward_ms", None))
        a, b = once(config, depths[0]), once(config, depths[1])
        if device != "cpu" and not grows(a, b):
            a, b = once(config, depths[0], RETIMED_STEPS), once(config, depths[1], RETIMED_STEPS)
            if not grows(a, b):
                raise UnsupportedStrategyError(
                    f"its step did not take longer with more blocks: {a.step_ms:.1f} ms at depth {depths[0]} and "
                    f"{b.step_ms:.1f} ms at depth {depths[1]}, timed again as the median of {RETIMED_STEPS} steps "
                    "at each depth after one step each said the same. On this GPU its timing varies by more than a "
                    "unit of depth adds, so no line through the two depths can predict the full model; measure it "
                    "at deeper depths (gradseam advise --depths) or at the full depth (gradseam bench --full)")
        name, peak = highest(peak_lines(depths, a, b), target)  # each pass's own line too (depth.highest)
        source = f"predicted at depth {target}"
        deeper = confirming_depth(plan, depths, target)
        if name != "step" and deeper is not None:
            # one pass's own line climbs past the whole step's: seen again from a deeper cut (confirming_depth)
            c = once(config, deeper)
            name, peak = highest(peak_lines((depths[1], deeper), b, c), target)
            source += f" (its {name} line from depths {depths[1]} and {deeper})"
        ms = fit(depths, (a.step_ms, b.step_ms))
        pinned = fit(depths, (a.pinned_gib, b.pinned_gib))
        units = UnitCosts(target, ms.growth, ms.fixed, peak.growth, peak.fixed, pinned.growth, pinned.fixed)
        forward = None
        passes = getattr(a, "forward_ms", None), getattr(b, "forward_ms", None)  # GPU measurements time each pass
        if None not in passes:
            forward = min(max(fit(depths, passes).at(target), 0.0), ms.at(target))
        return Estimate(peak.at(target), ms.at(target), pinned.at(target), peak.growth, source, units, forward)

    return measure, note


def confirming_depth(plan: Any, depths: tuple[int, int], target: int) -> int | None:
    """The deeper cut a candidate is measured at again where one pass's own line, through ``depths``, is the highest
    at ``target`` (twice the deeper fit depth, at most the model's own; None where there is none deeper, or nothing
    to extrapolate). Why: a pass's peak can climb over the first few blocks and then stop, as a pipeline fills. Wan
    2.1 14B's ``unsloth-compile + stream all`` had a forward peak of 4.13, 5.40, 6.06 and 6.28 GiB at 1, 2, 4 and 40
    blocks (an H200 and an H100); its line through 2 and 4 predicted 17.94 GiB of activations at 40 blocks where 8.82
    were measured, which would turn down under 12 GiB the one row that fits there. A line that still climbs
    between the deeper pair is kept (Ideogram 4's backward: its per-block growth is what each block keeps)."""
    deeper = min(2 * depths[1], plan.full)
    return deeper if depths[1] < deeper and depths[1] < target else None


# Timed steps per depth when one step each said that the deeper model ran faster (the median is kept)
RETIMED_STEPS = 3


def grows(shallow: Any, deep: Any) -> bool:
    """Whether the deeper of two measurements took longer, as every unit of depth adds kernels: a line through two
    depths where it did not would predict the full model faster than the cut one. On an H100, Flux dev 4k's
    ``torch-ffn + attention offload + stream 41`` took 230 ms at depth 2 and 207 at depth 4, one timed step each,
    and its line said 36.5 ms for the whole model (767.6 resident)."""
    return deep.step_ms > shallow.step_ms


def measure_once(model: Any, inputs: Mapping[str, Any], config: Mapping[str, Any], depth: int,
                 loss_fn: Callable[[Any], Any] | None = None, *, family: Any, plan: Any, device: str = "cuda",
                 steps: int = 1) -> Any:
    """One candidate patched onto ``model`` cut to ``depth`` (``plan.full``: the whole model), warmed up and timed
    for ``steps`` steps (their median); the patch is removed after. Returns a
    :class:`gradseam.tools.measure.Measurement`."""
    import gradseam

    from ..handle import lending
    from . import measure as measuring
    from .compiled import applied
    from .depth import at_depth
    from .workloads import blocks as list_blocks

    config = stream_at_depth(config, plan, depth)
    # lending: a model larger than its GPU under "auto" keeps its weights in host memory; the blocks this candidate
    # keeps resident come to the GPU before the step (after the patch, whose stream borrows those it streams)
    with at_depth(model, plan, depth), applied(model, config, list_blocks(model, family)), lending(model):
        step = measuring.forward_backward(model, inputs, loss_fn, count_saved=device == "cpu")
        handle = gradseam.handle_of(model)
        try:
            # two warm-ups where blocks compile: the second call of a compiled block may compile again (its
            # backward, a guard on what the first call changed), and a timed compile ruins the fit
            return measuring.measure(step, steps=steps, warmup=2 if compiles(config) else 1,
                                     device=device, engine=getattr(handle, "engine", None))
        except Exception as exc:
            from ..run.compiled import COMPILER_FAILURES

            if compiles(config) and type(exc).__name__ in COMPILER_FAILURES:
                raise compiler_refused(exc) from exc
            raise
        finally:
            step = None
            measuring.release(device)


def compiler_refused(exc: BaseException) -> UnsupportedStrategyError:
    """A compiled candidate the compiler refused, as a candidate that cannot run: one rung of the ladder, not the
    whole measurement (``gradseam advise`` on Flux dev stopped at its twentieth candidate, 160 s in, on an H200, when
    inductor refused a ``compiled: unsloth + attention offload`` graph; the bug behind it is fixed, and the next
    one should cost that rung only). gradseam's own compiled backends say the same at a model's first step
    (:meth:`gradseam.run.compiled.CompiledBlocks._compile_failed`)."""
    from ..run.compiled import compiler_said

    return UnsupportedStrategyError(f"torch.compile could not compile its blocks ({compiler_said(exc)})")


def full_depth_check(model: Any, inputs: Mapping[str, Any], loss_fn: Callable[[Any], Any] | None = None, *,
                     family: Any = None, device: str = "cuda") -> Measure:
    """A :data:`Measure` that runs a config on the whole model, as the training step will: what ``"auto"`` checks its
    plan with before the first step runs it (:func:`gradseam.tools.auto_planner.plan`)."""
    from ..patcher import family_for
    from .depth import plan_for

    family = family or family_for(model)
    plan = plan_for(model, family)

    def check(config: Mapping[str, Any]) -> Estimate:
        got = measure_once(model, inputs, config, plan.full, loss_fn, family=family, plan=plan, device=device)
        return Estimate(got.peak_gib, got.step_ms, got.pinned_gib, None, f"measured at depth {plan.full}",
                        forward_ms=getattr(got, "forward_ms", None), alloc_retries=getattr(got, "alloc_retries", None))

    return check


def stream_at_depth(config: Mapping[str, Any], plan: Any, depth: int) -> Mapping[str, Any]:
    """``config`` for the model cut to ``depth``: N streamed blocks of the full model become the same share of
    the blocks kept (at least one), so the fit sees each block's copy cost as the full model would."""
    count = config.get(STREAM_KEY)
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        return config
    full, kept = sum(plan.totals.values()), sum(plan.counts(depth).values())
    return {**config, STREAM_KEY: min(kept, max(1, round(count * kept / full)))}


def frozen_block_gib(model: Any, family: Any, plan: Any = None) -> list[float]:
    """Each block's frozen weights (what streaming moves: :func:`gradseam.offload.weights.streamable`, less the
    submodules the model calls outside the block, which stay resident) in GiB, in forward order at the full
    depth: a list cut short by a truncated workload (``plan``: the full model's depth plan) counts its first
    block's weights once for each block it had."""
    import torch

    from ..modules import resolve
    from ..offload.weights import kept_tensor_ids, streamable

    found: list[float] = []
    for block_list in family.block_lists:
        kept = resolve(model, block_list.path)
        if kept is None or not len(kept):
            continue
        resident = [kept_tensor_ids(block, block_list.outside(index, len(kept))) for index, block in enumerate(kept)]
        tensors = [[t for *_, t in streamable(block) if id(t) not in ids] for block, ids in zip(kept, resident)]
        if any(type(t) not in (torch.nn.Parameter, torch.Tensor) for ts in tensors for t in ts):
            return []  # quantized weights: streaming moves plain tensors only (gradseam.planning refuses them)
        sizes = [sum(t.nbytes for t in ts) / GiB for ts in tensors]
        total = plan.totals.get(block_list.path, len(kept)) if plan is not None else len(kept)
        found += sizes[:total] + [sizes[0]] * (total - len(sizes))
    return found


def advise(
    model: Any,
    example_inputs: Mapping[str, Any],
    gpu: str | float | None = None,
    loss_fn: Callable[[Any], Any] | None = None,
    *,
    measure: Measure | None = None,
    static_gib: float | None = None,
    depths: tuple[int, int] | None = None,
    depth: int | None = None,
    pinnable_gib: float | None = None,
    plan: Any = None,
    budget: str | float | None = None,
    block_gib: Sequence[float] | None = None,
    progress: Callable[[str, bool], None] | None = None,
    link_gib_s: float | None = None,
) -> Advice:
    """The fastest strategy whose predicted peak plus the model's static memory fits in ``gpu``.

    ``gpu`` is the GPU memory available to the run: GiB as a number, or a size like ``"40GiB"``
    (``budget=`` is its deprecated old name). ``example_inputs`` are ``model``'s forward keyword
    arguments (one real batch, latents with ``requires_grad`` for a full backward); ``loss_fn(output)``
    defaults to the mean square of every floating output. Each candidate is measured at two shallow
    ``depths`` of ``model`` (default 2 and 4 units) and predicted at ``depth`` (default: the model's
    own). Raises :class:`NoFitError` (with the smallest peak seen and the shortfall) when nothing
    fits. ``measure`` replaces the GPU measurement (``config -> Estimate or (peak GiB, ms)``);
    ``pinnable_gib`` overrides the host's pinnable memory (default: what :mod:`gradseam.tools.host`
    reads, less its margin). ``block_gib``: each block's frozen weights in GiB at full depth, forward
    order; when the weights are what does not fit, rungs are tried with some of them streamed (measured
    on the GPU: read from ``model`` unless given; with ``measure=``, only if given). ``progress(line, done)`` hears
    of each candidate as it starts (``done`` False) and as it ends, with its own seconds (``done`` True): a large
    model's ladder takes minutes. ``link_gib_s``: the host link's rate, from which streamed rungs' steps are
    modelled (:mod:`gradseam.tools.host_link`; measured on the GPU unless given; with ``measure=``, only if given).
    Measured on the GPU, ``model`` is left as it was: the blocks each cut leaves out wait in host memory while it runs
    (:mod:`gradseam.tools.parking`), and every ``.grad`` and the random generators' states are put back
    (:class:`gradseam.modules.untouched`).
    """
    gpu_gib = parse_size(_gpu_argument(gpu, budget))
    supports_interval = True
    note = ""
    around: list[AbstractContextManager[Any]] = []  # what the GPU measurement runs inside
    if measure is None:
        measure, note, static_gib, supports_interval = _gpu_measure(model, example_inputs, loss_fn, static_gib,
                                                                    depths, depth, plan)
        measure = stopping_at_what_is_left_behind(measure, model)
        from ..patcher import family_for
        from .host_link import measure_model_gib_s

        family = family_for(model)
        if block_gib is None:
            block_gib = frozen_block_gib(model, family, plan)
        if link_gib_s is None and block_gib and sum(block_gib):
            link_gib_s = measure_model_gib_s(model, family)
        if pinnable_gib is None:
            from .host import pinnable_gib as host_pinnable

            pinnable_gib = host_pinnable()
        from ..modules import untouched
        from .parking import parking

        # the measured steps run on the user's own model: its gradients and random generators are put back after,
        # and each cut is measured with the blocks it leaves out parked in host memory (gradseam.tools.parking), or
        # a model that fits its card with little to spare beside its weights could measure nothing
        around = [untouched(model, example_inputs)]
        if _has_blocks_past(model, plan, depths):
            around.append(parking(model, (lambda line: progress(f"parking: {line}", True)) if progress else None))
    if progress is not None:
        measure = reporting(measure, progress)
    from ..run.compiled import sharing

    with ExitStack() as measuring:
        for context in around:
            measuring.enter_context(context)
        measuring.enter_context(sharing())  # each compiled candidate is patched at two depths: it compiles once
        advice = run_ladder(measure, gpu_gib, static_gib or 0.0, supports_interval=supports_interval,
                            pinnable_gib=pinnable_gib, block_gib=block_gib, link_gib_s=link_gib_s)
    advice.depth_note = note
    from . import mixed_plan

    mixed_plan.attach(advice, model, plan)  # a mix can hold both budgets where no uniform candidate does
    if advice.chosen is None and advice.per_block is None:
        raise NoFitError(advice)
    return advice


def _has_blocks_past(model: Any, plan: Any, depths: tuple[int, int] | None) -> bool:
    """Whether ``model`` has blocks past the deepest cut measured, which only then park: ``gradseam advise`` builds
    its model at that depth already, and parked the difference between its two depths out and back for every
    candidate (2.33 GiB and ~1.5 s a candidate for Flux dev 4k on the H200, for nothing)."""
    from ..modules import resolve
    from ..patcher import family_for
    from .depth import plan_for

    plan = plan or plan_for(model, family_for(model))
    measured = measured_depths(plan, depths)
    if measured is None:
        return False  # measured as it is, uncut
    counts = plan.counts(max(measured))
    return any(len(resolve(model, path) or ()) > kept for path, kept in counts.items())


def measured_depths(plan: Any, depths: tuple[int, int] | None) -> tuple[int, int] | None:
    """The two depths :func:`depth_measure` measures each candidate at (``depths``, else the plan's fit depths), or None
    for a model with too few units of depth to fit from, measured as it is: one answer for it and for what parks."""
    if depths is None and plan.full < 2:
        return None
    return depths or plan.fit_depths(None)


def label_of(config: Mapping[str, Any]) -> str:
    """The ladder's label for ``config`` (``"torch + stream 12"`` for a rung with streamed weights), or the config
    itself where the ladder has none."""
    resident = {k: v for k, v in config.items() if k != STREAM_KEY}
    every = [*LADDER, INTERVAL_STEP, *STRIDE_STEPS]
    label = next((name for name, known in every if known == resident), None)
    if label is None:
        return str(dict(config))
    return f"{label} + stream {config[STREAM_KEY]}" if STREAM_KEY in config else label


def stopping_at_what_is_left_behind(measure: Measure, model: Any) -> Measure:
    """``measure`` raising :class:`GradseamError` after a candidate that leaves GPU memory allocated that was not
    before it (:class:`gradseam.tools.measure.LeftBehind`, as ``auto``'s rows do): every later rung would be
    measured beside that memory, and the advice would compare candidates that did not start from the same GPU."""
    from .measure import LeftBehind, drop_frames, is_oom

    left_behind = LeftBehind(model, "gradseam advise", then="no advice is given from candidates measured so")

    def measured(config: Mapping[str, Any]) -> Estimate | tuple[float, float]:
        before = left_behind.before()
        try:
            got = measure(config)
        except UnsupportedStrategyError as exc:  # the ladder goes on past a refused rung: checked as a measured one
            drop_frames(exc)  # what the refused step held goes with its frames' variables, before the check
            left_behind.check(label_of(config), before, failed=False)
            raise
        except Exception as exc:
            if not is_oom(exc):
                raise  # any other failure ends the ladder as itself, not as the memory its traceback still holds
            drop_frames(exc)
            left_behind.check(label_of(config), before, failed=True)
            raise
        left_behind.check(label_of(config), before, failed=False)
        return got

    return measured


def reporting(measure: Measure, progress: Callable[[str, bool], None]) -> Measure:
    """``measure`` telling ``progress`` of each candidate: its label as it starts, then how it ended (measured,
    out of memory, unsupported) with its own seconds and the total so far."""
    import time

    total = [0.0, 0]

    def measured(config: Mapping[str, Any]) -> Estimate | tuple[float, float]:
        label = label_of(config)
        progress(f"measuring {label} at two depths", False)
        start = time.perf_counter()
        outcome = "stopped"  # a KeyboardInterrupt
        try:
            got = measure(config)
            outcome = "measured"
            return got
        except UnsupportedStrategyError:
            outcome = "unsupported"
            raise
        except Exception as exc:
            from .measure import is_oom

            outcome = "out of memory" if is_oom(exc) else f"failed ({type(exc).__name__})"
            raise
        finally:
            seconds = time.perf_counter() - start
            total[0] += seconds
            total[1] += 1
            progress(f"{label}: {outcome} in {seconds:.1f} s ({total[1]} candidates, {total[0]:.0f} s so far)", True)

    return measured


def _gpu_argument(gpu: str | float | None, budget: str | float | None) -> str | float:
    """``gpu``, or the deprecated ``budget=`` keyword that stood for it (with a warning)."""
    if budget is None:
        if gpu is None:
            raise TypeError("advise() missing the GPU memory size: advise(model, example_inputs, gpu=...)")
        return gpu
    if gpu is not None:
        raise TypeError("advise(): budget= is the deprecated old name of gpu=; give gpu only.")
    warnings.warn("advise(budget=...) is deprecated; use gpu=... (the GPU memory available to the run, in GiB "
                  "or a size like '40GiB').", DeprecationWarning, stacklevel=3)
    return budget


def _gpu_measure(
    model: Any, inputs: Mapping[str, Any], loss_fn: Callable[[Any], Any] | None, static_gib: float | None,
    depths: tuple[int, int] | None, depth: int | None, plan: Any,
) -> tuple[Measure, str, float, bool]:
    """The default measurement on the model's CUDA GPU: the measure, its depth note, the static memory
    (what is allocated now unless given) and whether the family chunks blocks."""
    import torch

    device = next((p.device for p in model.parameters()), None)
    if not torch.cuda.is_available() or device is None or device.type != "cuda":
        raise GradseamError(
            "gradseam.advise measures GPU memory and needs the model on a CUDA GPU "
            f"(model is on {device}, CUDA available: {torch.cuda.is_available()}). Move the model and "
            "inputs to the GPU, or pass measure= to supply your own measurements."
        )
    from ..patcher import family_for

    supports_interval = family_for(model).supports_interval
    torch.cuda.synchronize()
    if static_gib is None:
        static_gib = torch.cuda.memory_allocated() / GiB
    measure, note = depth_measure(model, inputs, loss_fn, depths=depths, target=depth, plan=plan)
    return measure, note, static_gib, supports_interval
