"""``gradseam bench --row auto`` (issue 41): gradseam's planner measured as a row, beside the uniform rows it must
beat. On the CPU: the labels and options, the row run through bench's own measuring path with the planner's
two-depth measurement done on the CPU (the offload test mode), and what the table prints. Its GPU run, a model
larger than the cap patched on the CPU and moved, is ``tests/test_gpu_auto.py``'s."""

from __future__ import annotations

import json

import pytest
import torch
from cases import WAN
from typer.testing import CliRunner

import gradseam
from gradseam import CheckpointConfig, UnsupportedStrategyError
from gradseam.auto import Request, use_planner
from gradseam.errors import GradseamError
from gradseam.offload import cpu_test_mode
from gradseam.tools import auto_planner
from gradseam.tools import bench as b
from gradseam.tools import measure as measuring
from gradseam.tools.bench_report import auto_plans_note, with_ratios
from gradseam.tools.bench_rows import AUTO_ROW, GPU_CAP_KEY, NEEDS_CUDA, cpu_status, real_rows
from gradseam.tools.cli import app


def test_auto_is_a_row_only_a_label_asks_for_and_may_carry_its_cap():
    assert AUTO_ROW not in dict(real_rows()), "every row by default would plan (minutes on a big model) unasked"
    rows = dict(real_rows(["torch", "auto", "auto @ 24GiB"]))
    assert rows["auto"] == {"gradient_checkpointing": True, "gradient_checkpointing_backend": "auto"}
    assert rows["auto @ 24GiB"] == {**rows["auto"], GPU_CAP_KEY: 24.0}
    assert cpu_status("auto") == cpu_status("auto @ 24GiB") == NEEDS_CUDA
    with pytest.raises(GradseamError, match=r"unknown bench rows \['auto \+ stream all'\].*auto \(gradseam's planner"):
        real_rows(["auto + stream all"])  # the planner decides what streams


def test_at_the_fit_depths_of_a_full_run_auto_is_not_measured_saying_why():
    rule_out = b.capped_at_fit_depth(real_rows(["torch", "auto"]), None)
    assert rule_out("torch") is None
    assert "auto plans the model it is given" in rule_out("auto")
    assert "auto plans the model it is given" in rule_out("auto @ 12GiB")


def _cpu_measure_on(request: Request):
    """advise's two-depth measurement on the CPU (saved bytes for the peak), the whole-block backends only."""
    from gradseam.tools.advise import depth_measure

    run, note = depth_measure(request.model, request.inputs, family=request.family, device="cpu", depths=(1, 2))

    def measure(config):
        if config.get("gradient_checkpointing_backend", "torch") not in ("torch", "unsloth"):
            raise UnsupportedStrategyError("left out of this test (compiling on a 2-core runner takes minutes)")
        return run(config)

    return measure, note, 0.0


def test_the_auto_row_plans_at_its_first_step_within_bench_budgets_and_reports_the_plan(tmp_path, monkeypatch):
    """bench's measuring path with the planner measuring on the CPU: the row's cap and --host-memory reach the
    planner as its budgets, the first step plans (its time is the row's first step), the row keeps the plan's keys,
    and the model comes back unpatched."""
    monkeypatch.setenv("GRADSEAM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(b, "capped", lambda gib: __import__("contextlib").nullcontext())
    seen: list[Request] = []
    answers = []

    def planner(request: Request):
        seen.append(request)
        answers.append(auto_planner.plan(request, measure_on=_cpu_measure_on))
        return answers[-1]

    model = WAN.fresh()
    inputs = WAN.inputs(torch.Generator().manual_seed(1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sweep = b._Sweep("w", 1, model, lambda: measuring.forward_backward(model, inputs, count_saved=True), 1, "blocks",
                     "cpu", None, None, None, host_gib=3.0)
    label = "auto @ 40GiB"
    previous = use_planner(planner)
    try:
        with cpu_test_mode():
            result = b._measure_row(sweep, label, dict(real_rows([label]))[label])
    finally:
        use_planner(previous)
    assert result.status == "ok" and result.peak_gib > 0 and result.first_step_ms > 0
    assert [(r.gpu_gib, r.host_gib, r.streamed) for r in seen] == [(40.0, 3.0, False)]
    assert result.plan["source"] == "measured" and result.plan["report"] == answers[0].report
    assert CheckpointConfig.from_dict(result.plan["config"]) == answers[0].config, "the keys are not the plan's"
    assert gradseam.handle_of(model) is None, "the row left its patch on the model"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    note = auto_plans_note(with_ratios([result]))
    assert note.startswith("auto @ 40GiB: its first step planned (measured costs) and took ")
    assert json.dumps(result.plan["config"]) in note
    said = result.plan["predicted"]
    assert said == answers[0].predicted and said["step_ms"] > 0
    assert f"auto @ 40GiB: step {result.step_ms:.2f} ms measured, {said['step_ms']:.2f} predicted (" in note


def test_an_auto_row_that_runs_out_of_memory_after_planning_keeps_its_plan_and_the_note_names_it(tmp_path, monkeypatch):
    """Flux dev 4k under 16 GiB on an H100 (2026-12-05): the plan ran out of memory in its first backward, and the
    row said only "OOM"; which plan, and what it had predicted, were lost with the exception."""
    monkeypatch.setenv("GRADSEAM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(b, "capped", lambda gib: __import__("contextlib").nullcontext())

    planned: list = []
    measure = measuring.measure

    def out_of_memory_once_planned(step, **kwargs):  # the planner's own measuring runs as it does
        if not planned:
            return measure(step, **kwargs)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 54.00 MiB")

    def planner(request):
        planned.append(auto_planner.plan(request, measure_on=_cpu_measure_on))
        return planned[-1]

    monkeypatch.setattr(measuring, "measure", out_of_memory_once_planned)
    model = WAN.fresh()
    inputs = WAN.inputs(torch.Generator().manual_seed(1))
    monkeypatch.setattr(b, "cpu_status", lambda name, config: None)  # the row runs on the CPU, as in the test above
    previous = use_planner(planner)
    try:
        with cpu_test_mode():
            [row] = b.run_rows("w", 1, model, lambda: measuring.forward_backward(model, inputs, count_saved=True),
                               real_rows(["auto @ 40GiB"]), steps=1, device="cpu")
    finally:
        use_planner(previous)
    assert row.status == "OOM" and row.plan is not None, row
    assert row.plan["report"] == planned[0].report and CheckpointConfig.from_dict(row.plan["config"]) == planned[0].config
    assert gradseam.handle_of(model) is None, "the failed row left its patch on the model"
    note = auto_plans_note(with_ratios([row]))
    assert note.startswith("auto @ 40GiB: planned (measured costs), then OOM") and row.plan["report"] in note


def test_the_auto_note_sets_each_measured_figure_against_the_plans_prediction():
    # issue 41's Wan 2.1 14B row (H100, 24 GiB / 48 GiB host): what the plan predicted beside what the row measured
    row = {"strategy": "auto @ 24GiB", "depth": 40, "first_step_ms": 262_800.0, "gpu_peak_gib": 19.54,
           "pinned_gib": 47.34, "step_ms": 15_701.6,
           "plan": {"source": "measured", "config": {"gradient_checkpointing": True}, "report": "",
                    "predicted": {"gpu_gib": 19.33, "host_gib": 47.65, "step_ms": 15_444.6}}}
    lines = auto_plans_note([row]).splitlines()
    assert lines[1] == ("auto @ 24GiB at depth 40: GPU peak 19.54 GiB measured, 19.33 predicted (+1.1%); pinned host "
                        "47.34 GiB measured, 47.65 predicted (-0.7%); step 15701.60 ms measured, 15444.60 predicted "
                        "(+1.7%)")
    row["plan"]["predicted"] = None  # the default plan (nothing measured) predicts nothing
    assert len(auto_plans_note([row]).splitlines()) == 1


def test_host_memory_is_refused_without_an_auto_row_naming_the_fix():
    result = CliRunner().invoke(app, ["bench", "--family", "wan", "--row", "torch", "--host-memory", "48GiB"])
    assert result.exit_code != 0
    assert "--host-memory" in result.output and "--row auto" in result.output
    bad = CliRunner().invoke(app, ["bench", "--family", "wan", "--row", "auto", "--host-memory", "lots"])
    assert bad.exit_code != 0 and "--host-memory" in bad.output and "lots" in bad.output


def test_a_model_goes_through_the_cpu_only_when_its_weights_are_more_than_the_cap():
    """The auto row patches on the CPU (as a model is loaded) exactly when the cap could not hold its weights."""
    model = WAN.fresh()
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    assert b._larger_than_gpu(model, 0.9 * weights)
    assert not b._larger_than_gpu(model, 1.1 * weights)
