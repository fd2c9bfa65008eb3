"""The planner behind ``gradient_checkpointing_backend: "auto"``: measure, cache, search, answer a config.

:mod:`gradseam.auto` calls :func:`plan` at a model's first training forward with that forward's inputs.
What it does, and why each step is where it is:

1. **The costs.** Every candidate a block can run on its own (:data:`CANDIDATES`: no checkpointing and
   gradseam's backends with their attention settings and compiler budgets, the rungs of advise's ladder
   that ``gradient_checkpointing_blocks`` can name) is measured on this model, with these inputs, at two
   shallow depths, exactly as ``gradseam advise`` measures it (:func:`gradseam.tools.advise.depth_measure`):
   the line through the two depths says what each unit of depth adds to the step time, to the GPU memory
   held through the step and to the pinned host memory. A few seconds per candidate, one line of progress
   each on stderr.
2. **The cache.** The table is written to disk (:mod:`gradseam.tools.cost_cache`), keyed by everything that
   changes it: the model's class, config and block classes, the inputs' shapes and dtypes, the parameters'
   dtypes and how many train, the GPU's name, torch's and gradseam's versions. The next run with the same key
   (a restart, another budget, another rank) reads it and measures nothing.
3. **The plan.** Within the GPU budget (``gradient_checkpointing_gpu_memory``, default: what the GPU has free
   plus what this process holds, within its memory fraction, less 5%) and the host budget
   (``gradient_checkpointing_host_memory``, default: three quarters of the host's available memory), the
   fastest uniform candidate that fits (advise's rule) and the fastest per-block mix
   (:mod:`gradseam.tools.mixed_plan`, an exact search) are found; the mix is the plan when it is predicted at
   least 0.5% faster, or when no uniform candidate fits. The same table and budgets give the same plan.
4. **Weights too.** Where the fastest candidate does not fit, the frozen weights may be what does not: as in
   advise, the fastest per-block candidates are also tried with every block's weights streamed from host
   memory (``+ stream all``, for the mix to stream some units and keep the rest resident), and where nothing
   fits, each candidate with the fewest blocks streamed that free its shortfall (``+ stream N``). Which of these
   a budget asks for depends on the budget, so they are measured only when asked for (on the GPU, at the same
   two depths), added to the cached table and read from it next time: the table stays one per model and
   shapes, and a plan read from it is the plan measured. A model with nothing frozen to stream (a full
   fine-tune, quantized weights) gets no such candidate. A model larger than its GPU budget, whose blocks' weights
   have been in host memory since patch time (:mod:`gradseam.auto`), is planned the same way, its weights counted
   as if resident: a candidate keeps resident the blocks of the cut model lent to the GPU for its step
   (:func:`gradseam.handle.lending`), a streamed one runs from the host copies it borrows, and the plan keeps
   resident what the budget holds (it streamed every block until the twentieth session: Flux dev 4k at 16 GiB,
   886 ms against 601 ms by hand). A model that fits its GPU but leaves no room to measure anything beside its
   weights (every candidate ran out of memory: HunyuanVideo 1.5 at 480p x 121 frames under 24 GiB) is planned so
   too: :class:`gradseam.auto.NoRoomBesideWeights` asks the runtime to put its blocks' weights in host memory, and
   the rows that ran out of memory are measured again. Before that, a resident model's candidates are measured with
   the blocks outside each cut parked in host memory (:mod:`gradseam.tools.parking`, from the thirty-second
   session): beside the weights they run, not the whole model's, so that case is left for a cut model that does not
   fit even alone.

5. **The plan run once.** Before the first step runs the plan, :mod:`gradseam.tools.plan_check` runs it on the whole
   model (a warm-up, two where blocks compile, then one timed step) and plans again where it did not hold the budgets or ran well slower than
   predicted (the fits through two shallow depths are lines, and on an H100 one of Flux's was 40% off at the real
   depth, and a mix predicted 6% under its budget ran out of memory). A plan that held but whose step retried many
   allocations near the GPU budget is planned again to leave more room, and the faster of the two runs (on an H100
   under 32 GiB, HunyuanVideo 1.5 stepped 10% faster with 20 blocks' weights streamed for room). What each plan took
   is cached with the table, so a run reading the table settles on the same plan without running it.

Without a CUDA model and with no cached table nothing can be measured (the CPU has no allocator peak to
read): every block then runs :data:`DEFAULT` (whole-block recompute, ``"torch"``), and a warning says what
would have been measured. Under ``torch.distributed`` with several processes, measuring is refused (each
rank would time a different machine's noise and could plan differently, and a measured backward would fire
the data-parallel wrapper's gradient hooks): the cached table is used, so run one step in a single process
first (or ``gradseam advise`` on the same shapes), as the error says.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

from ..auto import NoRoomBesideWeights, Planned, Request
from ..config import BLOCK_KEYS, STREAM_KEY, CheckpointConfig
from ..errors import GradseamError, UnsupportedStrategyError, warn_once
from . import cost_cache, plan_check
from .advise import LADDER, label_of, run_ladder
from .compiled import compiles, gradseam_keys
from .estimates import Advice, Estimate, Measure, NoFitError
from .measure import LeftBehind, compute_device

GiB = 1 << 30
DEFAULT: dict[str, Any] = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch"}
GPU_MARGIN = 0.05  # of the default GPU budget, left to the allocator's fragmentation and the optimizer's first step


def blockwise(config: Mapping[str, Any]) -> bool:
    """Whether one block can run ``config`` on its own: only keys an entry of gradient_checkpointing_blocks sets."""
    return set(gradseam_keys(config)) == set(config) and set(config) <= set(BLOCK_KEYS)


CANDIDATES: list[tuple[str, dict[str, Any]]] = [(label, config) for label, config in LADDER if blockwise(config)]


# (request) -> (measure, a sentence on the depths it measures at, the static GPU memory in GiB)
MeasureOn = Callable[[Request], "tuple[Measure, str, float]"]


# (request) -> a measure that runs a config on the whole model (advise.full_depth_check on the model's GPU)
CheckOn = Callable[[Request], Measure]


def plan(request: Request, *, measure_on: MeasureOn | None = None, check_on: CheckOn | None = None,
         cache_dir: str | None = None) -> Planned:
    """The explicit config ``request.model`` runs from its first training step (see the module docstring).
    ``measure_on`` measures the candidates and ``check_on`` runs the plan on the whole model (both default to the
    model's CUDA GPU; with ``measure_on`` given and no ``check_on``, the plan is not run before the step).
    Every patch the measuring and the check make shares its compiled block functions
    (:func:`gradseam.run.compiled.sharing`): a compiled candidate compiles once, not at each depth and again for
    the check."""
    from ..run.compiled import sharing

    with sharing():
        return _plan(request, measure_on, check_on, cache_dir)


def _plan(request: Request, measure_on: MeasureOn | None, check_on: CheckOn | None, cache_dir: str | None) -> Planned:
    import torch

    cuda = compute_device(request.model).type == "cuda"
    candidates = CANDIDATES
    key = cost_cache.key_of(request, candidates)
    table = cost_cache.load(key, cache_dir)
    source = "cached"
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1
    rows = _Rows(request, measure_on or gpu_measure_on) if (measure_on is not None or cuda) and not distributed \
        else None
    if table is not None and not table.complete and rows is None:
        table = None  # a run stopped while measuring: only a run that can measure finishes it
    if table is not None and rows is not None and (limit := gpu_limit_gib(compute_device(request.model))) is not None:
        # a row that ran out of memory says so only of the GPU memory it was measured within: a table measured
        # under a 32 GiB cap (bench's "auto @ 32GiB") marked every eager candidate of HunyuanVideo 1.5 at 480p out
        # of memory, and without this a later run on the whole 80 GiB card read them as not fitting any budget
        outgrown = table.forget_outgrown(limit)
        if outgrown:
            print(f"gradseam auto: {type(request.model).__name__}: cached rows that ran out of memory within less GPU "
                  f"memory than this process may use ({limit:.2f} GiB) are measured again (a streamed one where a "
                  f"budget asks for it): {', '.join(outgrown)}", file=sys.stderr, flush=True)
    if table is None or not table.complete:
        if measure_on is None and not cuda:
            return _default(request, cost_cache.directory(cache_dir))
        if distributed:
            raise GradseamError(
                "gradient_checkpointing_backend \"auto\" found no measured costs for this model and these shapes, "
                f"and does not measure under torch.distributed ({torch.distributed.get_world_size()} processes): "
                "each rank would plan from its own timing noise, and a measured backward would fire the data-parallel "
                "gradient hooks. Run one step in a single process first (the costs are cached in "
                f"{cost_cache.directory(cache_dir)} and every rank reads them), or name a backend.")
        assert rows is not None
        table = measure(rows, candidates, table, save=lambda partial: cost_cache.save(key, partial, cache_dir))
        source = "measured"
    weights = streamable_gib(request)
    if weights and rows is not None and not request.streamed and _nothing_fitted(table):
        raise _no_room_beside_weights(request, table, lambda: cost_cache.save(key, table, cache_dir))
    static = torch.cuda.memory_allocated(compute_device(request.model)) / GiB if cuda else table.static_gib
    if request.streamed and weights:
        # a model larger than its GPU holds no block's weights there now: counted as if resident, as for any model,
        # each unit then carries its own share, on the GPU where the plan keeps it, in host memory where it streams
        static += sum(weights)
    static += optimizer_gib(request.model)  # allocated at the optimizer's first step, after this forward
    gpu = request.gpu_gib if request.gpu_gib is not None else default_gpu_gib(request.model) if cuda else None
    if gpu is None:
        raise GradseamError(
            "gradient_checkpointing_backend \"auto\": the model is not on a CUDA GPU, so its memory cannot be read; "
            "set gradient_checkpointing_gpu_memory (e.g. \"24GiB\").")
    host = request.host_gib if request.host_gib is not None else _host_default()
    known, checked, link = len(table.results), len(table.checked), table.link_gib_s
    if weights and table.link_gib_s is None and rows is not None and cuda:
        table.link_gib_s = rows.link_gib_s()  # what a streamed candidate's step is modelled from
    check_with = check_on or (gpu_check_on if measure_on is None and cuda else None)
    block_gib = weights
    more = rows.one if rows is not None else None

    # a model larger than its GPU streams most of its blocks, so every per-block candidate is measured streamed
    # for the mix (Wan 2.1 14B at 24 GiB ran three streamed kinds); a model that fits gets advise's two fastest
    def rechoose(gpu_gib: float, host_gib: float | None) -> Advice:
        return choose(table, gpu_gib, static, host_gib, request.model, block_gib=block_gib, more=more,
                      link_gib_s=table.link_gib_s,
                      candidates=candidates, saved=lambda kept: cost_cache.save(key, kept, cache_dir),
                      streamed_per_block=len(candidates) if request.streamed else None)

    try:
        # one parking session for the streamed rows a budget asks for, each measured when asked, between the plan's
        # checks: the weights outside the cut leave the GPU once, not once a row (HunyuanVideo 1.5's 14.8 GiB took
        # 12 s each way and back on an H100); each check brings them all back first
        with rows.parked() if rows is not None else nullcontext():
            advice = rechoose(gpu, host)
            check = rows.checker(check_with, lambda config: streamed_weights_gib(request, config, weights)) \
                if rows is not None and check_with else None
            settled = plan_check.settle(advice, table, check, rechoose, gpu_gib=gpu, host_gib=host,
                                        depth=table.depth_note.split(" (")[0],
                                        saved=lambda: cost_cache.save(key, table, cache_dir))
            advice = settled.advice
    finally:
        if len(table.results) > known or len(table.checked) > checked or table.link_gib_s != link:
            # the next run reads what this one measured
            cost_cache.save(key, table, cache_dir)
    config = plan_check.config_of(advice)
    report = _report(advice, table, source, len(table.results) - known) + settled.report()
    if rows is not None and rows.seconds:
        report += f"; measuring took {rows.seconds:.1f} s"
    if request.streamed_for_room:
        report = (f"nothing could be measured beside the model's weights on the GPU, so every block's frozen weights "
                  f"({sum(weights or ()):.2f} GiB) were in host memory until planned; {report}")
    elif request.streamed:
        report = (f"the model being larger than the GPU budget, every block's frozen weights "
                  f"({sum(weights or ()):.2f} GiB) were in host memory until planned; {report}")
    measured = None
    if settled.measured is not None:
        measured = {"gpu_gib": advice.static_gib + settled.measured.peak_gib,
                    "host_gib": settled.measured.pinned_gib, "step_ms": settled.measured.step_ms}
        if settled.measured.alloc_retries is not None:
            measured["alloc_retries"] = settled.measured.alloc_retries
    return Planned(CheckpointConfig.from_dict(config), source, report, plan_check.predicted(advice), measured)


def _nothing_fitted(table: cost_cache.Table) -> bool:
    """Whether no candidate of ``table`` was measured and at least one ran out of memory."""
    results = table.results.values()
    return not any(isinstance(r, Estimate) for r in results) \
        and any(isinstance(r, str) and r.startswith("OOM") for r in results)


def _no_room_beside_weights(request: Request, table: cost_cache.Table,
                            save: Callable[[], Any]) -> NoRoomBesideWeights:
    """What ``"auto"`` raises when every candidate ran out of memory beside the model's resident weights: the hook
    then moves them to host memory and plans again (:class:`gradseam.auto.NoRoomBesideWeights`). The rows that ran
    out of memory leave the table first (saved so): measured with the weights resident, they say nothing of the
    candidates with the weights in host memory, and the next pass measures them so."""
    name = type(request.model).__name__
    limit = gpu_limit_gib(compute_device(request.model))
    within = f" within {limit:.2f} GiB of GPU memory" if limit is not None else ""
    dropped = table.forget_out_of_memory()
    save()
    print(f"gradseam auto: {name}: every candidate measured ({len(dropped)}) ran out of memory beside the model's "
          f"{table.static_gib:.2f} GiB of weights and inputs{within}; every block's frozen weights go to host memory, "
          "and the candidates are measured again, each with only the blocks it runs on the GPU",
          file=sys.stderr, flush=True)
    return NoRoomBesideWeights(
        f"gradient_checkpointing_backend \"auto\": no candidate could be measured beside {name}'s "
        f"{table.static_gib:.2f} GiB of weights and inputs{within}: every one ran out of memory ({len(dropped)} "
        f"measured, for {table.depth_note}).")


def streamed_weights_gib(request: Request, config: Mapping[str, Any], weights: list[float] | None) -> float:
    """The frozen weights ``config`` streams, in GiB: the blocks its plan streams, each block's share of
    ``weights`` (in forward order, as :func:`streamable_gib` lists them)."""
    if not weights:
        return 0.0
    from ..modules import resolve
    from ..planning import plan as plan_of

    order = [(bl.path, i) for bl in request.family.block_lists
             if (found := resolve(request.model, bl.path)) is not None for i in range(len(found))]
    at = {where: gib for where, gib in zip(order, weights)}
    streamed = plan_of(request.model, request.family, CheckpointConfig.from_dict(dict(config))).streamed
    return sum(at.get(where, 0.0) for where in streamed)


def streamable_gib(request: Request) -> list[float] | None:
    """Each block's frozen weights in GiB (what streaming would move), or None when no block has any (a full
    fine-tune, quantized weights): then no candidate streams."""
    from .advise import frozen_block_gib

    found = frozen_block_gib(request.model, request.family)
    return found if sum(found) > 0 else None


# (label, config) -> its estimate, measured now and added to the table; None: rows the table lacks cannot be measured
More = Callable[[str, Mapping[str, Any]], "Estimate | str"]


def choose(table: cost_cache.Table, gpu_gib: float, static_gib: float, host_gib: float | None, model: Any, *,
           block_gib: list[float] | None = None, more: More | None = None,
           candidates: list[tuple[str, dict[str, Any]]] = CANDIDATES,
           saved: Callable[[cost_cache.Table], Any] | None = None,
           streamed_per_block: int | None = None, link_gib_s: float | None = None) -> Advice:
    """advise's choice among the table's candidates, then the fastest mix (raises :class:`NoFitError`).

    With ``block_gib``, candidates with streamed weights take part as in advise (the fastest per-block ones with
    every block streamed, and where nothing fits, the fewest blocks streamed that free the shortfall): those the
    table lacks are measured with ``more`` and added to it, or, without ``more``, left out as not measured.
    ``saved(table)`` is called after each row added: a run stopped meanwhile (a time limit's SIGTERM ends Python
    without running ``finally``; on an H100, Flux's compiled rows with 31 blocks streamed took 68 s each) keeps what
    it measured, and the next run measures only the rest. ``streamed_per_block``: how many per-block candidates
    are measured with every block streamed (advise's default where None). ``link_gib_s``: the host link's rate, from
    which the streamed candidates' steps are modelled (:mod:`gradseam.tools.host_link`)."""
    from . import mixed_plan

    def from_table(config: Mapping[str, Any]) -> Estimate:
        found = table.lookup(config)
        if found is None and config.get(STREAM_KEY):
            if more is None:  # not cached either: a run that can measure it will
                raise UnsupportedStrategyError(
                    "not measured: a candidate with streamed weights is measured on the model's CUDA GPU, in one "
                    "process, at the first training step that needs it")
            label = label_of(config)
            found = more(label, config)
            table.add(label, config, found)
            if saved is not None:
                saved(table)
        if found is None:
            found = f"unsupported: {dict(config)} is not a measured candidate"
        if isinstance(found, str):
            if found.startswith("OOM"):
                raise torch_oom(found)
            raise UnsupportedStrategyError(found)
        return found

    # the streamed rows a budget measured are read through from_table, where run_ladder asks for them: climbed
    # as rungs, they would change which rows it asks for next, and a cached run would plan unlike a measured one
    base = {label for label, _ in candidates}
    ladder = [(label, config) for label, config in table.ladder() if label in base]
    advice = run_ladder(from_table, gpu_gib, static_gib, pinnable_gib=host_gib, ladder=ladder,
                        block_gib=block_gib, win_back=False, streamed_per_block=streamed_per_block,
                        link_gib_s=link_gib_s)
    advice.depth_note = table.depth_note
    mixed_plan.attach(advice, model)
    if advice.chosen is None and advice.per_block is None:
        raise NoFitError(advice)
    return advice


def torch_oom(reason: str) -> BaseException:
    """A cached failure raised again, carrying the memory its step began with as a live one does
    (:func:`gradseam.tools.measure.allocated_when_measuring_began`)."""
    import torch

    from .measure import BEGAN_WITH

    exc = torch.OutOfMemoryError(reason)
    began = cost_cache.began_gib(reason)
    if began is not None:
        setattr(exc, BEGAN_WITH, began * GiB)
    return exc


class _Rows:
    """Measures rows of the table on ``request``'s model, one line of progress each; the measurement (advise's
    two-depth one on the GPU) is set up at the first row."""

    def __init__(self, request: Request, measure_on: MeasureOn) -> None:
        self.request, self.measure_on = request, measure_on
        self._run: tuple[Measure, str, float] | None = None
        self.seconds = 0.0  # spent measuring rows, for the last progress line
        self.took: list[tuple[bool, float]] = []  # each row measured: whether it compiles, and its seconds
        self.left_behind = LeftBehind(request.model, 'gradient_checkpointing_backend "auto"',
                                      then="what was measured before it is cached, and the next run resumes from there")

    @property
    def setup(self) -> tuple[Measure, str, float]:
        if self._run is None:
            self._run = self.measure_on(self.request)
        return self._run

    def one(self, label: str, config: Mapping[str, Any], progress: str = "",
            after: Sequence[Mapping[str, Any]] = ()) -> Estimate | str:
        """The row's estimate, or why it has none (``"unsupported: ..."``, ``"OOM ..."``). ``after``: the rows still
        to measure after this one, whose time the progress line estimates."""

        run, note, _ = self.setup
        name = type(self.request.model).__name__
        print(f"gradseam auto: {name}: measuring {progress}{label} ({note})", file=sys.stderr, flush=True)
        # each candidate's own time, so a user waiting on a big model sees where the planning goes (compiled
        # candidates compile at both depths; a streamed one copies every block's weights in twice a step)
        # what it ran out of memory within is part of the result: a larger limit measures it again
        limit = gpu_limit_gib(compute_device(self.request.model))
        with self.parked():
            outcome, seconds = self._timed(run, config, lambda what, exc: cost_cache.oom_while_measuring(
                f"{what} (at {where_raised(exc)}{began_with(exc)})", limit), unsupported=True, label=label)
        self.took.append((compiles(config), seconds))
        result = "measured" if isinstance(outcome, Estimate) else outcome.split(":")[0]
        left = self.left(after)
        print(f"gradseam auto: {name}: {progress}{label}: {result} in {seconds:.1f} s"
              + (f"; about {left:.0f} s left for the {len(after)} still to measure" if left is not None else ""),
              file=sys.stderr, flush=True)
        return outcome

    def parked(self) -> AbstractContextManager[Any]:
        """A parking session (:mod:`gradseam.tools.parking`): while a row is measured on the model cut to a shallow
        depth, the blocks it leaves out wait in host memory, so that a row is measured beside the weights it runs
        and not beside the whole model's (every candidate of HunyuanVideo 1.5 at 480p under 24 GiB ran out of memory
        beside them on an H100). Reentrant, so :func:`measure` holds one session across its rows. Not for a model
        whose weights a set-aside stream holds in host memory already (``request.streamed``)."""
        if self.request.streamed:
            return nullcontext()
        from .parking import parking

        name = type(self.request.model).__name__
        return parking(self.request.model, lambda line: print(f"gradseam auto: {name}: {line}", file=sys.stderr,
                                                              flush=True))

    def link_gib_s(self) -> float | None:
        """The host link's rate, measured with the model's largest block (:mod:`gradseam.tools.host_link`)."""
        from .host_link import measure_model_gib_s

        name = type(self.request.model).__name__
        start = time.perf_counter()
        rate = measure_model_gib_s(self.request.model, self.request.family, compute_device(self.request.model))
        if rate is not None:
            print(f"gradseam auto: {name}: host link {rate:.1f} GiB/s (one block's weights copied in, measured in "
                  f"{time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
        return rate

    def left(self, after: Sequence[Mapping[str, Any]]) -> float | None:
        """The seconds ``after`` should take, each row at the mean of the rows measured so far that compile as it
        does or not (a compiled row compiles its blocks at both depths, and took 15 to 68 s for Flux dev 4k on an
        H100 where an eager one took 2 to 3 s), or of all rows where none of its kind was measured yet."""
        if not after or not self.took:
            return None

        def mean(times: list[float]) -> float:
            return sum(times) / len(times)

        overall = mean([seconds for _, seconds in self.took])
        by_kind = {kind: mean([s for k, s in self.took if k == kind]) for kind, _ in self.took}
        return sum(by_kind.get(compiles(config), overall) for config in after)

    def _timed(self, run: Measure, config: Mapping[str, Any], oom: Callable[[str, BaseException], str], *,
               unsupported: bool = False, label: str = "the plan") -> tuple[Estimate | str, float]:
        """``run(config)``'s estimate, or ``oom(first line, exception)`` for an out-of-memory error (and, with
        ``unsupported``, ``"unsupported: ..."`` for a refused config), and the seconds it took (added to the total).
        Raises :class:`GradseamError` where the run left GPU memory allocated that was not before it
        (:class:`gradseam.tools.measure.LeftBehind`)."""
        from .measure import is_oom

        before = self.left_behind.before()
        start = time.perf_counter()
        try:
            got = run(dict(config))
            outcome: Estimate | str = got if isinstance(got, Estimate) else Estimate(*got)
        except UnsupportedStrategyError as exc:
            if not unsupported:
                raise
            outcome = f"unsupported: {exc}"
        except Exception as exc:
            if not is_oom(exc):
                raise
            outcome = oom(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, exc)
        seconds = time.perf_counter() - start
        self.seconds += seconds
        # the measuring call released memory while the error's traceback still held the failed step's tensors; with
        # the exception gone they are free, and go back before the check reads what is left
        self.left_behind.check(label, before, failed=isinstance(outcome, str) and outcome.startswith("OOM"))
        return outcome, seconds

    def checker(self, check_on: CheckOn, streamed_gib: Callable[[Mapping[str, Any]], float]) -> Measure:
        """``check_on``'s whole-model run, with a line of progress before and after, and an out-of-memory error
        answered as ``"OOM ..."`` (the plan is then planned again): what :func:`plan_check.settle` runs a plan with.

        Its peak is read above the static memory the planner counts, every block's weights in it, as the plan's
        prediction is: a run's peak is above what was allocated when its step began, which lacks the weights the
        plan streams (``streamed_gib(config)``: they left the GPU when it was patched; for a model larger than its GPU
        they were never there, and the blocks it keeps resident came to it before the step). Read as it is, a plan
        streaming 9.5 GiB of weights would seem to take 9.5 GiB more than it does. Its pinned figure is the
        activations' pool, and the streamed weights are pinned beside it: added, as the host budget counts them (read
        alone, Flux dev 4k's mix under 12 GiB on an H100 showed 3.27 GiB pinned against 15.64 predicted, and a plan
        over the host budget by its weights would have passed the check)."""
        made: list[Measure] = []
        name = type(self.request.model).__name__

        def check(config: Mapping[str, Any]) -> Estimate | str:
            from .parking import session_of

            if not made:
                made.append(check_on(self.request))
            parked = session_of(self.request.model)
            if parked is not None:
                parked.restore()  # the whole model runs: every block back before the run is timed
            print(f"gradseam auto: {name}: running the plan on the whole model before its first step",
                  file=sys.stderr, flush=True)
            outcome, seconds = self._timed(made[0], config, lambda what, exc: f"OOM on the whole model: {what}")
            if isinstance(outcome, Estimate):
                weights = streamed_gib(config)
                outcome = replace(outcome, peak_gib=outcome.peak_gib - weights, pinned_gib=outcome.pinned_gib + weights)
            result = "ran" if isinstance(outcome, Estimate) else "out of memory"
            print(f"gradseam auto: {name}: the plan {result} in {seconds:.1f} s", file=sys.stderr, flush=True)
            return outcome

        return check


def began_with(exc: BaseException) -> str:
    """What a cached failure says of the memory ``exc``'s step began with (:func:`cost_cache.began_note`)."""
    from .measure import allocated_when_measuring_began

    return cost_cache.began_note(allocated_when_measuring_began(exc))


def where_raised(exc: BaseException) -> str:
    """Where ``exc`` was raised, for a cached failure to say: the deepest frame in gradseam's own code below the
    measuring call, and the innermost frame (which tensor was being made). A row that runs out of memory for a
    reason of gradseam's (weights brought onto the GPU, as Wan 14B's measuring did on the H200) then names it in
    the cost table and the report, without a debugger on the machine that saw it."""
    import os
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)[1:]  # below this measuring call
    if not frames:
        return "this measuring call"
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def ours(frame: traceback.FrameSummary) -> bool:
        return os.path.abspath(frame.filename).startswith(package + os.sep)

    def short(frame: traceback.FrameSummary) -> str:
        path = os.path.abspath(frame.filename)
        path = "gradseam/" + os.path.relpath(path, package) if ours(frame) else os.path.join(*path.split(os.sep)[-2:])
        return f"{path}:{frame.lineno} {frame.name}"

    mine = [f for f in frames if ours(f)]
    innermost = short(frames[-1])
    if mine and mine[-1] is not frames[-1]:
        return f"{short(mine[-1])}; innermost {innermost}"
    return innermost


def measure(rows: _Rows, candidates: list[tuple[str, dict[str, Any]]], partial: cost_cache.Table | None = None, *,
            save: Callable[[cost_cache.Table], Any] | None = None) -> cost_cache.Table:
    """Every candidate measured (a failure recorded with its reason), with a line of progress each; ``partial``, a
    cached table that lacks rows (a stopped run left it incomplete, or rows were dropped to measure again), is
    finished instead (its rows are kept, one line says so). ``save`` is called with the table after each candidate,
    so a run stopped in turn loses one candidate at most."""
    table = partial or cost_cache.Table(candidates, {}, 0.0, "", complete=not candidates)
    if partial is not None:
        print(f"gradseam auto: {type(rows.request.model).__name__}: resuming: {len(partial.results)} of "
              f"{len(partial.candidates)} candidates are cached; measuring the other {len(partial.missing())}",
              file=sys.stderr, flush=True)
    with rows.parked():  # one session for every row: the weights outside the cut cross the link once each way
        for position, (label, config) in enumerate(table.candidates, 1):
            if label in table.results:
                continue
            after = [later for name, later in table.candidates[position:] if name not in table.results]
            table.results[label] = rows.one(label, config, f"{position}/{len(table.candidates)} ", after)
            _, table.depth_note, table.static_gib = rows.setup
            table.complete = not table.missing()
            if save is not None:
                save(table)
    return table


def gpu_check_on(request: Request) -> Measure:
    """advise's whole-model run on the model's GPU, with the step's own inputs."""
    from .advise import full_depth_check

    return full_depth_check(request.model, request.inputs, family=request.family)


def gpu_measure_on(request: Request) -> tuple[Measure, str, float]:
    """advise's two-depth measurement on the model's GPU, with the step's own inputs."""
    import torch

    from .advise import depth_measure

    device = compute_device(request.model)
    torch.cuda.synchronize(device)
    static = torch.cuda.memory_allocated(device) / GiB
    run, note = depth_measure(request.model, request.inputs, family=request.family)
    return run, note, static


OPTIMIZER_MOMENTS = 2  # Adam's (and AdamW's) two moments per trainable parameter


def optimizer_gib(model: Any) -> float:
    """What the optimizer's state will hold on the GPU: not allocated yet at the first forward (optimizers make it
    at their first step), so counted here, as Adam's two moments in the trainable parameters' own dtypes (a LoRA:
    megabytes; a full fine-tune: twice the weights)."""
    return OPTIMIZER_MOMENTS * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / GiB


def default_gpu_gib(model: Any) -> float:
    """What the GPU has free plus what this process holds, within its per-process memory fraction, less 5%."""
    import torch

    device = compute_device(model)
    free, _ = torch.cuda.mem_get_info(device)
    limit = gpu_limit_gib(device)
    assert limit is not None, "called for a model on a CUDA GPU"
    usable = min(free + torch.cuda.memory_reserved(device), limit * GiB)
    return usable * (1 - GPU_MARGIN) / GiB


def gpu_limit_gib(device: Any) -> float | None:
    """The GPU memory this process may allocate on ``device`` (the card's, within its per-process memory fraction:
    what an out-of-memory error while measuring is relative to), or None off a CUDA GPU."""
    from ..modules import gpu_limit_bytes

    limit = gpu_limit_bytes(device)
    return limit / GiB if limit is not None else None


def _host_default() -> float | None:
    from .host import pinnable_gib

    return pinnable_gib()


def _default(request: Request, where: str) -> Planned:
    name = type(request.model).__name__
    labels = ", ".join(label for label, _ in CANDIDATES)
    why = (f"{name} is on {compute_device(request.model)}, not a CUDA GPU, and no measured costs for it and these shapes are "
           f"cached in {where}")
    warn_once(f"gradseam: gradient_checkpointing_backend \"auto\" measures each candidate ({labels}) at two shallow "
              "depths of the model on its CUDA GPU (one forward and backward each, a few seconds) and plans each block "
              f"within the GPU and host memory; {why}. Every block runs the default, backend 'torch' (whole-block "
              "recompute), instead.")
    if request.streamed:  # the weights stay in host memory: moved back, they would not fit the GPU
        return Planned(CheckpointConfig.from_dict({**DEFAULT, STREAM_KEY: "all"}), "default",
                       f"{why}: backend 'torch' on every block, every block's weights streamed")
    return Planned(CheckpointConfig.from_dict(DEFAULT), "default", f"{why}: backend 'torch' on every block")


def _report(advice: Advice, table: cost_cache.Table, source: str, added: int = 0) -> str:
    how = "measured now" if source == "measured" else "read from the cost cache"
    if added:
        how += f", {added} with streamed weights measured now for this budget"
    if advice.per_block is not None:
        mix = advice.per_block
        what = (f"a per-block plan, {mix.plan.describe()}: GPU {mix.gpu_words()}, pinned host "
                f"{mix.plan.host_gib:.1f} GiB, step {mix.plan.time_ms:.1f} ms predicted")
        if advice.chosen is not None:
            what += f" (the best uniform candidate, {advice.chosen.label}: {advice.chosen.step_ms:.1f} ms)"
    else:
        chosen = advice.chosen
        what = f"{chosen.label} on every block: step {chosen.step_ms:.1f} ms predicted ({advice.per_block_note})"
    return (f"{what}; costs {how} ({len(table.results)} candidates, {table.depth_note}), GPU budget {advice.gpu_gib:.2f} "
            f"GiB, static memory {advice.static_gib:.2f} GiB (weights, inputs and the optimizer's moments)")
