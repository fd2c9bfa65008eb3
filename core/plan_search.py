"""The fastest per-block plan under a GPU and a host memory budget: the pure search of the planner.

A model has groups of identical blocks (Wan 2.1 14B: one group of 40; Flux: 19 double- and 38
single-stream blocks), and every block of a group picks one of the group's options (:class:`Option`:
a strategy, with what one block of it costs). A :class:`Plan` says how many blocks of each group take each
option; its GPU total is the fixed memory, plus what every block holds through the step, plus the
largest transient among the options it uses (one block's working set is above the held total at a
time, never two). :func:`search` returns the fastest plan whose totals are within a :class:`Budget`,
or ``None``; :func:`least_memory` says how much GPU and host memory any plan needs at least, so that a
caller can say which budget is short. Nothing here measures, imports torch or knows a backend: the
options' labels are the caller's words.

**How it searches.** A plan's largest transient is one of the options' transients, so the search
runs under each *cap* (each distinct transient), allowing the options whose transient is within it
and leaving the cap's room free on the GPU. Under a cap it is a multiple-choice knapsack with two
capacities, solved exactly over sets of states ``(GPU cells, host memory, cost)``: a state another
matches or beats in all three is dropped, since whatever completes it completes the other, no
slower. What keeps the sets small is a Lagrangian bound: for prices ``l, m >= 0`` of a GPU cell and a
GiB of host memory, every plan that fits takes at least ``sum over blocks of min(time + l * cells + m
* host) - l * C - m * H`` (``C``, ``H``: the rooms), and the prices are chosen to make it highest
(the LP bound). An option's excess over its block's cheapest priced one (its reduced cost) is what
choosing it spends of the gap between the bound and a target time; a state that has spent more
cannot finish under the target and is never built. The target starts just above the lowest cap's
bound and doubles (or jumps to the fastest plan found, once it is near) until a plan is found within
it: every plan at least as fast was kept, so that one is the fastest. A cap is skipped in a round
when none of its own options (those at its transient) is within the gap: a lower cap holds every
such plan, with more room.

Under a cap, each group's undominated multisets are built block by block for each half of its
blocks (and for all of them, where their number grows in proportion); each group goes whole to one
of two sides or is cut between them, whichever makes the sides smallest; each side is the merge of
its parts, and the two sides are joined by a sweep with a Fenwick tree of least costs, never pair by
pair. Cutting matters where the best plans mix three options of one group: those multisets grow with
the square of the blocks, so two halves hold a quarter of them each.

**What it costs.** Per cap and round: the states built times the options within the gap, a sort per
block, the merges' pairs, and a join in ``n log n``. The states are the undominated partial plans
within the gap, so their number is the instance's, not a polynomial's: it grows steeply with the gap
(from the LP bound to the best plan), which tight budgets and coarse per-block costs widen. Measured
(one core of the project's 2-core machine, pure Python): 3 groups x 60 blocks x 12 options shaped like
measured strategies, 48 budget pairs from 24 GiB GPU / 32 GiB host to 140 / 256: median 0.2 s, at
most 2.3 s, and 0.03-0.7 s at 100 / 128; one group (what advise plans) of 40-60 units x 20 options:
median 7 ms, at most 1.2 s. The worst seen, 30 s: six block lists under tight budgets, two of them
mixing three options freely.

**What the rounding costs.** GPU memory is counted in cells of ``resolution_gib``, each option's
held memory rounded up, so a plan found always fits. A plan whose GPU total is within its own
rounding of the budget is not seen: less than its block count times ``resolution_gib`` (at the
default 1 MiB, under 0.2 GiB for 180 blocks), and nothing when the costs are multiples of the
resolution. The uniform plans (every block of every group on the option of one label) are checked
exactly besides, so the answer is never slower than the fastest of them that fits. Host memory and
time are kept exactly, as integers over a power of two, so a sum does not depend on the order of its
terms and reordering the groups cannot change the answer.

**Ties.** Among plans of equal time, the one with the most blocks on the earliest options wins
(options listed from the least aggressive to the most): counts are compared group by group in name
order and, within a group, in its options' order. Every plan then has its own cost, so the same input
always gives the same plan.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import islice, product
from operator import itemgetter
from typing import Any

DEFAULT_RESOLUTION_GIB = 1 / 1024  # 1 MiB: finer cells lose less to rounding and cost no more time
_GOLDEN = (math.sqrt(5) - 1) / 2
_PRICE_STEPS = 56  # golden-section steps over the GPU price's logarithm: 45 (its range) * 0.618**56 ~ 1e-10


def _check_cost(owner: str, name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{owner}: {name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class Option:
    """One strategy a block can run, with what one block of it costs (measured, or predicted from two depths).

    ``gpu_gib`` is held through the step (saved activations, and the block's weights when they stay
    on the GPU); ``host_gib`` is pinned host memory (offloaded activations, streamed weights);
    ``transient_gib`` is the GPU memory above the held total while the block runs (its recompute and
    backward working set), which only the largest of a plan's options adds.
    """

    label: str
    time_ms: float
    gpu_gib: float
    host_gib: float = 0.0
    transient_gib: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.label, str) or not self.label:
            raise ValueError(f"Option: label must be a non-empty string, got {self.label!r}")
        for name in ("time_ms", "gpu_gib", "host_gib", "transient_gib"):
            _check_cost(f"Option {self.label!r}", name, getattr(self, name))


@dataclass(frozen=True)
class Group:
    """``count`` identical blocks (one block list of the model) and the options each of them may take."""

    name: str
    count: int
    options: tuple[Option, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Group: name must be a non-empty string, got {self.name!r}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 0:
            raise ValueError(f"Group {self.name!r}: count must be an integer >= 0, got {self.count!r}")
        object.__setattr__(self, "options", tuple(self.options))  # a list is taken, and kept as a tuple
        if not self.options:
            raise ValueError(f"Group {self.name!r}: options is empty; give at least one Option")
        for option in self.options:
            if not isinstance(option, Option):
                raise ValueError(f"Group {self.name!r}: options must be Option objects, got {option!r}")
        labels = [o.label for o in self.options]
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        if repeated:
            raise ValueError(f"Group {self.name!r}: option labels must be unique, repeated: {repeated}")


@dataclass(frozen=True)
class Budget:
    """The GPU memory and pinned host memory a plan may use, in GiB (``math.inf``: no limit)."""

    gpu_gib: float
    host_gib: float

    def __post_init__(self) -> None:
        for name in ("gpu_gib", "host_gib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Budget: {name} must be a number > 0 (math.inf for no limit), got {value!r}")


@dataclass(frozen=True)
class Plan:
    """How many blocks of each group take each option (``counts[i][j]``: group ``i``, option ``j``), and its totals.

    The totals are exact sums of the given costs rounded once to a float, so a plan that fits a
    budget compares as fitting it.
    """

    groups: tuple[Group, ...]
    counts: tuple[tuple[int, ...], ...]
    gpu_gib: float
    host_gib: float
    time_ms: float

    def counts_of(self, group: str) -> dict[str, int]:
        """The blocks of ``group`` on each option it uses, by label, in the options' order."""
        for g, counts in zip(self.groups, self.counts):
            if g.name == group:
                return {o.label: n for o, n in zip(g.options, counts) if n}
        raise KeyError(f"no group {group!r} in the plan; its groups: {[g.name for g in self.groups]}")

    def describe(self) -> str:
        """One line: ``"transformer_blocks: 24 x unsloth-compile, 16 x compile"``, groups separated by ``"; "``."""
        parts = []
        for g in self.groups:
            used = ", ".join(f"{n} x {label}" for label, n in self.counts_of(g.name).items())
            parts.append(f"{g.name}: {used or 'no blocks'}")
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON: the counts by group and label, and the totals."""
        return {
            "groups": {g.name: self.counts_of(g.name) for g in self.groups},
            "gpu_gib": self.gpu_gib,
            "host_gib": self.host_gib,
            "time_ms": self.time_ms,
        }


def evaluate(groups: Sequence[Group], counts: Sequence[Sequence[int]], *, fixed_gpu_gib: float = 0.0,
             fixed_host_gib: float = 0.0, fixed_time_ms: float = 0.0) -> Plan:
    """The :class:`Plan` of the given counts with its exact totals (a hand-written plan's, or a search's)."""
    groups = _checked_groups(groups)
    for name, value in (("fixed_gpu_gib", fixed_gpu_gib), ("fixed_host_gib", fixed_host_gib),
                        ("fixed_time_ms", fixed_time_ms)):
        _check_cost("evaluate", name, value)
    counts = tuple(tuple(c) for c in counts)
    if len(counts) != len(groups) or any(
        len(c) != len(g.options) or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in c)
        or sum(c) != g.count for g, c in zip(groups, counts)
    ):
        raise ValueError(f"counts {counts!r} must give, for each group in order, one integer >= 0 per option "
                         f"summing to the group's count ({[(g.name, len(g.options), g.count) for g in groups]})")
    gpu = Fraction(fixed_gpu_gib)
    host = Fraction(fixed_host_gib)
    time = Fraction(fixed_time_ms)
    transient = Fraction(0)
    for g, c in zip(groups, counts):
        for o, n in zip(g.options, c):
            if n:
                gpu += n * Fraction(o.gpu_gib)
                host += n * Fraction(o.host_gib)
                time += n * Fraction(o.time_ms)
                transient = max(transient, Fraction(o.transient_gib))
    return Plan(groups, counts, float(gpu + transient), float(host), float(time))


def least_memory(groups: Sequence[Group], *, fixed_gpu_gib: float = 0.0,
                 fixed_host_gib: float = 0.0) -> tuple[float, float]:
    """The least GPU memory and the least host memory any plan needs, each on its own, in GiB.

    Why: when :func:`search` finds nothing, these say which budget is short ("needs at least X GiB
    of GPU memory"); when both are within the budgets and still nothing fits, it is the two together
    (what saves GPU memory pins host memory). The GPU figure takes every transient cap in turn, since
    the option holding the least may carry the largest working set.
    """
    groups = _checked_groups(groups)
    _check_cost("least_memory", "fixed_gpu_gib", fixed_gpu_gib)
    _check_cost("least_memory", "fixed_host_gib", fixed_host_gib)
    used = [g for g in groups if g.count]
    best_gpu = math.inf
    for cap in sorted({Fraction(o.transient_gib) for g in used for o in g.options} | {Fraction(0)}):
        held = Fraction(fixed_gpu_gib)
        for g in used:
            allowed = [Fraction(o.gpu_gib) for o in g.options if Fraction(o.transient_gib) <= cap]
            if not allowed:
                break
            held += g.count * min(allowed)
        else:
            best_gpu = min(best_gpu, float(held + cap))
    host = Fraction(fixed_host_gib) + sum(g.count * min(Fraction(o.host_gib) for o in g.options) for g in used)
    return (best_gpu if used else float(fixed_gpu_gib)), float(host)


def _checked_groups(groups: Sequence[Group]) -> tuple[Group, ...]:
    groups = tuple(groups)
    for g in groups:
        if not isinstance(g, Group):
            raise ValueError(f"groups must be Group objects, got {g!r}")
    names = [g.name for g in groups]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"group names must be unique, repeated: {repeated}")
    return groups


def search(groups: Sequence[Group], budget: Budget, *, fixed_gpu_gib: float = 0.0, fixed_host_gib: float = 0.0,
           fixed_time_ms: float = 0.0, resolution_gib: float = DEFAULT_RESOLUTION_GIB) -> Plan | None:
    """The fastest plan whose GPU and host totals are within ``budget``, or ``None`` when none is.

    ``fixed_*`` are the model's costs outside the blocks (weights that stay, inputs, the optimizer;
    the step's time outside the blocks). GPU memory is searched in cells of ``resolution_gib``, held
    costs rounded up, so the plan returned always fits; a plan within its own rounding of the GPU
    budget may be missed (see the module's docstring), except a uniform one, checked exactly.
    Equally fast plans are told apart by the most blocks on the earliest options.
    """
    groups = _checked_groups(groups)
    if not isinstance(budget, Budget):
        raise ValueError(f"budget must be a Budget, got {budget!r}")
    for name, value in (("fixed_gpu_gib", fixed_gpu_gib), ("fixed_host_gib", fixed_host_gib),
                        ("fixed_time_ms", fixed_time_ms)):
        _check_cost("search", name, value)
    if isinstance(resolution_gib, bool) or not isinstance(resolution_gib, (int, float)) or not (
            math.isfinite(resolution_gib) and resolution_gib > 0):
        raise ValueError(f"search: resolution_gib must be a finite number > 0, got {resolution_gib!r}")
    if not any(g.count for g in groups):  # nothing to choose: the fixed costs fit or they do not
        plan = evaluate(groups, [[0] * len(g.options) for g in groups], fixed_gpu_gib=fixed_gpu_gib,
                        fixed_host_gib=fixed_host_gib, fixed_time_ms=fixed_time_ms)
        return plan if plan.gpu_gib <= budget.gpu_gib and plan.host_gib <= budget.host_gib else None
    problem = _Problem(groups, budget, fixed_gpu_gib, fixed_host_gib, fixed_time_ms, resolution_gib)
    best = problem.best_uniform()
    caps = problem.caps()
    if caps:
        low = caps[0].bound_ms
        top = max(cap.slowest_ms for cap in caps) + fixed_time_ms
        step = max(caps[0].margin, (top - low) / 65536)
        while True:
            # every cap whose bound is within the target is searched at it; once the best plan found is
            # within the target, no plan of any cap is faster (each was kept up to the target)
            target = min(low + step, top, math.inf if best is None else problem.time_ms(best[0]))
            for cap in caps:
                if cap.bound_ms <= target + cap.margin:
                    found = cap.cheapest_within(target - cap.bound_ms + cap.margin)
                    if found is not None and (best is None or found[0] < best[0]):
                        best = found
            if target >= top or (best is not None and problem.time_ms(best[0]) <= target):
                break
            step *= 2
            if best is not None and problem.time_ms(best[0]) - low <= 1.5 * step:
                step = problem.time_ms(best[0]) - low  # the plan in hand is near: prove it at once
    if best is None:
        return None
    return evaluate(groups, problem.in_callers_order(best[1]), fixed_gpu_gib=fixed_gpu_gib,
                    fixed_host_gib=fixed_host_gib, fixed_time_ms=fixed_time_ms)


# -- the search's integers --------------------------------------------------------------------------


def _within(value: Fraction, limit: float) -> bool:
    return math.isinf(limit) or value <= Fraction(limit)


def _common_scale(values: list[float]) -> int:
    """The power of two that makes every value an integer: float denominators are powers of two."""
    return max([Fraction(v).denominator for v in values if math.isfinite(v)] + [1])


class _Problem:
    """The input in exact integers, groups in name order (so their order in the call cannot matter).

    A plan's ``cost`` is its time, in integer units, times ``W``, less a lexicographic key of its
    counts (option ``p`` of the concatenated option lists weighs ``base ** (m - 1 - p)``, which
    no count reaches): costs order plans by time and then by the tie rule, and no two plans share one.
    """

    def __init__(self, groups: tuple[Group, ...], budget: Budget, fixed_gpu: float, fixed_host: float,
                 fixed_time: float, resolution: float) -> None:
        self.groups = groups
        self.order = sorted(range(len(groups)), key=lambda i: groups[i].name)
        options = [o for i in self.order for o in groups[i].options]
        self.time_scale = _common_scale([o.time_ms for o in options])
        host_scale = _common_scale([o.host_gib for o in options] + [fixed_host, budget.host_gib])
        base = max([g.count for g in groups] + [1]) + 1
        self.weight = base ** len(options)
        self.budget, self.fixed_gpu, self.fixed_host = budget, fixed_gpu, fixed_host
        self.fixed_time, self.resolution = fixed_time, Fraction(resolution)
        # per group in name order: (count, [(position, option, cells, host, cost)])
        self.table: list[tuple[int, list[tuple[int, Option, int, int, int]]]] = []
        position = 0
        for i in self.order:
            rows = []
            for o in groups[i].options:
                cells = math.ceil(Fraction(o.gpu_gib) / self.resolution)
                time = int(Fraction(o.time_ms) * self.time_scale)
                rows.append((position, o, cells, int(Fraction(o.host_gib) * host_scale),
                             time * self.weight - base ** (len(options) - 1 - position)))
                position += 1
            self.table.append((groups[i].count, rows))
        most_host = Fraction(fixed_host) + sum(n * max(Fraction(o.host_gib) for _, o, *_ in rows)
                                               for n, rows in self.table)
        host_room = most_host if math.isinf(budget.host_gib) else Fraction(budget.host_gib)
        self.host_room = math.floor((host_room - Fraction(fixed_host)) * host_scale)
        self.host_room_gib = float(host_room - Fraction(fixed_host))
        self.lowest: _Cap | None = None  # set by caps(): the cap of the smallest transient

    def time_ms(self, cost: int) -> float:
        """A plan's time outside the fixed part, in ms, from its cost (the key is below one time unit)."""
        return float(Fraction(-(-cost // self.weight), self.time_scale)) + self.fixed_time

    def in_callers_order(self, positions: list[int]) -> list[list[int]]:
        counts = [[0] * len(g.options) for g in self.groups]
        flat = [(i, j) for i in self.order for j in range(len(self.groups[i].options))]
        for p in positions:
            i, j = flat[p]
            counts[i][j] += 1
        return counts

    def best_uniform(self) -> tuple[int, list[int]] | None:
        """The fastest plan with every block on one label (when every group offers it), checked exactly."""
        used = [(n, rows) for n, rows in self.table if n]
        labels = [o.label for _, o, *_ in used[0][1]] if used else []
        best = None
        for label in labels:
            picks = [next((r for r in rows if r[1].label == label), None) for _, rows in used]
            if None in picks:
                continue
            gpu = Fraction(self.fixed_gpu) + sum(n * Fraction(r[1].gpu_gib) for (n, _), r in zip(used, picks))
            gpu += max(Fraction(r[1].transient_gib) for r in picks)
            host = Fraction(self.fixed_host) + sum(n * Fraction(r[1].host_gib) for (n, _), r in zip(used, picks))
            if not (_within(gpu, self.budget.gpu_gib) and _within(host, self.budget.host_gib)):
                continue
            cost = sum(n * r[4] for (n, _), r in zip(used, picks))
            if best is None or cost < best[0]:
                best = (cost, [r[0] for (n, _), r in zip(used, picks) for _block in range(n)])
        return best

    def caps(self) -> list[_Cap]:
        """One search per distinct transient that can fit, the most promising (lowest bound) first."""
        transients = sorted({Fraction(o.transient_gib) for n, rows in self.table if n for _, o, *_ in rows})
        found = []
        for cap in transients or [Fraction(0)]:
            cells = None  # no GPU limit
            if math.isfinite(self.budget.gpu_gib):
                room = Fraction(self.budget.gpu_gib) - Fraction(self.fixed_gpu) - cap
                if room < 0:
                    continue
                cells = math.floor(room / self.resolution)
            allowed = [(n, [r for r in rows if Fraction(r[1].transient_gib) <= cap]) for n, rows in self.table]
            if any(n and not rows for n, rows in allowed):
                continue
            if cells is None:  # no GPU limit: room for every block on its largest option
                cells = sum(n * max(r[2] for r in rows) for n, rows in allowed if n)
            searched = _Cap(self, [(n, rows) for n, rows in allowed if n], cells,
                            {r[0] for _, rows in allowed for r in rows if Fraction(r[1].transient_gib) == cap})
            if searched.possible:
                found.append(searched)
        self.lowest = found[0] if found else None  # transients ascend: no other cap holds its plans
        return sorted(found, key=lambda c: c.bound_ms)


class _Cap:
    """The search under one transient cap: the options within it, its GPU cells, its prices and bound."""

    def __init__(self, problem: _Problem, table: list[tuple[int, list[tuple]]], cells: int, newest: set[int]) -> None:
        self.problem, self.cells = problem, cells
        self.newest = newest  # the positions of the options whose transient is the cap: what no lower cap allows
        # per group: (count, [(cells, host, cost, time ms, host GiB, position)])
        self.table = [(n, [(r[2], r[3], r[4], r[1].time_ms, r[1].host_gib, r[0]) for r in rows])
                      for n, rows in table]
        least_cells = sum(n * min(r[0] for r in rows) for n, rows in self.table)
        least_host = sum(n * min(r[1] for r in rows) for n, rows in self.table)
        self.slowest_ms = sum(n * max(r[3] for r in rows) for n, rows in self.table)
        self.possible = least_cells <= cells and least_host <= problem.host_room
        self.cell_price, self.host_price, bound = self._prices() if self.possible else (0.0, 0.0, 0.0)
        self.margin = 1e-9 * (self.slowest_ms + self.cell_price * cells + self.host_price * problem.host_room_gib + 1)
        self.bound_ms = bound + problem.fixed_time
        if bound > self.slowest_ms + self.margin:
            self.possible = False  # no plan is slower than the slowest, so none fits (weak duality)

    def _lagrangian(self, cell_price: float) -> tuple[float, float]:
        """The best host price for this GPU price, and the bound they give (exact: the bound is piecewise linear)."""
        room = self.problem.host_room_gib
        # per group, the lower envelope of time + cell_price*cells + host_price*host over host_price >= 0
        drops: list[tuple[float, float]] = []
        slope = -room
        lines_of = []
        for n, rows in self.table:
            lines = [(t + cell_price * c, h) for c, _, _, t, h, _ in rows]
            lines_of.append((n, lines))
            a, h = min(lines)
            slope += n * h
            price = 0.0
            while True:
                step = None
                for a2, h2 in lines:
                    if h2 < h:
                        at = max(price, (a2 - a) / (h - h2))
                        if step is None or (at, h2) < step[0:2]:
                            step = (at, h2, a2)
                if step is None:
                    break
                drops.append((step[0], n * (h - step[1])))
                price, h, a = step
        host_price = 0.0
        if slope > 0:
            for at, drop in sorted(drops):
                slope -= drop
                if slope <= 0:
                    host_price = at
                    break
        value = sum(n * min(a + host_price * h for a, h in lines) for n, lines in lines_of)
        return host_price, value - cell_price * self.cells - host_price * room

    def _prices(self) -> tuple[float, float, float]:
        """The GPU and host prices that make the Lagrangian bound highest.

        The bound is concave in the GPU price, so unimodal in its logarithm too: a golden-section
        search over the logarithm finds a price of any scale (per cell, it shrinks with the resolution)
        to the same relative precision. The host price is exact for each GPU price.
        """
        top = 1.0 + max(max(r[3] for r in rows) - min(r[3] for r in rows) for _, rows in self.table)
        while top < 1e12 and self._lagrangian(2 * top)[1] > self._lagrangian(top)[1]:  # still rising: widen
            top *= 2
        low, high = math.log(top) - 64 * math.log(2), math.log(2 * top)
        x1, x2 = high - _GOLDEN * (high - low), low + _GOLDEN * (high - low)
        f1, f2 = self._lagrangian(math.exp(x1))[1], self._lagrangian(math.exp(x2))[1]
        for _ in range(_PRICE_STEPS):
            if f1 < f2:
                low, x1, f1 = x1, x2, f2
                x2 = low + _GOLDEN * (high - low)
                f2 = self._lagrangian(math.exp(x2))[1]
            else:
                high, x2, f2 = x2, x1, f1
                x1 = high - _GOLDEN * (high - low)
                f1 = self._lagrangian(math.exp(x1))[1]
        best = max((0.0, math.exp(x1), math.exp(x2)), key=lambda x: self._lagrangian(x)[1])
        host_price, value = self._lagrangian(best)
        return best, host_price, value

    def cheapest_within(self, gap: float) -> tuple[int, list[int]] | None:
        """The cheapest plan among those whose reduced costs add up to at most ``gap`` (every plan that
        fits within the bound plus ``gap``), or ``None``. The halves, the sides and the join: see the
        module's docstring."""
        cp, hp = self.cell_price, self.host_price
        groups = []
        for n, rows in self.table:
            prices = [r[3] + cp * r[0] + hp * r[4] for r in rows]
            least = min(prices)
            choices = sorted((max(0.0, p - least), c, h, k, pos) for p, (c, h, k, _, _, pos) in zip(prices, rows)
                             if p - least <= gap)
            groups.append((n, choices, min(r[0] for r in rows), min(r[1] for r in rows)))
        if self is not self.problem.lowest and not any(c[4] in self.newest for _, choices, _, _ in groups for c in choices):
            return None  # a plan within the gap uses no option only this cap allows: the lower caps hold them all
        least_cells = sum(n * c for n, _, c, _ in groups)
        least_host = sum(n * h for n, _, _, h in groups)
        # a part of a group may meet every block outside it at its least: pruned against that room
        room = (self.cells - least_cells, self.problem.host_room - least_host)
        parts = []  # per group: {"A": whole, "S": (larger half, smaller half)} with their least cells, host
        for n, choices, cells, host in groups:
            quarter = _grow([(0, 0, 0, 0.0, None)], 0, n // 4, choices, cells, host, room, gap)
            smaller = _grow(quarter, n // 4, n // 2, choices, cells, host, room, gap)
            larger = _grow(smaller, n // 2, n - n // 2, choices, cells, host, room, gap)
            if not larger:
                return None
            whole = None
            if len(smaller) + 8 <= 2.5 * (len(quarter) + 8):  # growing in proportion: worth keeping whole
                whole = _grow(larger, n - n // 2, n, choices, cells, host, room, gap, linear=len(larger))
            half = n // 2
            parts.append({
                "S": ((larger, (n - half) * cells, (n - half) * host), (smaller, half * cells, half * host)),
                **({"A": (whole, n * cells, n * host)} if whole is not None else {}),
            })
        sides = _split(parts)
        built = []
        for side in sides:
            states: list[tuple] = [(0, 0, 0, 0.0, None)]
            left_cells, left_host = least_cells, least_host
            for front, cells, host in sorted(side, key=lambda part: len(part[0])):
                left_cells -= cells
                left_host -= host
                states = _merge(states, front, self.cells - left_cells, self.problem.host_room - left_host, gap)
                if not states:
                    return None
            built.append(states)
        best = _join(built[0], built[1], self.cells, self.problem.host_room)
        if best is None:
            return None
        cost, nodes = best
        return cost, _positions(nodes)


def _grow(states: list[tuple], start: int, until: int, choices: list[tuple], least_cells: int, least_host: int,
          room: tuple[int, int], gap: float, linear: int | None = None) -> list[tuple] | None:
    """A group's undominated multisets of ``until`` blocks from those of ``start`` blocks, one block at a
    time. With ``linear`` (their number at ``start``), ``None`` as soon as they grow faster than in
    proportion to the blocks: the group mixes more than two options freely, and the caller cuts it in
    two instead of paying for the square."""
    by_key = itemgetter(0, 1, 2)
    for done in range(start + 1, until + 1):
        cell_room = room[0] + done * least_cells
        host_room = room[1] + done * least_host
        grown = []
        add = grown.append
        for cells, host, cost, spent, node in states:
            for reduced, dc, dh, dk, pos in choices:
                total = spent + reduced
                if total > gap:
                    break
                c = cells + dc
                h = host + dh
                if c <= cell_room and h <= host_room:
                    add((c, h, cost + dk, total, (node, pos)))
        grown.sort(key=by_key)
        states = _undominated(grown)
        if linear is not None and len(states) > linear * done / start + linear / 4 + 32:
            return None
    return states


def _split(parts: list[dict]) -> tuple[list, list]:
    """Which side each group goes to, or cut between both: the choice with the smallest estimated sides
    (the product of their parts' sizes, an upper bound on what merging them holds)."""
    choices = [sorted(p) for p in parts]  # "A" (whole on the first side), "B" (whole on the second), "S" (cut)
    choices = [c + ["B"] if "A" in c else c for c in choices]
    if math.prod(len(c) for c in choices) > 6561:
        choices = [["S"] for _ in parts]
    best = None
    for pick in product(*choices):
        sides: tuple[list, list] = ([], [])
        for part, where in zip(parts, pick):
            if where == "S":
                sides[0].append(part["S"][0])
                sides[1].append(part["S"][1])
            else:
                sides[where == "B"].append(part["A"])
        size = sum(math.prod(len(front) for front, _, _ in side) for side in sides)
        if best is None or size < best[0]:
            best = (size, sides)
    return best[1]


def _merge(states: list[tuple], front: list[tuple], cell_room: int, host_room: int, gap: float) -> list[tuple]:
    """Every pair of a state and a part's multiset that can still fit and stay within ``gap``, undominated."""
    front = sorted(front, key=itemgetter(3))
    spent_of = [f[3] for f in front]
    grown = []
    add = grown.append
    for cells, host, cost, spent, node in states:
        cells_left, host_left = cell_room - cells, host_room - host
        for c, h, k, reduced, other in islice(front, bisect_right(spent_of, gap - spent)):
            if c <= cells_left and h <= host_left:
                add((cells + c, host + h, cost + k, spent + reduced, (node, other, None)))
    grown.sort(key=itemgetter(0, 1, 2))
    return _undominated(grown)


def _join(states: list[tuple], front: list[tuple], cell_room: int, host_room: int) -> tuple[int, tuple] | None:
    """The cheapest (state, multiset) pair within both rooms, without trying every pair.

    The states are taken from the least cell room left to the most; the multisets that fit each one's
    cell room are added to a Fenwick tree over their host memory, which answers "the cheapest with
    at most this much host memory" in a logarithm.
    """
    hosts = sorted({f[1] for f in front})
    tree: list[tuple] = [(math.inf, None)] * (len(hosts) + 1)
    front = sorted(front, key=itemgetter(0))
    added = 0
    best = None
    for cells, host, cost, _, node in sorted(states, key=itemgetter(0), reverse=True):
        while added < len(front) and front[added][0] <= cell_room - cells:
            c, h, k, _, other = front[added]
            i = bisect_left(hosts, h) + 1
            while i < len(tree):
                if k < tree[i][0]:
                    tree[i] = (k, other)
                i += i & -i
            added += 1
        i = bisect_right(hosts, host_room - host)
        found = (math.inf, None)
        while i:
            if tree[i][0] < found[0]:
                found = tree[i]
            i -= i & -i
        if found[0] != math.inf and (best is None or cost + found[0] < best[0]):
            best = (cost + found[0], (node, found[1], None))
    return best


def _positions(node: tuple | None) -> list[int]:
    """The options a plan's node chain chose: (parent, position) for a block, (left, right, None) for a merge."""
    found = []
    stack = [node]
    while stack:
        node = stack.pop()
        while node is not None:
            if len(node) == 3:
                stack.append(node[1])
                node = node[0]
            else:
                node, pos = node
                found.append(pos)
    return found


def _undominated(states: list[tuple]) -> list[tuple]:
    """The states (sorted by cells, host, cost) that no other beats or equals in all three.

    A staircase of (host, least cost) over the states kept so far, all with no more cells, answers
    "is one as small in host memory and as cheap?" by bisection.
    """
    kept = []
    hosts: list[int] = []
    costs: list[int] = []  # strictly falling as hosts rise
    for state in states:
        host, cost = state[1], state[2]
        below = bisect_right(hosts, host)
        if below and costs[below - 1] <= cost:
            continue
        kept.append(state)
        start = end = bisect_left(hosts, host)
        while end < len(costs) and costs[end] >= cost:
            end += 1
        hosts[start:end] = [host]
        costs[start:end] = [cost]
    return kept
