"""Depth-true figures: depth plans keep every block list in proportion, a two-depth fit predicts the
full depth, and bench/advise speak for the real depth. On the CPU the memory figure is the bytes
autograd keeps for backward, which is exactly linear in depth, so the prediction must equal the
measurement at full depth to the byte."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import gradseam
from gradseam.tools import bench as b
from gradseam.tools import bench_report as report
from gradseam.tools.advise import Estimate, run_ladder
from gradseam.tools.checks import find_family, parse_depths
from gradseam.tools.depth import DepthPlan, at_depth, fit, plan_for, predict


def test_a_plan_keeps_every_list_in_its_real_proportion():
    flux = DepthPlan({"transformer_blocks": 19, "single_transformer_blocks": 38})
    assert flux.exact and flux.full == 19 and flux.unit == {"transformer_blocks": 1, "single_transformer_blocks": 2}
    assert flux.counts(4) == {"transformer_blocks": 4, "single_transformer_blocks": 8}
    assert flux.counts(19) == {"transformer_blocks": 19, "single_transformer_blocks": 38}
    assert flux.describe(2) == "2 + 4 blocks"
    assert "1 x transformer_blocks, 2 x single_transformer_blocks" in flux.unit_note()
    wan = DepthPlan({"blocks": 40})
    assert wan.exact and wan.full == 40 and wan.counts(8) == {"blocks": 8} and wan.unit_note() == "one unit of depth = one block"


def test_lists_without_a_useful_common_factor_scale_with_the_longest():
    zimage = DepthPlan({"noise_refiner": 2, "context_refiner": 2, "layers": 30})
    assert not zimage.exact and zimage.full == 30
    assert zimage.counts(4) == {"noise_refiner": 1, "context_refiner": 1, "layers": 4}  # at least one each
    assert zimage.counts(30) == {"noise_refiner": 2, "context_refiner": 2, "layers": 30}
    assert "approximate" in zimage.unit_note()
    with pytest.raises(ValueError, match="between 1 and the model's full depth 30, got 31"):
        zimage.counts(31)


@pytest.mark.parametrize(("text", "full", "expected"), [(None, 40, (2, 4)), (None, 3, (1, 2)), ("8,4", 40, (4, 8))])
def test_parse_depths(text, full, expected):
    assert parse_depths(text, full) == expected


@pytest.mark.parametrize(("text", "full", "message"), [
    ("4", 40, "expected two different depths >= 1 like '2,4', got '4'"),
    ("4,4", 40, "expected two different depths"),
    ("0,2", 40, "expected two different depths"),
    ("a,b", 40, "expected two different depths"),
    ("2,50", 40, "50 is deeper than the model's full depth 40"),
    (None, 1, "one unit of depth only"),
])
def test_parse_depths_errors(text, full, message):
    with pytest.raises(ValueError, match=message):
        parse_depths(text, full)


def test_fit_is_a_line_through_two_depths():
    line = fit((2, 4), (3.0, 5.0))
    assert line.growth == 1.0 and line.fixed == 1.0 and line.at(40) == 41.0
    with pytest.raises(ValueError, match="two different depths"):
        fit((2, 2), (1.0, 1.0))


def _stack(blocks: int = 8, dim: int = 64):
    from gradseam.tools.synthetic import SyntheticStack, ensure_registered

    ensure_registered()
    torch.manual_seed(0)
    return SyntheticStack(blocks, dim).requires_grad_(False)


def test_at_depth_runs_the_first_blocks_and_restores_the_model():
    model = _stack()
    family = find_family("synthetic")
    plan = plan_for(model, family)
    keys, blocks = list(model.state_dict()), model.blocks
    with at_depth(model, plan, 3) as counts:
        assert counts == {"blocks": 3} and len(model.blocks) == 3
        assert all(a is b_ for a, b_ in zip(model.blocks, blocks))
    assert model.blocks is blocks and list(model.state_dict()) == keys
    with pytest.raises(RuntimeError, match="inside"), at_depth(model, plan, 2):
        raise RuntimeError("inside")
    assert model.blocks is blocks  # restored after an error too


TINY_FLUX = {"in_channels": 4, "num_layers": 4, "num_single_layers": 8, "attention_head_dim": 8,
             "num_attention_heads": 2, "joint_attention_dim": 16, "pooled_projection_dim": 8,
             "axes_dims_rope": [2, 2, 4]}


def _tiny_flux():
    family = find_family("flux")
    preset = next(iter(family.presets.values()))
    tiny = dataclasses.replace(preset, config=TINY_FLUX, inputs={"image_tokens": 16, "text_tokens": 8})
    return dataclasses.replace(family, presets={"tiny": tiny})


@pytest.fixture(scope="module")
def flux_run():
    rows = ["none", "torch", "torch-ffn", "torch, interval 2", "unsloth"]
    return b.real(_tiny_flux(), "tiny", depths="1,2", full=True, rows=rows, steps=1, device="cpu")


def test_real_measures_two_depths_and_the_full_one_with_every_list_in_proportion(flux_run):
    assert flux_run.plan.full == 4 and flux_run.fit_depths == (1, 2) and flux_run.full_depth == 4
    depths = {r.depth: r.blocks for r in flux_run.results}
    assert depths == {1: "1 + 2 blocks", 2: "2 + 4 blocks", 4: "4 + 8 blocks"}
    by = {(r.strategy, r.depth): r for r in flux_run.results}
    assert by[("unsloth", 4)].status == b.NEEDS_CUDA
    for name in ("none", "torch", "torch-ffn", "torch, interval 2"):
        assert all(by[(name, d)].status == "ok" for d in (1, 2, 4)), name
        assert by[(name, 1)].peak_gib < by[(name, 2)].peak_gib < by[(name, 4)].peak_gib


def test_the_prediction_equals_the_measurement_at_full_depth(flux_run):
    full = {r["strategy"]: r for r in report.full_depth_rows(flux_run)}
    for name in ("none", "torch", "torch-ffn"):
        row = full[name]
        assert row["peak_source"] == "measured" and row["step_source"] == "measured"
        # bytes kept for backward grow by exactly one unit's worth per unit of depth
        assert row["prediction_error"] == pytest.approx(0.0, abs=1e-3), row
        assert row["growth_gib_per_unit"] > 0
    assert full["torch"]["growth_gib_per_unit"] < full["torch-ffn"]["growth_gib_per_unit"] < full["none"]["growth_gib_per_unit"]
    assert full["unsloth"]["peak_gib"] is None and full["unsloth"]["status"] == b.NEEDS_CUDA


def test_the_full_depth_rows_carry_the_whole_gpus_peak_where_the_full_depth_was_measured(flux_run):
    """What a capped or streamed row's chart reads (the CPU rows have none: set here as a GPU run sets it)."""
    gpu = dataclasses.replace(flux_run, results=[dataclasses.replace(r, gpu_peak_gib=10.0 + r.depth)
                                                 for r in flux_run.results])
    full = {r["strategy"]: r for r in report.full_depth_rows(gpu)}
    assert full["torch"]["gpu_peak_gib"] == 14.0 and full["unsloth"]["gpu_peak_gib"] is None  # not measured
    fit_only = dataclasses.replace(gpu, results=[r for r in gpu.results if r.depth != 4])
    assert all(r["gpu_peak_gib"] is None for r in report.full_depth_rows(fit_only))  # predicted: no GPU peak


def test_without_the_full_depth_the_figures_are_predicted_and_marked(flux_run):
    fit_only = dataclasses.replace(flux_run, results=[r for r in flux_run.results if r.depth != 4])
    rows = report.full_depth_rows(fit_only)
    none = next(r for r in rows if r["strategy"] == "none")
    measured = next(r for r in flux_run.results if r.strategy == "none" and r.depth == 4)
    assert none["peak_source"] == "predicted" and none["peak_gib"] == pytest.approx(measured.peak_gib, rel=1e-3)
    info = report.depth_info(fit_only, measured_full=False)
    text = report.full_depth_markdown(rows, info)
    assert "At the full depth (4 units = 4 + 8 blocks" in text and "~ = predicted" in text
    assert f"| ~{none['peak_gib']:.2f} |" in text
    doc = json.loads(json.dumps(report.payload(report.with_ratios(fit_only.results), "t", device="cpu",
                                               depth=info, full_depth=rows)))
    assert doc["depth"]["fit"] == [1, 2] and doc["depth"]["exact"] and doc["full_depth"][0]["strategy"] == "none"


def test_a_step_that_did_not_grow_between_the_fit_depths_is_not_predicted_and_the_table_says_why():
    """A timing noisier than what a unit adds (one timed step each, on a busy GPU) can time the deeper model faster:
    the line through the two would put the full model faster still. No step figure is predicted from it; the table
    says which row, both times, and how to measure it. Where the full depth was measured, that figure stands."""
    from gradseam.tools.depth import DepthPlan
    from gradseam.tools.results import RealRun, Result

    def row(strategy: str, depth: int, ms: float) -> Result:
        return Result("flux (16 seq)", 16, strategy, 0.5 * depth, ms, depth=depth, blocks=f"{depth} blocks")

    results = [row("none", 1, 100.0), row("none", 2, 180.0), row("torch", 1, 230.0), row("torch", 2, 207.0)]
    run = RealRun(DepthPlan({"blocks": 8}), (1, 2), 8, results)
    full = {r["strategy"]: r for r in report.full_depth_rows(run)}
    assert full["torch"]["step_ms"] is None and full["torch"]["vs_none"] is None
    assert full["torch"]["step_not_predicted"] == "230.0 ms at depth 1, 207.0 ms at depth 2"
    assert full["torch"]["peak_gib"] == pytest.approx(4.0), "its peak is still predicted"
    assert full["none"]["step_ms"] == pytest.approx(100.0 + 80.0 * 7) and "step_not_predicted" not in full["none"]
    text = report.full_depth_markdown(list(full.values()), report.depth_info(run, measured_full=False))
    assert "No step time predicted for torch (230.0 ms at depth 1, 207.0 ms at depth 2)" in text
    assert "--full-row" in text
    measured = RealRun(run.plan, (1, 2), 8, [*results, row("torch", 8, 900.0)])
    torch_row = next(r for r in report.full_depth_rows(measured) if r["strategy"] == "torch")
    assert torch_row["step_ms"] == 900.0 and torch_row["step_source"] == "measured"
    assert "step_not_predicted" not in torch_row


def test_a_row_streaming_a_count_of_blocks_is_not_predicted_from_cut_models_and_the_table_says_how_to_measure_it():
    """``+ stream N`` streams N blocks at every depth, all of a cut model's where it has fewer: at depths 1 and 2 of an
    8-block model, ``stream 4`` streams 1 block of 1 and 2 of 2 (every one), so a line through them is ``stream
    all``'s, not the full model's with 4 of 8 streamed. No figure is predicted, the status says why and how to measure
    it; measured at the full depth, that figure stands; ``stream all`` and a failure at a fit depth read as before."""
    from gradseam.tools.depth import DepthPlan
    from gradseam.tools.results import RealRun, Result

    def row(strategy: str, depth: int, ms: float, status: str = "ok") -> Result:
        return Result("flux (16 seq)", 16, strategy, 0.5 * depth if status == "ok" else None, ms, status=status,
                      depth=depth, blocks=f"{depth} blocks")

    counted, every = "torch + stream 4 @ 1GiB", "torch + stream all @ 1GiB"
    results = [row("none", 1, 100.0), row("none", 2, 180.0), row(counted, 1, 150.0), row(counted, 2, 260.0),
               row(every, 1, 150.0), row(every, 2, 260.0), row("torch + stream 2", 1, 150.0),
               row("torch + stream 2", 2, 0.0, status="OOM (GPU, in the forward)")]
    run = RealRun(DepthPlan({"blocks": 8}), (1, 2), 8, results)
    full = {r["strategy"]: r for r in report.full_depth_rows(run)}
    assert set(full[counted]) == set(full["none"]), "the row lost or gained a column"
    assert full[counted]["peak_gib"] is None and full[counted]["step_ms"] is None and full[counted]["vs_none"] is None
    assert full[counted]["status"] == (
        "not predicted: 'stream 4' streams 4 blocks at every depth, all of a cut model's where it has fewer, so its "
        "figures at depths 1 (1 blocks) and 2 (2 blocks) do not scale to the full depth; measure it there (--full "
        f"--full-row '{counted}')")
    assert full[every]["peak_gib"] == pytest.approx(4.0) and full[every]["status"] == "ok"
    assert full["torch + stream 2"]["status"] == "OOM (GPU, in the forward)"
    text = report.full_depth_markdown(list(full.values()), report.depth_info(run, measured_full=False))
    assert "not predicted: 'stream 4' streams 4 blocks at every depth" in text
    measured = RealRun(run.plan, (1, 2), 8, [*results, row(counted, 8, 900.0)])
    at_full = next(r for r in report.full_depth_rows(measured) if r["strategy"] == counted)
    assert at_full["step_ms"] == 900.0 and at_full["step_source"] == "measured" and at_full["status"] == "ok"
    # a --config-row's keys streaming a count in a per-block entry, and one streaming every block
    entry = {"gradient_checkpointing": True, "gradient_checkpointing_blocks": [
        {"blocks": "blocks[0:4]", "gradient_checkpointing_stream_weights": 2}]}
    every_entry = {"gradient_checkpointing": True, "gradient_checkpointing_stream_weights": "all"}
    mine = [dataclasses.replace(row(label, d, 100.0 * d), config=config)
            for label, config in (("mine", entry), ("mine, all", every_entry)) for d in (1, 2)]
    configs = {r["strategy"]: r for r in report.full_depth_rows(RealRun(run.plan, (1, 2), 8, [*results, *mine]))}
    assert configs["mine"]["status"].startswith(
        "not predicted: its config streams a count of blocks (gradient_checkpointing_stream_weights: a number) at "
        "every depth") and configs["mine"]["peak_gib"] is None
    assert configs["mine, all"]["status"] == "ok" and configs["mine, all"]["peak_gib"] == pytest.approx(4.0)
    # per-block entries selecting a range take the same blocks at every depth (Wan 2.1 14B's "blocks[0:5]" at budget 0:
    # every block of the 5-block cut, an eighth of the 40); an entry naming a whole list takes the same share
    ranged = {"gradient_checkpointing": True, "gradient_checkpointing_blocks": [
        {"blocks": "blocks[0:1]", "gradient_checkpointing_memory_budget": 0}]}
    whole = {"gradient_checkpointing": True, "gradient_checkpointing_blocks": [
        {"blocks": selector, "gradient_checkpointing_memory_budget": 0} for selector in ("blocks", "blocks[:]", "blocks[0:]")]}
    mine = [dataclasses.replace(row(label, d, 100.0 * d), config=config)
            for label, config in (("ranged", ranged), ("whole", whole)) for d in (1, 2)]
    configs = {r["strategy"]: r for r in report.full_depth_rows(RealRun(run.plan, (1, 2), 8, [*results, *mine]))}
    assert configs["ranged"]["status"].startswith(
        "not predicted: its config's per-block entries (gradient_checkpointing_blocks) select the same blocks at every "
        "depth") and configs["ranged"]["step_ms"] is None and "--full-row 'ranged'" in configs["ranged"]["status"]
    assert configs["whole"]["status"] == "ok" and configs["whole"]["step_ms"] is not None


def test_rows_that_would_not_fit_the_host_are_ruled_out_not_tried(flux_run, monkeypatch):
    results = [dataclasses.replace(r, pinned_gib=10.0 * r.depth) if r.strategy == "torch" else r
               for r in flux_run.results if r.depth != 4]
    run = dataclasses.replace(flux_run, results=results, host_available_gib=40.0)
    rule_out = b.ruled_out_at(run, results[0].workload, 4, "cpu")
    assert rule_out("torch") == ("ruled out: needs ~40.0 GiB of pinned host memory at depth 4, more than the "
                                 "30.0 GiB this machine can pin")
    assert rule_out("none") is None
    ran = b.run_rows("w", 1, torch.nn.Linear(1, 1), lambda: (lambda: 0), [("torch", {})], device="cpu",
                     rule_out=rule_out)
    assert ran[0].status.startswith("ruled out: needs ~40.0 GiB")


def test_predict_needs_both_fit_depths(flux_run):
    workload = flux_run.results[0].workload
    assert predict(flux_run.results, workload, "unsloth", (1, 2), 4, "peak_gib") is None
    value, line = predict(flux_run.results, workload, "none", (1, 2), 4, "peak_gib")
    assert value == pytest.approx(line.at(4))


def test_advise_rules_out_what_the_host_cannot_pin():
    def measure(config):
        if config.get("gradient_checkpointing_backend", "").startswith("unsloth"):
            return Estimate(1.0, 120.0, pinned_gib=50.0, growth_gib=0.0, source="predicted at depth 40")
        if config.get("gradient_checkpointing"):
            return Estimate(30.0, 130.0, growth_gib=0.5, source="predicted at depth 40")
        return Estimate(90.0, 100.0, growth_gib=2.0, source="predicted at depth 40")

    advice = run_ladder(measure, 20.0, 0.0, pinnable_gib=24.0)
    by = {t.label: t for t in advice.trials}
    assert by["unsloth"].status == "over host memory"
    assert by["unsloth"].reason == "needs 50.0 GiB of pinned host memory, more than the 24.0 GiB this machine can pin"
    assert by["torch"].status == "over GPU memory" and advice.chosen is None
    advice = run_ladder(measure, 20.0, 0.0, pinnable_gib=64.0)
    assert advice.chosen.label == "unsloth-ffn" and advice.chosen.pinned_gib == 50.0


def test_advise_recommends_compiling_when_the_compiler_wins():
    def measure(config):
        if config.get("compile_memory_budget") == 0.1:
            return Estimate(10.0, 101.0)
        if config.get("gradient_checkpointing") or config.get("compile_blocks"):
            return Estimate(10.0, 130.0)
        return Estimate(90.0, 100.0)

    advice = run_ladder(measure, 20.0, 0.0)
    assert advice.chosen.label == "compile, memory budget 0.1"
    assert advice.config == {"gradient_checkpointing": False}
    assert advice.compile == ("compile each transformer block with torch.compile (block.compile()), with "
                              "torch._functorch.config.activation_memory_budget = 0.1")
    assert "and compile each transformer block" in advice.report()
    assert json.loads(json.dumps(advice.to_dict()))["compile"] == advice.compile


def test_advise_on_a_cpu_model_predicts_what_the_full_depth_keeps():
    from gradseam.tools.advise import depth_measure
    from gradseam.tools.measure import forward_backward

    model = _stack(8)
    x = {"hidden_states": torch.randn(1, 16, 64, requires_grad=True)}
    measure, note = depth_measure(model, x, device="cpu", depths=(2, 4))
    assert note.startswith("depth 8 (8 blocks; one unit of depth = one block), predicted from measurements "
                           "at depths 2 and 4")
    got = measure({"gradient_checkpointing": True})
    assert got.source == "predicted at depth 8" and got.growth_gib > 0
    handle = gradseam.patch(model, {"gradient_checkpointing": True})
    try:
        kept = forward_backward(model, x, count_saved=True)()  # the full model, measured directly
    finally:
        handle.remove()
    assert got.peak_gib == pytest.approx(kept / (1 << 30), rel=1e-9)


def test_real_with_the_full_model_built_picks_default_fit_depths():
    run = b.real(_tiny_flux(), "tiny", full=True, rows=["none"], steps=1, device="cpu")
    assert run.fit_depths == (2, 4) and sorted({r.depth for r in run.results}) == [2, 4]
    assert report.full_depth_rows(run)[0]["peak_source"] == "measured"  # 4 is the full depth, and a fit depth


def test_applied_patches_compiles_and_restores_as_its_config_says():
    # bench's rows and advise's candidates both go through compiled.applied: a compile-only config
    # compiles every block and patches nothing; a gradseam + compile config does both; both undo.
    from gradseam.tools.compiled import applied, budget_config
    from gradseam.tools.measure import forward_backward

    model = _stack(3, 32)
    x = {"hidden_states": torch.randn(1, 8, 32, requires_grad=True)}
    forward_backward(model, x)()
    want = x["hidden_states"].grad.clone()
    for config in (budget_config(0.1), {"gradient_checkpointing": True, "compile_blocks": True}):
        with applied(model, config, list(model.blocks)):
            assert all(block._compiled_call_impl is not None for block in model.blocks)
            assert (gradseam.handle_of(model) is not None) == ("gradient_checkpointing" in config)
            forward_backward(model, x)()
        assert torch.equal(x["hidden_states"].grad, want)
        assert gradseam.handle_of(model) is None
        assert all(block._compiled_call_impl is None for block in model.blocks)
    with pytest.raises(gradseam.UnsupportedStrategyError, match="did not name its blocks"), \
            applied(model, budget_config(0.1), None):
        pass


def test_a_list_that_starts_with_unlike_blocks_is_fitted_past_them():
    """Nucleus-Image's first three blocks are dense, the rest route to experts: depths 2 and 4 would hold two dense
    blocks, then three and one expert block, and read that block's working set as growth (on an H100, 0.22 GiB a
    block under torch). The plan sees the three, and its default depths start past them; a list whose only unlike
    block is its last (SD3's) or whose blocks are all alike keeps 2 and 4."""
    from test_family_nucleus_moe import nucleus_model
    from torch import nn

    from gradseam.patcher import family_for
    from gradseam.tools.depth import leading_unlike

    model = nucleus_model(num_layers=8, dense_moe_strategy="leave_first_three_blocks_dense",
                          capacity_factors=[0.0, 0.0, 0.0, 4.0, 4.0, 2.0, 2.0, 2.0])
    plan = plan_for(model, family_for(model))
    assert plan.leading == {"transformer_blocks": 3}
    assert plan.default_depths() == (4, 6) == plan.fit_depths(None)
    assert "the first 3 of transformer_blocks (8 blocks) are built unlike the rest" in plan.leading_note()
    assert plan.fit_depths("2,4") == (2, 4) == plan.fit_depths((2, 4))  # asked for: as asked
    assert DepthPlan({"blocks": 8}, {"blocks": 6}).default_depths() is None  # too shallow to go past them
    from gradseam.tools.advise import depth_measure

    _, note = depth_measure(model, {}, device="cpu")  # what advise and auto say they planned from
    assert "measurements at depths 4 and 6 (the first 3 of transformer_blocks" in note and "past them" in note

    alike = [nn.Linear(2, 2) for _ in range(4)]
    last_unlike = [*alike[:3], nn.Sequential(nn.Linear(2, 2))]
    assert leading_unlike(alike) == 0 == leading_unlike(last_unlike)
    assert leading_unlike([nn.Sequential(nn.Linear(2, 2)), *alike[:3]]) == 1
    assert DepthPlan({"blocks": 40}, {"blocks": 0}).default_depths() is None


def test_a_row_refused_at_a_shallow_depth_is_not_tried_deeper(monkeypatch):
    """The deeper model holds every block the shallower one ran, so gradseam's refusal stands there. Tried again,
    AnyFlow-FAR's attention-offload row read OOM at depth 4 on an H100 (dynamo, having given up on the attention's own
    compiled frame, ran flex attention eagerly) where it had been refused at depth 2."""
    real = b.measuring.measure
    calls: list[int] = []

    def measure(step, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # depth 1: none, then torch
            raise gradseam.UnsupportedStrategyError("simulated: this model's attention cannot run under torch")
        return real(step, **kwargs)

    monkeypatch.setattr(b.measuring, "measure", measure)
    run = b.real(_tiny_flux(), "tiny", depths="1,2", rows=["none", "torch"], steps=1, device="cpu")
    by = {(r.strategy, r.depth): r.status for r in run.results}
    assert len(calls) == 3 and by[("none", 1)] == by[("none", 2)] == "ok"  # torch at depth 2 never ran
    assert by[("torch", 1)] == "unsupported: simulated: this model's attention cannot run under torch"
    assert by[("torch", 2)] == by[("torch", 1)] + " (refused at depth 1; not tried again deeper)"
