"""The planner's search (gradseam.plan_search): optimal against brute force, budgets held to the bit,
the same plan for the same input whatever the groups' order, and fast on the planner's real shapes.

Brute force here takes every plan: blocks of a group are identical, so a plan is its counts per
option, and every assignment of options to blocks is one of them.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import time
from fractions import Fraction

import pytest

from gradseam.plan_search import (
    DEFAULT_RESOLUTION_GIB,
    Budget,
    Group,
    Option,
    Plan,
    evaluate,
    least_memory,
    search,
)

GRID = 64  # memory costs in 1/64 GiB lie on the default grid too: rounding them up loses nothing
assert (1 / DEFAULT_RESOLUTION_GIB) % GRID == 0


def _compositions(n: int, k: int):
    """Every way to spread ``n`` blocks over ``k`` options, the earliest options fullest first."""
    if k == 1:
        yield (n,)
        return
    for first in range(n, -1, -1):
        for rest in _compositions(n - first, k - 1):
            yield (first, *rest)


def _plans(groups):
    return itertools.product(*[list(_compositions(g.count, len(g.options))) for g in groups])


def _size(groups) -> int:
    return math.prod(math.comb(g.count + len(g.options) - 1, len(g.options) - 1) for g in groups)


@functools.cache
def _fractions(option: Option) -> tuple[Fraction, Fraction, Fraction, Fraction]:
    return tuple(Fraction(x) for x in (option.gpu_gib, option.host_gib, option.time_ms, option.transient_gib))


def _exact(groups, counts, fixed=(0.0, 0.0, 0.0)):
    """(gpu, host, time, largest transient used) of a plan, as exact fractions."""
    gpu, host, ms = (Fraction(f) for f in fixed)
    transient = Fraction(0)
    for g, c in zip(groups, counts):
        for o, n in zip(g.options, c):
            if n:
                held, pinned, took, working = _fractions(o)
                gpu += n * held
                host += n * pinned
                ms += n * took
                transient = max(transient, working)
    return gpu + transient, host, ms, transient


def _preference(groups, counts, ms):
    """The documented order: least time, then the most blocks on the earliest options, groups by name."""
    by_name = sorted(range(len(groups)), key=lambda i: groups[i].name)
    return ms, tuple(-n for i in by_name for n in counts[i])


def _brute(groups, budget, fixed=(0.0, 0.0, 0.0), fits=None):
    """The preferred plan among those ``fits(counts, gpu, host, transient)`` accepts (default: within the budget)."""
    best = None
    for counts in _plans(groups):
        gpu, host, ms, transient = _exact(groups, counts, fixed)
        ok = fits(counts, gpu, host, transient) if fits else (
            gpu <= Fraction(budget.gpu_gib) and host <= Fraction(budget.host_gib))
        if ok:
            key = _preference(groups, counts, ms)
            if best is None or key < best[0]:
                best = (key, tuple(counts))
    return None if best is None else best[1]


def _grid_groups(rng: random.Random) -> list[Group]:
    """1-3 groups of 1-6 blocks and 1-4 options, every cost on the grid; times in eighths of a ms, so ties happen."""
    groups = []
    for i in range(rng.randint(1, 3)):
        options = tuple(
            Option(f"s{j}", rng.randint(1, 40) / 8, rng.randint(0, 96) / GRID,
                   rng.choice([0.0, rng.randint(0, 96) / GRID]), rng.choice([0.0, rng.randint(0, 64) / GRID]))
            for j in range(rng.randint(1, 4)))
        groups.append(Group(f"list{rng.randint(0, 99)}_{i}", rng.randint(1, 6), options))
    return groups


def _budget_around(rng: random.Random, groups, fixed_gpu: float, fixed_host: float) -> Budget:
    """A budget from a little under the least any plan needs to a little over the most."""
    least_gpu, least_host = least_memory(groups, fixed_gpu_gib=fixed_gpu, fixed_host_gib=fixed_host)
    most_gpu = fixed_gpu + sum(g.count * max(o.gpu_gib + o.transient_gib for o in g.options) for g in groups)
    most_host = fixed_host + sum(g.count * max(o.host_gib for o in g.options) for g in groups)
    return Budget(max(0.01, rng.uniform(least_gpu - 0.1, most_gpu + 0.1)),
                  max(0.01, rng.uniform(least_host - 0.1, most_host + 0.1)))


def _holds(plan: Plan, budget: Budget) -> bool:
    return plan.gpu_gib <= budget.gpu_gib and plan.host_gib <= budget.host_gib


# -- optimal ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_the_plan_is_brute_forces_best_on_small_instances(seed):
    """Costs on the grid, so the search is exact: the same plan as brute force (its time, and the tie
    rule picking among equally fast ones), or None exactly when nothing fits."""
    rng = random.Random(seed)
    compared = fitted = 0
    while compared < 60:
        groups = _grid_groups(rng)
        if _size(groups) > 1500:
            continue
        fixed = (rng.randint(0, 64) / GRID, rng.randint(0, 64) / GRID, rng.randint(0, 10) / 4)
        budget = _budget_around(rng, groups, *fixed[:2])
        expected = _brute(groups, budget, fixed)
        plan = search(groups, budget, fixed_gpu_gib=fixed[0], fixed_host_gib=fixed[1], fixed_time_ms=fixed[2])
        compared += 1
        if expected is None:
            assert plan is None, (groups, budget, plan)
            continue
        fitted += 1
        assert plan is not None and plan.counts == expected, (groups, budget, plan, expected)
        assert _holds(plan, budget)
        assert plan.time_ms == float(_exact(groups, expected, fixed)[2])
    assert fitted >= 30  # the budgets drawn leave most instances something to choose


@pytest.mark.parametrize("resolution", [DEFAULT_RESOLUTION_GIB, 1 / 8, 0.1, 1 / 3])
def test_off_the_grid_the_plan_is_the_best_the_rounding_lets_through(resolution):
    """Arbitrary float costs: every plan returned holds both budgets exactly, and it is brute force's
    best among the plans whose held memory, each block's rounded up to the resolution, fits under
    its largest transient, and the uniform plans that fit exactly."""
    rng = random.Random(7)
    cell = Fraction(resolution)
    for _ in range(30):
        groups = [Group(f"g{i}", rng.randint(1, 5), tuple(
            Option(f"s{j}", rng.uniform(0.1, 5), rng.uniform(0, 1.5), rng.choice([0.0, rng.uniform(0, 1.5)]),
                   rng.choice([0.0, rng.uniform(0, 1)])) for j in range(rng.randint(1, 4))))
            for i in range(rng.randint(1, 3))]
        if _size(groups) > 1500:
            continue
        fixed = (rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0, 3))
        budget = _budget_around(rng, groups, *fixed[:2])

        def fits(counts, gpu, host, transient, groups=groups, fixed=fixed, budget=budget):
            if host > Fraction(budget.host_gib):
                return False
            used = {o.label for g, c in zip(groups, counts) for o, n in zip(g.options, c) if n}
            if len(used) == 1 and gpu <= Fraction(budget.gpu_gib):
                return True  # a uniform plan is checked exactly
            cells = sum(n * math.ceil(_fractions(o)[0] / cell)
                        for g, c in zip(groups, counts) for o, n in zip(g.options, c))
            room = Fraction(budget.gpu_gib) - Fraction(fixed[0]) - transient
            return room >= 0 and cells <= math.floor(room / cell)

        plan = search(groups, budget, fixed_gpu_gib=fixed[0], fixed_host_gib=fixed[1], fixed_time_ms=fixed[2],
                      resolution_gib=resolution)
        expected = _brute(groups, budget, fixed, fits)
        assert (plan and plan.counts) == expected, (groups, budget, plan, expected)
        if plan is not None:
            assert _holds(plan, budget)
            assert _brute(groups, budget, fixed) is not None  # and something truly fits


def test_rounding_up_can_miss_a_plan_within_its_own_rounding():
    """The documented cost of the grid: a block holding a hair more than a whole number of cells counts
    one cell more, so a mixed plan that fits to the byte is not seen at the default resolution; a finer
    resolution sees it."""
    over = 1 / GRID + 2**-20  # 1/64 GiB and a hair
    group = Group("blocks", 2, (Option("fast", 1.0, over), Option("slow", 2.0, 0.0)))
    budget = Budget(gpu_gib=over, host_gib=1.0)  # room for exactly one fast block
    assert search([group], budget).counts == ((0, 2),)  # the uniform slow plan: rounding hid 1 fast + 1 slow
    finer = search([group], budget, resolution_gib=2**-20)
    assert finer.counts == ((1, 1),) and finer.gpu_gib == budget.gpu_gib and finer.time_ms == 3.0


def test_a_uniform_plan_that_fits_only_unrounded_is_still_found():
    """Each of 40 blocks holds a hair over 6/64 GiB: rounded up to the grid they need 40 cells more than
    the budget has, yet every block on that option fits exactly, and nothing else is as fast."""
    held = 6 / GRID + 2**-30  # 40 * held is exact in floats: the budget is exactly their sum
    groups = [Group("blocks", 40, (Option("keep", 1.0, held), Option("recompute", 1.5, 0.0)))]
    plan = search(groups, Budget(40 * held, 1.0))
    assert plan.counts == ((40, 0),) and plan.time_ms == 40.0


def test_never_slower_than_the_fastest_uniform_plan_that_fits():
    rng = random.Random(11)
    labels = [f"s{j}" for j in range(5)]
    for _ in range(60):
        groups = [Group(f"g{i}", rng.randint(1, 12), tuple(
            Option(label, rng.uniform(1, 3), rng.uniform(0, 2), rng.choice([0.0, rng.uniform(0, 2)]),
                   rng.uniform(0, 0.5)) for label in labels)) for i in range(rng.randint(1, 3))]
        budget = _budget_around(rng, groups, 0.5, 0.0)
        uniform = [evaluate(groups, [[g.count if j == k else 0 for j in range(len(labels))] for g in groups],
                            fixed_gpu_gib=0.5) for k in range(len(labels))]
        fitting = [p.time_ms for p in uniform if _holds(p, budget)]
        plan = search(groups, budget, fixed_gpu_gib=0.5)
        if fitting:
            assert plan is not None and plan.time_ms <= min(fitting) and _holds(plan, budget)


# -- nothing fits -------------------------------------------------------------------------------------


def test_nothing_fits_and_least_memory_says_which_budget_is_short():
    blocks = Group("blocks", 10, (Option("keep", 1.0, 2.0), Option("offload", 1.2, 0.25, host_gib=1.0),
                                  Option("recompute", 1.5, 0.5, transient_gib=1.0)))
    assert least_memory([blocks], fixed_gpu_gib=4.0, fixed_host_gib=1.0) == (6.5, 1.0)
    # offload all: 4 + 2.5 GiB, recompute all: 4 + 5 + 1 (its working set once)
    assert search([blocks], Budget(6.25, 100.0), fixed_gpu_gib=4.0) is None  # GPU short of 6.5
    assert search([blocks], Budget(6.5, 100.0), fixed_gpu_gib=4.0).counts == ((0, 10, 0),)
    # each budget alone can be met, but not both: what saves GPU memory pins host memory
    assert search([blocks], Budget(6.5, 9.0), fixed_gpu_gib=4.0) is None
    assert least_memory([blocks], fixed_gpu_gib=4.0)[1] == 0.0


def test_the_largest_transient_counts_once_and_fixed_costs_add():
    """Two options' working sets never add: 3 + 3 blocks held at 1 GiB, plus the larger transient (2)."""
    blocks = Group("blocks", 6, (Option("a", 1.0, 1.0, transient_gib=1.0), Option("b", 1.0, 1.0, transient_gib=2.0)))
    assert evaluate([blocks], [[3, 3]]).gpu_gib == 8.0
    plan = evaluate([blocks], [[3, 3]], fixed_gpu_gib=2.0, fixed_host_gib=0.5, fixed_time_ms=7.0)
    assert (plan.gpu_gib, plan.host_gib, plan.time_ms) == (10.0, 0.5, 13.0)
    # one block that needs a large working set makes every block free to use it: all or none
    light, heavy = Option("light", 10.0, 1.0, transient_gib=0.5), Option("heavy", 5.0, 1.0, transient_gib=4.0)
    assert search([Group("blocks", 4, (light, heavy))], Budget(10.0, 1.0), fixed_gpu_gib=2.0).counts == ((0, 4),)
    assert search([Group("blocks", 4, (light, heavy))], Budget(9.9, 1.0), fixed_gpu_gib=2.0).counts == ((4, 0),)
    fast = Group("fast", 1, (Option("huge", 0.1, 0.0, transient_gib=10.0), Option("small", 5.0, 0.0)))
    assert search([fast], Budget(9.99, 1.0)).counts == ((0, 1),)
    assert search([fast], Budget(10.0, 1.0)).counts == ((1, 0),)


# -- deterministic ------------------------------------------------------------------------------------


def test_ties_go_to_the_earliest_options():
    same = Group("blocks", 4, (Option("a", 1.0, 1.0), Option("b", 1.0, 1.0)))
    assert search([same], Budget(100.0, 1.0)).counts == ((4, 0),)
    keep_or_offload = (Option("keep", 3.0, 0.5), Option("offload", 3.0, 0.25, host_gib=0.5))
    assert search([Group("blocks", 5, keep_or_offload)], Budget(100.0, 100.0)).counts_of("blocks") == {"keep": 5}
    # equally fast, the later option holding less: still the earlier one while it fits
    lighter = Group("blocks", 4, (Option("a", 1.0, 1.0), Option("b", 1.0, 0.5)))
    assert search([lighter], Budget(4.0, 1.0)).counts == ((4, 0),)
    assert search([lighter], Budget(3.0, 1.0)).counts == ((2, 2),)


def test_the_same_input_gives_the_same_plan_whatever_the_groups_order():
    rng = random.Random(3)
    for _ in range(80):
        groups = _grid_groups(rng)
        budget = _budget_around(rng, groups, 0.25, 0.0)
        plan = search(groups, budget, fixed_gpu_gib=0.25)
        assert search(groups, budget, fixed_gpu_gib=0.25) == plan
        shuffled = rng.sample(groups, len(groups))
        again = search(shuffled, budget, fixed_gpu_gib=0.25)
        if plan is None:
            assert again is None
            continue
        assert {g.name: plan.counts_of(g.name) for g in groups} == {g.name: again.counts_of(g.name) for g in groups}
        assert (again.gpu_gib, again.host_gib, again.time_ms) == (plan.gpu_gib, plan.host_gib, plan.time_ms)


# -- fast -----------------------------------------------------------------------------------------------

# (label, ms, held GiB, pinned GiB, transient GiB) per block, from no checkpointing to weight streaming:
# shaped like measured strategies (several within a few percent of each other's time)
STRATEGIES = [
    ("none", 10.0, 2.6, 0.0, 0.0), ("torch-ffn", 10.7, 1.6, 0.0, 0.35), ("attention offload", 10.9, 1.1, 1.5, 0.2),
    ("unsloth-ffn", 10.8, 0.3, 1.3, 0.35), ("compile 0.3", 10.05, 0.85, 0.0, 0.8), ("compile", 10.2, 0.55, 0.0, 1.0),
    ("unsloth-compile 0.3", 9.95, 0.06, 1.5, 0.8), ("unsloth-compile", 10.15, 0.05, 0.65, 1.0),
    ("torch", 14.5, 0.07, 0.0, 2.5), ("unsloth", 14.6, 0.0, 0.07, 2.5), ("torch + keep", 13.2, 1.0, 0.0, 1.5),
    ("stream + unsloth-compile", 11.4, 0.02, 2.4, 1.1),
]


def _model(seed: int) -> list[Group]:
    """3 block lists x 60 blocks x 12 strategies, each list at its own scale, each figure jittered."""
    rng = random.Random(seed)
    groups = []
    for name in ("double_blocks", "single_blocks", "refiner_blocks"):
        scale = rng.uniform(0.5, 1.5)
        groups.append(Group(name, 60, tuple(
            Option(label, ms * scale * rng.uniform(0.97, 1.03), gpu * scale * rng.uniform(0.9, 1.1),
                   host * scale * rng.uniform(0.9, 1.1), transient * scale)
            for label, ms, gpu, host, transient in STRATEGIES)))
    return groups


def _uniformly_random(seed: int) -> list[Group]:
    """3 x 60 blocks x 12 options, every figure drawn at random: little structure, many trade-offs."""
    rng = random.Random(seed)
    return [Group(f"g{g}", 60, tuple(Option(f"o{o}", rng.uniform(1, 50), rng.uniform(0, 3), rng.uniform(0, 3),
                                            rng.uniform(0, 2)) for o in range(12))) for g in range(3)]


@pytest.mark.parametrize(("groups", "fixed_gpu"), [(_model(1), 10.0), (_uniformly_random(11), 0.0)],
                         ids=["measured-like", "random"])
def test_the_planners_shape_is_solved_fast(groups, fixed_gpu):
    """3 x 60 blocks x 12 options, 100 GiB of GPU and 128 GiB of host memory, both binding: a few
    tenths of a second here; the bound is loose so that a slow CI machine never flakes."""
    budget = Budget(100.0, 128.0)
    start = time.perf_counter()
    plan = search(groups, budget, fixed_gpu_gib=fixed_gpu)
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, f"{elapsed:.2f} s"
    assert plan is not None and _holds(plan, budget)
    assert budget.gpu_gib - plan.gpu_gib < 2 and budget.host_gib - plan.host_gib < 2  # both budgets bind
    uniform = [evaluate(groups, [[60 if j == k else 0 for j in range(12)]] * 3, fixed_gpu_gib=fixed_gpu)
               for k in range(12)]
    assert plan.time_ms <= min([p.time_ms for p in uniform if _holds(p, budget)], default=math.inf)


# -- the plan and its words -----------------------------------------------------------------------------


def test_a_plan_describes_itself():
    groups = [Group("transformer_blocks", 40, (Option("compile", 1.0, 1.0), Option("unsloth-compile", 1.0, 0.1,
                                                                                    host_gib=1.0))),
              Group("single_transformer_blocks", 2, (Option("compile", 1.0, 1.0),))]
    plan = search(groups, Budget(20.0, 100.0))  # all equally fast: as many blocks on the first option as fit
    assert plan.counts == ((15, 25), (2,))
    assert plan.describe() == "transformer_blocks: 15 x compile, 25 x unsloth-compile; single_transformer_blocks: 2 x compile"
    assert plan.counts_of("transformer_blocks") == {"compile": 15, "unsloth-compile": 25}
    assert plan.as_dict() == {
        "groups": {"transformer_blocks": {"compile": 15, "unsloth-compile": 25}, "single_transformer_blocks": {"compile": 2}},
        "gpu_gib": plan.gpu_gib, "host_gib": 25.0, "time_ms": 42.0,
    }
    assert plan.gpu_gib == pytest.approx(19.5) and plan.gpu_gib <= 20.0
    with pytest.raises(KeyError, match="no group 'blocks'"):
        plan.counts_of("blocks")


def test_unlimited_budgets_and_groups_without_blocks():
    groups = [Group("blocks", 3, (Option("slow", 2.0, 0.0), Option("fast", 1.0, 5.0, host_gib=5.0))),
              Group("unused", 0, (Option("any", 9.0, 9.0),))]
    plan = search(groups, Budget(math.inf, math.inf))
    assert plan.counts == ((0, 3), (0,)) and plan.time_ms == 3.0
    assert search([Group("unused", 0, (Option("any", 9.0, 9.0),))], Budget(1.0, 1.0), fixed_gpu_gib=0.5).counts == ((0,),)
    assert search([Group("unused", 0, (Option("any", 9.0, 9.0),))], Budget(1.0, 1.0), fixed_gpu_gib=2.0) is None


# -- errors name the bad value --------------------------------------------------------------------------


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Option("a", -1.0, 0.0), "time_ms must be a finite number >= 0, got -1.0"),
    (lambda: Option("a", 1.0, float("nan")), "gpu_gib must be a finite number >= 0, got nan"),
    (lambda: Option("a", 1.0, 0.0, host_gib=-0.5), "host_gib must be a finite number >= 0, got -0.5"),
    (lambda: Option("", 1.0, 0.0), "label must be a non-empty string"),
    (lambda: Group("g", 2, ()), "Group 'g': options is empty"),
    (lambda: Group("g", -1, (Option("a", 1.0, 0.0),)), "count must be an integer >= 0, got -1"),
    (lambda: Group("g", 2.0, (Option("a", 1.0, 0.0),)), "count must be an integer >= 0, got 2.0"),
    (lambda: Group("g", 2, (Option("a", 1.0, 0.0), Option("a", 2.0, 0.0))), r"labels must be unique, repeated: \['a'\]"),
    (lambda: Budget(0.0, 1.0), "gpu_gib must be a number > 0 .*, got 0.0"),
    (lambda: Budget(1.0, -2.0), "host_gib must be a number > 0 .*, got -2.0"),
    (lambda: search([Group("g", 1, (Option("a", 1.0, 0.0),))] * 2, Budget(1.0, 1.0)),
     r"group names must be unique, repeated: \['g'\]"),
    (lambda: search([Group("g", 1, (Option("a", 1.0, 0.0),))], Budget(1.0, 1.0), resolution_gib=0),
     "resolution_gib must be a finite number > 0, got 0"),
    (lambda: search([Group("g", 1, (Option("a", 1.0, 0.0),))], Budget(1.0, 1.0), fixed_gpu_gib=-1.0),
     "fixed_gpu_gib must be a finite number >= 0, got -1.0"),
    (lambda: evaluate([Group("g", 2, (Option("a", 1.0, 0.0),))], [[1]]), "summing to the group's count"),
])
def test_bad_values_are_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()
