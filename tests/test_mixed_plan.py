"""The per-block plan advise offers (issue 41, first part: gradseam.tools.mixed_plan over gradseam.plan_search).

A cost table goes in through advise's injectable measure, as two-depth fits would give it; out comes a mix
that holds the GPU's and the host's memory where no uniform candidate that fits is as fast, with keys that
patch the model into exactly that mix, and train it exactly.
"""

from __future__ import annotations

import math

import pytest
import torch
from cases import FLUX, WAN

import gradseam
from gradseam import UnsupportedStrategyError
from gradseam.offload import cpu_test_mode
from gradseam.testing import check_strategy
from gradseam.tools.advise import LADDER, Estimate, NoFitError, Trial, UnitCosts, advise
from gradseam.tools.depth import DepthPlan
from gradseam.tools.mixed_plan import BLOCKS_KEY, config_for, option, selectors

UNITS = 5  # the tiny Wan's blocks: one unit of depth each

# per unit: (step ms, GPU GiB held, pinned GiB); at depth zero: (ms, peak GiB, pinned GiB)
TABLE = {
    "compile": ((10.0, 2.0, 0.0), (4.0, 1.0, 0.0)),  # fast, keeps its activations on the GPU
    "unsloth-compile": ((11.0, 0.2, 2.0), (4.0, 1.5, 0.5)),  # about as fast, pins them in host memory
    "torch": ((14.0, 0.4, 0.0), (4.0, 1.2, 0.0)),  # recomputes, holds little, pins nothing
}
STATIC = 1.0


def _estimate(label: str, table: dict = TABLE) -> Estimate:
    (ms, gpu, host), (ms0, peak0, host0) = table[label]
    costs = UnitCosts(UNITS, ms, ms0, gpu, peak0, host, host0)
    return Estimate(peak0 + UNITS * gpu, ms0 + UNITS * ms, host0 + UNITS * host, gpu, "predicted", costs)


def _measure(config, table: dict = TABLE):
    for label, rung in LADDER:
        if label in table and rung == dict(config):
            return _estimate(label, table)
    raise UnsupportedStrategyError("not in this table")


def _advise(gpu: float, host: float):
    return advise(WAN.build(), {}, gpu, measure=_measure, static_gib=STATIC, pinnable_gib=host)


def test_a_mix_holds_both_budgets_where_no_fast_uniform_candidate_does():
    # compile needs 1 + 5 * 2 + 1 = 12 GiB; unsloth-compile pins 0.5 + 5 * 2 = 10.5 GiB; torch fits, slowest
    advice = _advise(gpu=8.0, host=5.0)
    assert advice.chosen.label == "torch"
    mixed = advice.per_block
    assert mixed is not None, advice.per_block_note
    plan = mixed.plan
    assert plan.gpu_gib <= 8.0 and plan.host_gib <= 5.0
    assert plan.time_ms < advice.chosen.step_ms
    used = plan.counts_of("units")
    assert sum(used.values()) == UNITS and len(used) >= 2  # a mix, not a uniform plan
    # the brute force over every count of the three candidates agrees on the best time
    best = math.inf
    for a in range(UNITS + 1):
        for b in range(UNITS + 1 - a):
            counts = {"compile": a, "unsloth-compile": b, "torch": UNITS - a - b}
            used_now = [k for k, n in counts.items() if n]
            gpu = STATIC + sum(n * TABLE[k][0][1] for k, n in counts.items()) + max(TABLE[k][1][1] for k in used_now)
            host = sum(n * (TABLE[k][0][2] + TABLE[k][1][2] / UNITS) for k, n in counts.items())
            time = sum(n * (TABLE[k][0][0] + TABLE[k][1][0] / UNITS) for k, n in counts.items())
            if gpu <= 8.0 and host <= 5.0:
                best = min(best, time)
    assert plan.time_ms == pytest.approx(best)
    assert "per-block plan (predicted)" in advice.report() and "faster than torch" in advice.report()
    assert advice.to_dict()["per_block"]["config"] == mixed.config


def test_the_keys_it_prints_patch_that_mix_and_train_exactly():
    advice = _advise(gpu=8.0, host=5.0)
    config = advice.per_block_config
    assert BLOCKS_KEY in config
    with cpu_test_mode():
        report = check_strategy(WAN, config)  # outputs and every gradient against the unpatched model
        with gradseam.patch(WAN.fresh(), config) as handle:
            regions = [(r.kind, r.destination.value) for r in handle.regions()]
    assert report.saved_ratio < 1.0
    runs = {"compile": ("compiled-block", "device"), "unsloth-compile": ("compiled-block", "host"),
            "torch": ("whole-block", "device")}
    for label, n in advice.per_block.plan.counts_of("units").items():
        assert regions.count(runs[label]) == n, (label, regions)


def test_where_no_uniform_candidate_fits_the_mix_is_the_advice():
    """Without torch (refused here), compile is over the GPU and unsloth-compile over the host: only a mix fits."""
    def without_torch(config):
        if dict(config) == dict(LADDER)["torch"]:
            raise UnsupportedStrategyError("not in this run")
        return _measure(config)

    with pytest.raises(NoFitError, match=r"nothing fits both budgets: .*pinned host memory than the 5.0 GiB"):
        advise(WAN.build(), {}, 8.0, measure=without_torch, static_gib=STATIC, pinnable_gib=5.0)  # no mix either
    # 2 x compile + 3 x unsloth-compile: 7.1 GiB of GPU memory, 6.3 GiB pinned
    advice = advise(WAN.build(), {}, 8.0, measure=without_torch, static_gib=STATIC, pinnable_gib=6.5)
    assert advice.chosen is None and advice.per_block is not None
    assert set(advice.per_block.plan.counts_of("units")) == {"compile", "unsloth-compile"}
    assert advice.config == advice.per_block.config and BLOCKS_KEY in advice.config
    assert "no uniform candidate fits both budgets" in advice.report()
    assert advice.to_dict()["per_block"]["beats"] is None


def test_a_uniform_plan_adds_up_to_its_own_prediction():
    for label in TABLE:
        est = _estimate(label)
        trial = Trial(label, dict(dict(LADDER)[label]), peak_gib=est.peak_gib, step_ms=est.step_ms,
                      unit_costs=est.unit_costs)
        opt = option(trial)
        assert UNITS * opt.time_ms == pytest.approx(est.step_ms)
        assert UNITS * opt.gpu_gib + opt.transient_gib == pytest.approx(est.peak_gib)
        assert UNITS * opt.host_gib == pytest.approx(est.pinned_gib)


def test_no_mix_is_offered_when_the_chosen_candidate_is_as_fast():
    advice = _advise(gpu=64.0, host=64.0)  # compile fits whole: nothing beats it
    assert advice.chosen.label == "compile"
    assert advice.per_block is None and "not faster than compile" in advice.per_block_note


def test_measured_at_one_depth_there_is_nothing_to_plan_per_block():
    def flat(config):
        got = _measure(config)
        return Estimate(got.peak_gib, got.step_ms, got.pinned_gib)

    advice = advise(WAN.build(), {}, 8.0, measure=flat, static_gib=STATIC, pinnable_gib=5.0)
    assert advice.per_block is None and "one depth" in advice.per_block_note


def test_units_map_onto_every_list_in_proportion_or_onto_the_longest():
    flux = DepthPlan({"transformer_blocks": 19, "single_transformer_blocks": 38})
    assert flux.exact and flux.full == 19
    assert selectors(flux, 2, 5) == ["transformer_blocks[2:5]", "single_transformer_blocks[4:10]"]
    hv = DepthPlan({"context_embedder.token_refiner.refiner_blocks": 2, "transformer_blocks": 54})
    assert not hv.exact
    assert selectors(hv, 0, 20) == ["transformer_blocks[0:20]"]


def test_an_entry_resets_what_the_top_level_sets_and_it_does_not():
    trials = {label: Trial(label, dict(config)) for label, config in LADDER}
    plan = DepthPlan({"blocks": 4})
    config = config_for([("torch + attention kept", 0, 3), ("unsloth-compile, budget 0.05", 3, 4)], trials, plan)
    assert config["gradient_checkpointing_keep_attention"] is True
    (entry,) = config[BLOCKS_KEY]
    assert entry == {"blocks": "blocks[3:4]", "gradient_checkpointing_backend": "unsloth-compile",
                     "gradient_checkpointing_memory_budget": 0.05, "gradient_checkpointing_keep_attention": False}
    two = config_for([("none", 0, 1), ("torch", 1, 3)], trials, DepthPlan({"transformer_blocks": 3,
                                                                        "single_transformer_blocks": 6}))
    assert two["gradient_checkpointing_backend"] == "torch"
    assert two[BLOCKS_KEY] == [{"blocks": "transformer_blocks[0:1]", "gradient_checkpointing": False},
                               {"blocks": "single_transformer_blocks[0:2]", "gradient_checkpointing": False}]
    with cpu_test_mode(), gradseam.patch(FLUX.build(), two) as handle:
        assert len(handle.regions()) > 0


def test_a_model_without_a_family_keeps_its_uniform_advice():
    advice = advise(torch.nn.Linear(2, 2), {}, 8.0, measure=_measure, static_gib=STATIC, pinnable_gib=5.0)
    assert advice.chosen.label == "torch" and advice.per_block is None
    assert "block lists are unknown" in advice.per_block_note


# -- streamed units -------------------------------------------------------------------------------------------------

STREAM = "gradient_checkpointing_stream_weights"
WEIGHTS = [1.0] * UNITS  # each block's frozen weights, GiB
# per unit: (step ms, GPU GiB held, pinned GiB); at depth zero: (ms, peak GiB with two blocks' weights in flight, pinned)
STREAMED_TABLE = {
    "torch": ((14.0, 0.4, 0.0), (4.0, 1.2, 0.0)),
    "torch + stream all": ((16.0, 0.4, 0.0), (4.0, 3.2, 0.0)),  # copies cost 2 ms a unit; weights out of the peak
}


def _streamed_measure(config):
    torch_config = dict(LADDER)["torch"]
    for label, rung in (("torch", torch_config), ("torch + stream all", {**torch_config, STREAM: "all"})):
        if dict(config) == rung:
            (ms, gpu, host), (ms0, peak0, host0) = STREAMED_TABLE[label]
            costs = UnitCosts(UNITS, ms, ms0, gpu, peak0, host, host0)
            return Estimate(peak0 + UNITS * gpu, ms0 + UNITS * ms, host0 + UNITS * host, gpu, "predicted", costs)
    raise UnsupportedStrategyError("not in this table")


def test_a_mix_streams_the_fewest_units_that_free_the_gpu_and_trains_exactly():
    """1 GiB of inputs + 5 GiB of weights under 9 GiB: resident torch needs 9.2, every block streamed 6.2 GiB at a
    slower step; streaming three units of five fits (8.2 GiB) and is faster than streaming all."""
    from test_weight_streaming import LORA

    advice = advise(WAN.build(), {}, 9.0, measure=_streamed_measure, static_gib=STATIC + sum(WEIGHTS),
                    pinnable_gib=64.0, block_gib=WEIGHTS)
    # torch is over the GPU, torch + stream 3 (a spread count) is not measured here: every block streamed fits
    assert advice.chosen.label == "torch + stream all" and advice.chosen.step_ms == pytest.approx(84.0)
    assert advice.chosen.pinned_gib == pytest.approx(sum(WEIGHTS))
    mixed = advice.per_block
    assert mixed is not None, advice.per_block_note
    assert mixed.plan.counts_of("units") == {"torch + stream all": 3, "torch": 2}
    assert mixed.plan.gpu_gib == pytest.approx(STATIC + 5 * 0.4 + 2 * 1.0 + 3.2)
    assert mixed.plan.host_gib == pytest.approx(3 * 1.0) and mixed.plan.time_ms == pytest.approx(80.0)
    assert "4.8% faster than torch + stream all" in advice.report()
    with cpu_test_mode():
        check_strategy(LORA[WAN.name], mixed.config)  # outputs and every gradient, against the unpatched model
        with gradseam.patch(LORA[WAN.name].fresh(), mixed.config) as handle:
            assert len(handle.plan.streamed) == 3


def test_a_candidate_out_of_memory_beside_the_cut_models_weights_is_measured_with_them_streamed():
    """Resident, ``torch`` ran out of memory at the depths measured (the cut model's weights on the GPU beside it);
    with every block's weights streamed it fits, and is measured so, with no resident line to floor it. Before,
    only candidates measured resident were streamed, and Wan 2.1 14B under 12 GiB found no plan at all (an H200)."""

    def measure(config):
        if STREAM not in config:
            raise torch.OutOfMemoryError("CUDA out of memory (resident)")
        return _streamed_measure(config)

    advice = advise(WAN.build(), {}, 9.0, measure=measure, static_gib=STATIC + sum(WEIGHTS), pinnable_gib=64.0,
                    block_gib=WEIGHTS)
    resident = next(t for t in advice.trials if t.label == "torch")
    assert resident.status == "OOM"
    assert advice.chosen.label == "torch + stream all" and advice.chosen.step_ms == pytest.approx(84.0)
    assert advice.chosen.pinned_gib == pytest.approx(sum(WEIGHTS))
    streamed = [t.label for t in advice.trials if STREAM in t.config]
    assert streamed.count("torch + stream all") == 1, streamed


def test_the_planner_predicts_what_a_run_measures_of_the_plan_it_chose():
    # what bench sets its auto row's measurements against: the GPU peak with the static memory (a mix's in its
    # block order), the pinned memory (the streamed units' weights in it, as the search counts them), the step
    from gradseam.tools.plan_check import predicted

    advice = _advise(gpu=8.0, host=5.0)
    mix = advice.per_block
    assert predicted(advice) == {"gpu_gib": mix.expected_gpu_gib, "host_gib": mix.plan.host_gib,
                                 "step_ms": mix.plan.time_ms}
    uniform = _advise(gpu=64.0, host=64.0)  # compile on every block, no mix
    chosen = uniform.chosen
    assert uniform.per_block is None
    assert predicted(uniform) == {"gpu_gib": STATIC + chosen.peak_gib, "host_gib": chosen.pinned_gib or 0.0,
                                  "step_ms": chosen.step_ms}


def test_a_mix_runs_the_largest_working_set_first_and_expects_the_peak_of_that_order():
    # Backward runs the units last to first: a unit's working set comes while the units before it hold what they
    # keep. The mix is laid out so the largest working sets come first, which no other order of its ranges beats;
    # the peak expected there is reported beside the search's bound (held by every unit plus the largest set).
    from itertools import permutations

    from gradseam.tools.mixed_plan import expected_peak_gib

    advice = _advise(gpu=8.0, host=5.0)
    mixed = advice.per_block
    options = {t.label: option(t) for t in advice.trials if t.label in TABLE and t.unit_costs is not None}
    transients = [options[label].transient_gib for label, _, _ in mixed.ranges]
    assert len(transients) >= 2 and transients == sorted(transients, reverse=True)

    def laid_out(order):
        out, start = [], 0
        for label, a, b in order:
            out.append((label, start, start + b - a))
            start += b - a
        return out

    fixed = STATIC  # nothing streams here: the static memory is the fixed part
    every = [expected_peak_gib(laid_out(order), options, fixed) for order in permutations(mixed.ranges)]
    assert mixed.expected_gpu_gib == pytest.approx(min(every))
    # by hand, for the first order: the fixed memory, then per range what is held up to its end plus its working set
    held, peak = 0.0, 0.0
    for label, a, b in mixed.ranges:
        held += (b - a) * TABLE[label][0][1]
        peak = max(peak, held + TABLE[label][1][1])
    assert mixed.expected_gpu_gib == pytest.approx(STATIC + peak)
    assert mixed.expected_gpu_gib <= mixed.plan.gpu_gib
    if mixed.expected_gpu_gib < mixed.plan.gpu_gib - 0.005:
        assert f"{mixed.expected_gpu_gib:.2f} GiB expected in this block order ({mixed.plan.gpu_gib:.2f} GiB at most)" \
            in advice.report()
    assert advice.to_dict()["per_block"]["expected_gpu_gib"] == mixed.expected_gpu_gib


def test_a_host_budget_below_the_compilers_floor_gives_budget_0_to_the_fewest_blocks_and_trains_exactly():
    """Wan 2.1 14B's costs a block under 12 GiB (an H100, docs/benchmarks.md, thirty-sixth session), on the tiny Wan's
    five units: budget 0.05 pins 0.99 GiB a block at 353 ms, budget 0 keeps only the block's inputs, 0.35 GiB at 420
    ms. A host budget under five blocks at 0.05 gets budget 0 on as few blocks as bring it under, the rest at 0.05:
    the mix the twelve-gigabyte row measured (five of forty blocks at budget 0, 62.4 GiB pinned)."""
    costs = {  # as TABLE: per unit (ms, GPU GiB held, pinned GiB); at depth zero (ms, peak GiB, pinned GiB)
        "unsloth-compile, budget 0.05": ((353.0, 0.0, 0.99), (10.0, 7.0, 0.0)),
        "unsloth-compile, budget 0": ((420.0, 0.02, 0.35), (10.0, 9.6, 0.0)),
    }

    def measure(config):
        return _measure(config, costs)

    uniform = advise(WAN.build(), {}, 12.0, measure=measure, static_gib=STATIC, pinnable_gib=5.0)
    assert uniform.chosen.label == "unsloth-compile, budget 0.05" and uniform.per_block is None  # 4.95 GiB fits
    # 4.4 GiB: four blocks at 0.05 and one at 0 (4.31 GiB); two at 0 would fit too, and be slower
    advice = advise(WAN.build(), {}, 12.0, measure=measure, static_gib=STATIC, pinnable_gib=4.4)
    assert advice.chosen.label == "unsloth-compile, budget 0" and advice.per_block is not None
    plan = advice.per_block.plan
    assert plan.counts_of("units") == {"unsloth-compile, budget 0.05": 4, "unsloth-compile, budget 0": 1}
    assert plan.host_gib <= 4.4 and plan.time_ms < advice.chosen.step_ms
    config = advice.per_block_config
    assert [dict(e).get("gradient_checkpointing_memory_budget") for e in config[BLOCKS_KEY]].count(0.0) >= 1
    with cpu_test_mode():
        check_strategy(WAN, config)  # outputs and every gradient against the unpatched model
