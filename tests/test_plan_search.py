"""gradseam.plan_search: the fastest per-block plan under a GPU and a host budget, checked against brute force.

Costs on a 1/64 GiB grid make the search's rounding exact, so on small cases its answer must be the best
time of every assignment that holds both budgets; every plan it returns must hold them; the same input
gives the same plan whatever the groups' order; it stays fast at the planner's real sizes.
"""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest

from gradseam.plan_search import Budget, Group, Option, evaluate, least_memory, search


def _grid(x: float) -> float:
    return round(x * 64) / 64


def _instance(rng: random.Random, groups: int, blocks: int, options: int, *, grid: bool = True) -> list[Group]:
    q = _grid if grid else (lambda x: x)
    return [Group(f"g{g}", rng.randint(1, blocks), tuple(
        Option(f"o{o}", time_ms=float(rng.randint(1, 50)), gpu_gib=q(rng.uniform(0, 3)), host_gib=q(rng.uniform(0, 3)),
               transient_gib=q(rng.uniform(0, 2))) for o in range(rng.randint(1, options))))
        for g in range(groups)]


def _brute_force(groups: list[Group], budget: Budget) -> float | None:
    per_group = [[c for c in itertools.product(range(g.count + 1), repeat=len(g.options)) if sum(c) == g.count]
                 for g in groups]
    best = None
    for counts in itertools.product(*per_group):
        plan = evaluate(groups, counts)
        if plan.gpu_gib <= budget.gpu_gib and plan.host_gib <= budget.host_gib:
            best = plan.time_ms if best is None else min(best, plan.time_ms)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_search_finds_what_brute_force_finds_and_holds_both_budgets(seed):
    rng = random.Random(seed)
    for _ in range(25):
        groups = _instance(rng, rng.randint(1, 3), 4, 4)
        budget = Budget(rng.choice([1.5, 3.0, 6.0, 9.0]), rng.choice([1.0, 4.0, 8.0, math.inf]))
        want = _brute_force(groups, budget)
        got = search(groups, budget)
        if want is None:
            assert got is None
            continue
        assert got is not None and got.time_ms == pytest.approx(want)
        assert got.gpu_gib <= budget.gpu_gib and got.host_gib <= budget.host_gib
        assert [sum(c) for c in got.counts] == [g.count for g in groups]


def test_the_largest_transient_counts_once_and_fixed_costs_add():
    light = Option("light", time_ms=10, gpu_gib=1.0, transient_gib=0.5)
    heavy = Option("heavy", time_ms=5, gpu_gib=1.0, transient_gib=4.0)
    groups = [Group("blocks", 4, (light, heavy))]
    plan = evaluate(groups, [(3, 1)], fixed_gpu_gib=2.0, fixed_time_ms=7.0)
    assert plan.gpu_gib == pytest.approx(2.0 + 4 * 1.0 + 4.0) and plan.time_ms == pytest.approx(7 + 30 + 5)
    # one heavy block already pays its transient: the search puts every block on it when that fits
    assert search(groups, Budget(10.0, 1.0), fixed_gpu_gib=2.0).counts_of("blocks") == {"heavy": 4}
    assert search(groups, Budget(9.9, 1.0), fixed_gpu_gib=2.0).counts_of("blocks") == {"light": 4}


def test_the_same_input_gives_the_same_plan_whatever_the_groups_order():
    rng = random.Random(7)
    groups = _instance(rng, 3, 12, 5)
    budget = Budget(40.0, 30.0)
    first = search(groups, budget)
    assert first is not None
    assert search(groups, budget) == first
    turned = search(list(reversed(groups)), budget)
    assert {g.name: turned.counts_of(g.name) for g in groups} == {g.name: first.counts_of(g.name) for g in groups}


def test_ties_go_to_the_earlier_option():
    same = (Option("keep", time_ms=3, gpu_gib=0.5), Option("offload", time_ms=3, gpu_gib=0.25, host_gib=0.5))
    assert search([Group("blocks", 5, same)], Budget(100.0, 100.0)).counts_of("blocks") == {"keep": 5}


def test_never_slower_than_the_best_uniform_plan_that_fits():
    rng = random.Random(3)
    for _ in range(40):
        groups = _instance(rng, 1, 30, 6, grid=False)
        budget = Budget(rng.uniform(5, 60), rng.uniform(5, 60))
        got = search(groups, budget)
        uniform = [evaluate(groups, [tuple(groups[0].count if j == i else 0 for j in range(len(groups[0].options)))])
                   for i in range(len(groups[0].options))]
        fits = [p.time_ms for p in uniform if p.gpu_gib <= budget.gpu_gib and p.host_gib <= budget.host_gib]
        if fits:
            assert got is not None and got.time_ms <= min(fits) + 1e-9


def test_least_memory_says_what_any_plan_needs_at_least():
    groups = [Group("blocks", 4, (Option("keep", 1, gpu_gib=2.0), Option("offload", 2, gpu_gib=0.5, host_gib=1.0)))]
    gpu, host = least_memory(groups, fixed_gpu_gib=1.0)
    assert gpu == pytest.approx(1.0 + 4 * 0.5) and host == pytest.approx(0.0)
    assert search(groups, Budget(gpu - 0.1, 100.0), fixed_gpu_gib=1.0) is None


def test_the_planners_real_sizes_solve_in_well_under_seconds():
    rng = random.Random(11)
    groups = [Group(f"g{g}", 60, tuple(Option(f"o{o}", time_ms=rng.uniform(1, 50), gpu_gib=rng.uniform(0, 3),
                                                host_gib=rng.uniform(0, 3), transient_gib=rng.uniform(0, 2))
                                         for o in range(12))) for g in range(3)]
    start = time.perf_counter()
    plan = search(groups, Budget(100.0, 128.0))
    assert plan is not None and plan.gpu_gib <= 100.0 and plan.host_gib <= 128.0
    assert time.perf_counter() - start < 5.0  # ~0.3 s on a 2-core CPU; generous, never a flaky bound


@pytest.mark.parametrize(("make", "words"), [
    (lambda: Option("x", time_ms=-1, gpu_gib=0), "time_ms"),
    (lambda: Option("x", time_ms=1, gpu_gib=math.nan), "gpu_gib"),
    (lambda: Group("g", -1, (Option("x", 1, 0),)), "count must be an integer >= 0"),
    (lambda: Group("g", 2, ()), "options is empty"),
    (lambda: Group("g", 2, (Option("x", 1, 0), Option("x", 2, 0))), "repeated"),
    (lambda: Budget(0, 1), "gpu_gib must be a number > 0"),
    (lambda: search([Group("g", 1, (Option("x", 1, 0),))] * 2, Budget(1, 1)), "g"),
])
def test_bad_values_are_refused_by_name(make, words):
    with pytest.raises(ValueError, match=words):
        make()
