"""``gradient_checkpointing_backend: "auto"`` (issue 41): each block planned at the first training step.

The planner's answer is an explicit config, and a model planned by it must train exactly like a model
patched with that config from the start, whether the costs were read from the cache or measured inside
the first forward (the measuring steps then leave no trace: gradients and random states are put back).
The costs here are a table written into the cache (GPU figures cannot be measured on a CPU) or, for
the measuring path, advise's own two-depth measurement run on the CPU in the offload test mode.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from cases import WAN

import gradseam
from gradseam import CheckpointConfig, GradseamError, UnsupportedStrategyError
from gradseam.auto import Request, use_planner
from gradseam.offload import cpu_test_mode
from gradseam.patcher import family_for
from gradseam.testing import assert_same_step
from gradseam.testing.steps import Step
from gradseam.tools import auto_planner, cost_cache, parking
from gradseam.tools import measure as measuring
from gradseam.tools.advise import Estimate, NoFitError, UnitCosts

UNITS = 5  # the tiny Wan's blocks
# per unit: (step ms, GPU GiB held, pinned GiB); at depth zero: (ms, peak GiB, pinned GiB)
TABLE = {
    "torch + attention kept": ((10.0, 2.0, 0.0), (4.0, 1.0, 0.0)),  # fast, keeps attention on the GPU
    "unsloth": ((11.0, 0.2, 2.0), (4.0, 1.5, 0.5)),  # about as fast, pins the block inputs in host memory
    "torch": ((14.0, 0.4, 0.0), (4.0, 1.2, 0.0)),  # recomputes, holds little, pins nothing
}
STATIC = 1.0
AUTO = {"gradient_checkpointing_backend": "auto"}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADSEAM_CACHE_DIR", str(tmp_path))
    return tmp_path


def _inputs(seed: int = 1) -> dict:
    return WAN.inputs(torch.Generator().manual_seed(seed))


def _recording(measured: list[dict], label: str):
    """A ``measure_on`` that records every config it is asked to measure into ``measured`` and answers each with
    ``label``'s estimate from :data:`TABLE`."""
    def measure_on(request: Request):
        def measure(config):
            measured.append(dict(config))
            return _estimate(label)
        return measure, "depth 5, from a table", STATIC
    return measure_on


def _estimate(label: str) -> Estimate:
    (ms, gpu, host), (ms0, peak0, host0) = TABLE[label]
    costs = UnitCosts(UNITS, ms, ms0, gpu, peak0, host, host0)
    return Estimate(peak0 + UNITS * gpu, ms0 + UNITS * ms, host0 + UNITS * host, gpu, "predicted", costs)


def _write_table(model: torch.nn.Module, inputs: dict, static: float = STATIC) -> None:
    """The cache entry a GPU run of this model on these inputs would have left: the three candidates above."""
    family = family_for(model)
    key = cost_cache.key_of(Request(model, inputs, None, None, family), auto_planner.CANDIDATES)
    results = {label: _estimate(label) if label in TABLE else "unsupported: not in this table"
               for label, _ in auto_planner.CANDIDATES}
    cost_cache.save(key, cost_cache.Table(auto_planner.CANDIDATES, results, static, "depth 5, from a table"))


def _step(model: torch.nn.Module, inputs: dict, grads_before: dict[str, torch.Tensor] | None = None) -> Step:
    """A training step that accumulates onto ``grads_before`` (as gradient accumulation would)."""
    for name, p in model.named_parameters():
        p.grad = grads_before[name].clone() if grads_before else None
    out = model(**inputs).sample
    out.square().mean().backward()
    return Step((out.detach(),), {k: v.grad.clone() for k, v in inputs.items() if getattr(v, "grad", None) is not None},
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, 0)


def test_a_plan_from_cached_costs_trains_exactly_like_the_explicit_config_it_prints():
    model, inputs = WAN.fresh(), _inputs()
    _write_table(model, inputs)
    with cpu_test_mode():
        handle = gradseam.patch(model, {**AUTO, "gradient_checkpointing_gpu_memory": 8, "gradient_checkpointing_host_memory": 5})
        assert handle.auto.planned is None and not handle.regions()  # nothing planned before the first training step
        got = _step(model, inputs)
        planned = handle.auto.planned
        assert planned.source == "cached"
        config = handle.auto.config
        assert config.gradient_checkpointing_blocks, config  # a mix: attention kept beside unsloth or torch
        kinds = {(r.kind, r.destination.value) for r in handle.regions()}
        assert len(kinds) >= 2, kinds
        summary = str(handle.summary())
        assert "\"auto\" (cached): a per-block plan" in summary and "GPU budget 8.00 GiB" in summary
        explicit = WAN.fresh()
        with gradseam.patch(explicit, config.given_keys()) as again:
            expected = _step(explicit, _inputs())
            assert [r.kind for r in again.regions()] == [r.kind for r in handle.regions()]
    assert_same_step(expected, got, what="auto vs the config it printed")
    assert_same_step(_step(WAN.fresh(), _inputs()), got, what="auto vs unpatched")
    json.dumps(config.to_dict())  # the plan saves as plain keys


def test_budgets_choose_the_plan_and_a_budget_nothing_fits_says_so_at_the_first_step():
    model, inputs = WAN.fresh(), _inputs()
    _write_table(model, inputs)
    with cpu_test_mode():
        # generous budgets: attention kept everywhere is fastest and fits, so no mix
        handle = gradseam.patch(model, {**AUTO, "gradient_checkpointing_gpu_memory": 40, "gradient_checkpointing_host_memory": 64})
        _step(model, inputs)
        config = handle.auto.config
        assert config.keep_attention and config.backend == "torch" and not config.gradient_checkpointing_blocks
        handle.remove()
        small = WAN.fresh()
        gradseam.patch(small, {**AUTO, "gradient_checkpointing_gpu_memory": "2GiB", "gradient_checkpointing_host_memory": 64})
        with pytest.raises(NoFitError, match=r"nothing fits in 2.00 GiB of GPU memory"):
            _step(small, _inputs())


def test_the_same_costs_and_budgets_give_the_same_plan():
    model, inputs = WAN.fresh(), _inputs()
    _write_table(model, inputs)
    request = Request(model, inputs, 8.0, 5.0, family_for(model))
    planned = [auto_planner.plan(request) for _ in range(3)]
    assert planned[0].config == planned[1].config == planned[2].config
    assert planned[0].config.gradient_checkpointing_blocks and planned[0].report == planned[2].report


def _cpu_measure_on(request: Request):
    """advise's two-depth measurement on the CPU (saved bytes for the peak), of the whole-block candidates only."""
    from gradseam.tools.advise import depth_measure

    run, note = depth_measure(request.model, request.inputs, family=request.family, device="cpu", depths=(1, 2))

    def measure(config):
        if config.get("gradient_checkpointing_backend", "torch") not in ("torch", "unsloth"):
            raise UnsupportedStrategyError("left out of this test (compiling on a 2-core runner takes minutes)")
        torch.rand(1)  # what a model with dropout draws in each measured forward (the tiny Wan draws nothing)
        return run(config)

    return measure, note, 0.0


def test_measured_inside_the_first_step_it_leaves_no_trace_and_the_next_run_reads_the_cache(_cache, capsys):
    previous = use_planner(functools.partial(auto_planner.plan, measure_on=_cpu_measure_on))
    try:
        torch.manual_seed(0)
        base = WAN.fresh()
        grads = {n: torch.full_like(p, 0.5) for n, p in base.named_parameters()}  # accumulated before this step
        with cpu_test_mode():
            model = WAN.fresh()
            handle = gradseam.patch(model, {**AUTO, "gradient_checkpointing_gpu_memory": 40})
            torch.manual_seed(7)
            got = _step(model, _inputs(), grads)
            after_auto = torch.rand(3)
            assert handle.auto.planned.source == "measured"
            progress = capsys.readouterr().err
            assert "gradseam auto: WanTransformer3DModel: measuring 1/" in progress and "torch" in progress
            # each candidate's own time, and the total in the plan's report
            assert re.search(r"gradseam auto: WanTransformer3DModel: 1/\d+ \S.*: measured in \d+\.\d s", progress)
            assert re.search(r"measuring took \d+\.\d s", handle.auto.planned.report)
            assert list(_cache.glob("costs/*.json")), "the measured costs were not cached"
            config = handle.auto.config
            explicit = WAN.fresh()
            with gradseam.patch(explicit, config.given_keys()):
                torch.manual_seed(7)
                expected = _step(explicit, _inputs(), grads)
                assert torch.equal(after_auto, torch.rand(3)), "measuring drew from the random generator"
            assert_same_step(expected, got, what="auto (measured in the step) vs its config")
            # a second run of the same model and shapes reads the table: same plan, nothing measured
            again = WAN.fresh()
            with gradseam.patch(again, {**AUTO, "gradient_checkpointing_gpu_memory": 40}) as second:
                _step(again, _inputs())
                assert second.auto.planned.source == "cached" and second.auto.config == config
            assert "measuring" not in capsys.readouterr().err
    finally:
        use_planner(previous)


def test_each_candidate_is_measured_with_the_blocks_outside_its_cut_parked_and_they_come_back(capsys):
    """Measured on the model cut to depths 1 and 2, each candidate runs with the blocks it leaves out in host memory
    (gradseam.tools.parking: on a GPU they would crowd the candidate's room); the training step runs every block, back
    as it was. The exactness of that step against its config is the test above's."""
    seen: list[tuple[bool, ...]] = []

    def measure_on(request: Request):
        blocks = list(request.model.blocks)
        blocks[0].register_forward_pre_hook(
            lambda module, args: seen.append(tuple(all(p.numel() == 0 for p in b.parameters()) for b in blocks)))
        return _cpu_measure_on(request)

    runs: list = []
    previous = use_planner(functools.partial(auto_planner.plan, measure_on=measure_on, check_on=_cpu_check_on(runs)))
    try:
        with cpu_test_mode():
            model = WAN.fresh()
            data = {name: t.detach().clone() for name, t in model.state_dict().items()}
            with gradseam.patch(model, {**AUTO, "gradient_checkpointing_gpu_memory": 40}) as handle:
                got = _step(model, _inputs())
                assert (False, True, True, True, True) in seen and (False, False, True, True, True) in seen, seen
                assert runs and handle.auto.planned.measured is not None, "the plan was not run on the whole model"
                # the plan's run on the whole model (its warm-up and timed step) and the training step: every block
                assert seen[-3:] == [(False,) * 5] * 3, seen
                assert "moved to host memory" in capsys.readouterr().err
            assert all(torch.equal(t, data[name]) for name, t in model.state_dict().items())
            explicit = WAN.fresh()
            with gradseam.patch(explicit, handle.auto.config.given_keys()):
                expected = _step(explicit, _inputs())
            assert_same_step(expected, got, what="auto, measured with the blocks outside each cut parked, vs its config")
    finally:
        use_planner(previous)


def test_a_model_whose_weights_stream_already_is_measured_without_parking():
    class Streamed:
        model = torch.nn.Linear(1, 1)
        streamed = True

    with auto_planner._Rows(Streamed(), _cpu_measure_on).parked():
        assert parking.session_of(Streamed.model) is None, "parked a model whose weights a stream holds already"


def test_without_cuda_or_cached_costs_every_block_runs_torch_and_a_warning_says_what_auto_would_measure():
    model = WAN.fresh()
    handle = gradseam.patch(model, AUTO)
    with torch.no_grad():  # an evaluation forward plans nothing
        model(**_inputs())
    assert handle.auto.planned is None
    with pytest.warns(gradseam.errors.GradseamWarning, match=r"measures each candidate \(none, torch-ffn, torch.*on its "
                      r"CUDA GPU.*is on cpu, not a CUDA GPU.*Every block runs the default, backend 'torch'"):
        got = _step(model, _inputs())
    assert handle.auto.planned.source == "default" and handle.auto.config.backend == "torch"
    assert {r.kind for r in handle.regions()} == {"whole-block"}
    assert_same_step(_step(WAN.fresh(), _inputs()), got)
    handle.remove()
    assert gradseam.handle_of(model) is None and not model._forward_pre_hooks


def test_under_distributed_with_nothing_cached_measuring_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    request = Request(WAN.fresh(), _inputs(), 8.0, 5.0, family_for(WAN.fresh()))
    with pytest.raises(GradseamError, match=r"does not measure under torch.distributed \(2 processes\).*Run one step in "
                       r"a single process first"):
        auto_planner.plan(request, measure_on=_cpu_measure_on)


@pytest.mark.parametrize(("keys", "message"), [
    ({**AUTO, "gradient_checkpointing_interval": 2}, r"'gradient_checkpointing_interval'.*\"auto\" chooses"),
    ({**AUTO, "gradient_checkpointing_offload_attention": True}, r"\"auto\" chooses gradient_checkpointing_offload_attention"),
    ({**AUTO, "gradient_checkpointing_stream_weights": 2}, r"decides which blocks' weights stream itself.*gradseam "
     r"advise --family NAME --preset NAME --gpu-memory SIZE"),
    ({"gradient_checkpointing_gpu_memory": "24GiB"}, r"read only with gradient_checkpointing_backend \"auto\".*'torch'"),
    ({**AUTO, "gradient_checkpointing_host_memory": "lots"}, r"'gradient_checkpointing_host_memory': cannot read 'lots'"),
    ({"gradient_checkpointing_blocks": [{"blocks": "blocks[0:2]", "gradient_checkpointing_backend": "auto"}]},
     r"entry 0 \('blocks\[0:2\]'\): \"auto\" plans every block"),
])
def test_what_auto_cannot_honour_is_refused_naming_the_key(keys, message):
    with pytest.raises(ValueError, match=message):
        CheckpointConfig.from_dict(keys)


def test_the_cache_key_follows_the_shapes_and_a_damaged_file_is_measured_again(_cache):
    model = WAN.fresh()
    family = family_for(model)
    key = cost_cache.key_of(Request(model, _inputs(), None, None, family), auto_planner.CANDIDATES)
    wider = cost_cache.key_of(Request(model, WAN.inputs(torch.Generator().manual_seed(1), side=8), None, None, family),
                              auto_planner.CANDIDATES)
    assert key != wider and key["inputs"]["hidden_states"]["shape"] == [1, 4, 2, 4, 4]
    _write_table(model, _inputs())
    assert cost_cache.load(key) is not None and cost_cache.load(wider) is None
    path = next(_cache.glob("costs/*.json"))
    path.write_text("{not json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cost_cache.load(key) is None


def test_the_optimizers_moments_are_counted_before_it_allocates_them(monkeypatch):
    """Optimizers make their state at their first step, after the forward that plans: Adam's two moments of every
    trainable parameter are added to the static memory the plan must leave room for."""
    layer = torch.nn.Linear(256, 256)
    assert auto_planner.optimizer_gib(layer) == 2 * 4 * (256 * 256 + 256) / 2**30
    assert auto_planner.optimizer_gib(layer.requires_grad_(False)) == 0.0
    model, inputs = WAN.fresh(), _inputs()
    _write_table(model, inputs)
    monkeypatch.setattr(auto_planner, "OPTIMIZER_MOMENTS", 20_000)  # the tiny Wan's moments, made big enough to see
    static = STATIC + auto_planner.optimizer_gib(model)
    assert static > STATIC + 0.5
    planned = auto_planner.plan(Request(model, inputs, 40.0, 64.0, family_for(model)))
    assert f"static memory {static:.2f} GiB (weights, inputs and the optimizer's moments)" in planned.report


def test_measuring_puts_back_the_gradients_of_inputs_nested_in_lists():
    """Models that take lists of per-sample latents (Z-Image): their leaves' .grad is put back too."""
    from gradseam.modules import untouched

    model = torch.nn.Linear(2, 2)
    leaf = torch.ones(3, requires_grad=True)
    leaf.grad = torch.full((3,), 7.0)
    with untouched(model, {"x": [leaf], "t": torch.tensor(1.0)}):
        assert leaf.grad is None  # as a measured step starts
        leaf.grad = torch.zeros(3)
    assert torch.equal(leaf.grad, torch.full((3,), 7.0))


BLOCK_GIB = 1.0  # each tiny Wan block's frozen weights, as the planner is told (the real ones are kilobytes)
COPY_MS = 1.5  # what streaming a block's weights adds per unit to a candidate's step


def _frozen_blocks() -> torch.nn.Module:
    """The tiny Wan with its blocks frozen (what streams) and the rest training (a stand-in for a LoRA)."""
    model = WAN.fresh()
    for block in model.blocks:
        block.requires_grad_(False)
    return model


def _streaming_measure_on(calls: list):
    """A GPU run's rows with every block's weights streamed: the resident row, slower by the copies."""
    labels = {json.dumps(config, sort_keys=True): label for label, config in auto_planner.CANDIDATES}

    def measure_on(request: Request):
        def run(config):
            calls.append(dict(config))
            assert config[auto_planner.STREAM_KEY] is not None, "only streamed rows are missing from the table"
            resident = {k: v for k, v in config.items() if k != auto_planner.STREAM_KEY}
            label = labels[json.dumps(resident, sort_keys=True)]
            if label not in TABLE:
                raise UnsupportedStrategyError("left out of this table")
            (ms, gpu, host), (ms0, peak0, host0) = TABLE[label]
            costs = UnitCosts(UNITS, ms + COPY_MS, ms0, gpu, peak0, host, host0)
            return Estimate(peak0 + UNITS * gpu, ms0 + UNITS * (ms + COPY_MS), host0 + UNITS * host, gpu, "predicted",
                            costs)

        return run, "depth 5, from a table", STATIC

    return measure_on


def test_when_the_weights_are_what_does_not_fit_auto_streams_some_and_trains_exactly_like_its_config(_cache, monkeypatch,
                                                                                                      capsys):
    """Weights of 5 GiB and a budget of 8.4: no resident candidate fits (unsloth, the leanest, needs 2.5 + 6 GiB
    of static memory), so the streamed rows are measured at the first step, cached, and the plan streams the
    weights of some blocks; the next run with the same shapes reads every row from the cache."""
    monkeypatch.setattr(auto_planner, "streamable_gib", lambda request: [BLOCK_GIB] * UNITS)
    model, inputs = _frozen_blocks(), _inputs()
    _write_table(model, inputs, static=STATIC + UNITS * BLOCK_GIB)
    calls: list = []
    budgets = {"gradient_checkpointing_gpu_memory": 8.4, "gradient_checkpointing_host_memory": 64}
    previous = use_planner(functools.partial(auto_planner.plan, measure_on=_streaming_measure_on(calls)))
    sessions: list = []
    parking_session = parking.Parking.__init__
    monkeypatch.setattr(parking.Parking, "__init__", lambda self, *a, **k: (sessions.append(self),
                                                                           parking_session(self, *a, **k))[1])
    try:
        with cpu_test_mode():
            handle = gradseam.patch(model, {**AUTO, **budgets})
            got = _step(model, inputs)
            assert len(calls) > 1 and len(sessions) == 1, "the streamed rows asked for did not share one parking session"
            config = handle.auto.config
            keys = config.to_dict()
            streams = [e for e in keys.get("gradient_checkpointing_blocks", ()) if e.get(auto_planner.STREAM_KEY)]
            assert streams or keys.get(auto_planner.STREAM_KEY), keys
            assert handle.weights is not None and 0 < len(handle.weights.blocks) <= UNITS
            assert calls and all(c[auto_planner.STREAM_KEY] for c in calls)
            assert "+ stream" in capsys.readouterr().err
            assert "+ stream" in handle.auto.planned.report or "stream" in str(handle.summary())
            explicit = _frozen_blocks()
            with gradseam.patch(explicit, config.given_keys()) as again:
                expected = _step(explicit, _inputs())
                assert len(again.weights.blocks) == len(handle.weights.blocks)
            assert_same_step(expected, got, what="auto with streamed weights vs the config it printed")
            assert_same_step(_step(_frozen_blocks(), _inputs()), got, what="auto with streamed weights vs unpatched")
            measured = len(calls)
            second = _frozen_blocks()
            with gradseam.patch(second, {**AUTO, **budgets}) as handle2:
                _step(second, _inputs())
                assert handle2.auto.config == config and len(calls) == measured  # every row read from the cache
    finally:
        use_planner(previous)


def test_a_model_larger_than_its_budget_has_every_per_block_candidate_measured_streamed(monkeypatch):
    """A model larger than its GPU streams most of its blocks, so which activations a streamed unit runs matters most:
    every per-block candidate is measured with every block streamed (Wan 2.1 14B at 24 GiB planned three streamed
    kinds, where a model that fits gets the two fastest only), beside the resident ones it may keep."""
    monkeypatch.setattr(auto_planner, "streamable_gib", lambda request: [BLOCK_GIB] * UNITS)
    model, inputs = _frozen_blocks(), _inputs()
    streamed_all: dict[bool, set[str]] = {}
    for larger in (False, True):
        _write_table(model, inputs, static=STATIC + (0 if larger else UNITS * BLOCK_GIB))  # the table as measured
        calls: list = []
        auto_planner.plan(Request(model, inputs, 8.4, 64.0, family_for(model), streamed=larger),
                          measure_on=_streaming_measure_on(calls))
        streamed_all[larger] = {json.dumps(c, sort_keys=True) for c in calls if c[auto_planner.STREAM_KEY] == "all"}
    assert len(streamed_all[False]) == 2 and len(streamed_all[True]) == len(TABLE), streamed_all
    assert streamed_all[False] < streamed_all[True]


def test_a_model_larger_than_its_budget_whose_candidates_ran_out_of_memory_resident_is_planned_from_streamed_rows(
        monkeypatch):
    """Wan 2.1 14B at 480p under 12 GiB (an H200): each candidate measured with the cut model's blocks resident ran out
    of memory, and "auto" raised NoFitError. Those candidates are measured again with every block streamed, and the
    plan is made of them: the table's resident rows all out of memory, the streamed ones measured."""
    monkeypatch.setattr(auto_planner, "streamable_gib", lambda request: [BLOCK_GIB] * UNITS)
    model, inputs = _frozen_blocks(), _inputs()
    family = family_for(model)
    key = cost_cache.key_of(Request(model, inputs, None, None, family), auto_planner.CANDIDATES)
    oom = cost_cache.oom_while_measuring("CUDA out of memory (the cut model's blocks resident)", 12.0)
    results = {label: oom if label in TABLE else "unsupported: not in this table" for label, _ in auto_planner.CANDIDATES}
    cost_cache.save(key, cost_cache.Table(auto_planner.CANDIDATES, results, STATIC, "depth 5, from a table"))
    calls: list = []
    planned = auto_planner.plan(Request(model, inputs, 8.4, 64.0, family, streamed=True),
                                measure_on=_streaming_measure_on(calls))
    streamed = {json.dumps(c, sort_keys=True) for c in calls if c[auto_planner.STREAM_KEY] == "all"}
    assert len(streamed) == len(TABLE), calls  # each candidate that ran out of memory, measured streamed
    assert "stream" in json.dumps(planned.config.to_dict()), planned.config.to_dict()


def test_no_plan_from_rows_that_all_ran_out_of_memory_says_what_their_steps_began_with():
    """Where every candidate ran out of memory, the error says what the GPU held when their steps began, read from the
    cached failures: the figure that tells a budget too small for the activations (little allocated at the start) from
    memory the steps did not make (most of the budget gone before any activation), as each row's reason says too."""
    model, inputs = WAN.fresh(), _inputs()
    family = family_for(model)
    key = cost_cache.key_of(Request(model, inputs, None, None, family), auto_planner.CANDIDATES)
    began = {label: 9.8 + 0.1 * i for i, (label, _) in enumerate(auto_planner.CANDIDATES)}
    results = {label: cost_cache.oom_while_measuring(f"CUDA out of memory. Tried to allocate 640.00 MiB (at gradseam/"
                                                     f"run/seams.py:92 direct; {began[label]:.2f} GiB allocated when its "
                                                     "step began)", 12.0)
               for label, _ in auto_planner.CANDIDATES}
    cost_cache.save(key, cost_cache.Table(auto_planner.CANDIDATES, results, STATIC, "depth 5, from a table"))
    with pytest.raises(NoFitError) as caught:
        auto_planner.plan(Request(model, inputs, 12.0, 64.0, family))
    low, high = min(began.values()), max(began.values())
    assert (f"no strategy could be measured within 12.00 GiB of GPU memory (every candidate ran out of memory or was "
            f"unsupported). When their steps began, {low:.2f} to {high:.2f} GiB of it was allocated already") \
        in str(caught.value), str(caught.value)
    torch_row = next(t for t in caught.value.advice.trials if t.label == "torch")
    assert torch_row.reason == f"out of memory while measuring ({began['torch']:.2f} GiB allocated when its step began)"


def test_streaming_is_left_out_where_no_checkpointing_fits_and_where_streamed_rows_cannot_be_measured(monkeypatch):
    monkeypatch.setattr(auto_planner, "streamable_gib", lambda request: [BLOCK_GIB] * UNITS)
    model, inputs = _frozen_blocks(), _inputs()
    _write_table(model, inputs, static=STATIC + UNITS * BLOCK_GIB)
    request = Request(model, inputs, 8.4, 64.0, family_for(model))
    # on the CPU with no way to measure: the streamed rows are not measured, and nothing resident fits
    with pytest.raises(NoFitError, match=r"nothing fits in 8.40 GiB of GPU memory") as caught:
        auto_planner.plan(request)
    assert any("stream" in t.label and "not measured" in (t.reason or "") for t in caught.value.advice.trials)
    # a generous budget: whatever is fastest fits resident, so nothing streamed is measured
    calls: list = []
    roomy = Request(model, inputs, 64.0, 64.0, family_for(model))
    planned = auto_planner.plan(roomy, measure_on=_streaming_measure_on(calls))
    assert not calls and planned.config.stream_weights is None and not planned.config.gradient_checkpointing_blocks
    assert planned.config.keep_attention  # the fastest candidate, on every block


def test_a_later_step_larger_than_the_planned_one_is_warned_about_once_naming_the_input():
    """Aspect-ratio buckets: the plan fits the first step's shapes; a larger bucket later may not fit it."""
    model, inputs = WAN.fresh(), _inputs()
    _write_table(model, inputs)
    with cpu_test_mode():
        handle = gradseam.patch(model, {**AUTO, "gradient_checkpointing_gpu_memory": 40})
        _step(model, inputs)
        assert handle.auto.planned is not None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _step(model, _inputs(2))  # the same shapes
            with torch.no_grad():  # an evaluation forward at any size plans and warns nothing
                model(**WAN.inputs(torch.Generator().manual_seed(3), side=8))
        with pytest.warns(gradseam.errors.GradseamWarning, match=r"planned WanTransformer3DModel for its first training "
                          r"step, where hidden_states held 128 elements; this step's holds 512 \(4.00x\).*Make the "
                          r"first batch the largest bucket"):
            got = _step(model, WAN.inputs(torch.Generator().manual_seed(3), side=8))
    assert_same_step(_step(WAN.fresh(), WAN.inputs(torch.Generator().manual_seed(3), side=8)), got)


@pytest.mark.parametrize("share, resident", [(0.99, True), (0.6, False)])
def test_a_model_larger_than_its_gpu_budget_streams_from_patch_time_and_auto_plans_which_blocks_stay_resident(
        monkeypatch, share, resident):
    """"auto" plans on the GPU at the first step, but a model built on the CPU whose weights are more than the GPU
    budget would run out of memory moving there. So every block's frozen weights stay in host memory from patch
    time (the move leaves them behind). The first step measures the candidates as for any model: a resident one
    with the blocks of the cut model lent to the device before its step (the provisional stream steps aside), a
    streamed one from the set-aside stream's own host copies, allocating none; the plan's run on the whole model
    the same way. The plan keeps as many blocks resident as the budget holds (under 99% of the weights, one; under
    60%, none): the new stream takes over the host copies of the blocks it streams, and only the others go back to the
    device. Exact, like the config it prints."""
    from gradseam.offload.weights import WeightStream
    from gradseam.tools import plan_check

    monkeypatch.setattr(plan_check, "SLOWER", float("inf"))  # CPU timings: a plan is never re-planned for its time
    allocated: list[int] = []
    allocate = WeightStream._allocate
    monkeypatch.setattr(WeightStream, "_allocate", lambda self, n: (allocated.append(n), allocate(self, n))[1])
    lent: list[int] = []
    lend = WeightStream.lent
    monkeypatch.setattr(WeightStream, "lent", lambda self, modules: _counting(lend(self, modules), lent))
    model = _frozen_blocks()
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    runs: list = []
    previous = use_planner(functools.partial(auto_planner.plan, measure_on=_timed_by_copies(_cpu_measure_on),
                                             check_on=_cpu_check_on(runs)))
    try:
        with cpu_test_mode():
            roomy = gradseam.patch(_frozen_blocks(), {**AUTO, "gradient_checkpointing_gpu_memory": 2 * weights})
            assert roomy.weights is None  # it fits: nothing streams until planned
            roomy.remove()
            handle = gradseam.patch(model, {**AUTO, "gradient_checkpointing_gpu_memory": share * weights,
                                            "gradient_checkpointing_host_memory": 8})
            stream = handle.weights
            assert stream is not None and len(stream.blocks) == UNITS and handle.auto.planned is None
            assert "every block's frozen weights stay in host memory until then" in str(handle.summary())
            hosts = {id(block.module): [e.host for e in block.tensors] for block in stream.blocks}
            at_patch = len(allocated)
            got = _step(model, _inputs())
            assert len(runs) == 1 and handle.auto.planned.measured is not None  # the plan ran on the whole model
            assert len(allocated) == at_patch, "measuring or the hand-over made host copies of their own"
            assert sum(lent) > 0, "no resident candidate found its blocks lent to the device"
            config = handle.auto.config
            now = handle.weights
            assert now is not None and 0 < len(now.blocks) <= UNITS, config.to_dict()
            if now is not stream:  # handed over: the old stream, unhooked inside this forward's pre-hooks, did nothing
                assert stream.loads == 0 and not any(b.loaded for b in stream.blocks), \
                    "the replaced stream loaded a block (on a GPU, a copy nothing waits for)"
            # 99%: room for one block (and the optimizer's moments, twice the stand-in LoRA) beside the rest; 60%: none
            assert (len(now.blocks) < UNITS) == resident, config.to_dict()
            for block in now.blocks:  # the blocks still streamed run from the host copies made at patch time
                assert [e.host for e in block.tensors] == hosts[id(block.module)]
            streamed = {id(block.module) for block in now.blocks}
            for block in model.blocks:  # the others are back where the model keeps its weights, out of host memory
                if id(block) not in streamed:
                    assert all(p.data_ptr() not in {h.data_ptr() for h in hosts[id(block)]}
                               for p in block.parameters())
            assert "larger than the GPU budget, every block's frozen weights" in handle.auto.planned.report
            again = _step(model, _inputs())
            explicit = _frozen_blocks()
            with gradseam.patch(explicit, config.given_keys()) as replayed:
                expected = _step(explicit, _inputs())
                assert len(replayed.weights.blocks) == len(now.blocks)
    finally:
        use_planner(previous)
    _assert_trains_like_unpatched_and_its_config(got, again, expected, "auto, streamed from patch time")


def _timed_by_copies(measure_on):
    """``measure_on`` with each candidate's step time set by what it streams (10 ms a unit, 5 more where its weights
    stream), not by the CPU's timing: which plan is fastest must not depend on the machine's noise."""
    from dataclasses import replace

    def on(request: Request):
        run, note, static = measure_on(request)

        def measure(config):
            got = run(config)
            streamed = config.get(auto_planner.STREAM_KEY)
            share = 1.0 if streamed == "all" else (streamed or 0) / UNITS
            per_unit = 10.0 + 5.0 * share
            units = replace(got.unit_costs, step_ms=per_unit, step_fixed_ms=0.0)
            return replace(got, step_ms=per_unit * units.units, unit_costs=units)

        return measure, note, static

    return on


class _counting:
    """A context manager that records how many blocks the one it wraps yields (lent)."""

    def __init__(self, inner, into: list[int]) -> None:
        self.inner, self.into = inner, into

    def __enter__(self):
        got = self.inner.__enter__()
        self.into.append(len(got))
        return got

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


def _no_room_beside_resident_weights(measure_on, tried: list[bool]):
    """``measure_on`` on a GPU with no room beside the model's resident weights: every candidate runs out of memory
    unless a patch set aside holds the blocks' weights in host memory (what :func:`gradseam.handle.lending` lends the
    cut model's blocks from). ``tried`` records, for each candidate, whether they were there."""
    from gradseam.handle import _set_aside_stream

    def on(request: Request):
        run, note, static = measure_on(request)

        def measure(config):
            in_host_memory = _set_aside_stream(request.model, None) is not None
            tried.append(in_host_memory)
            if not in_host_memory:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.90 GiB (a stand-in)")
            return run(config)

        return measure, note, static

    return on


def test_a_model_with_no_room_beside_its_weights_to_measure_is_planned_with_them_in_host_memory(_cache, monkeypatch,
                                                                                              capsys):
    """A model that fits its GPU budget, whose every candidate runs out of memory beside its weights even cut to a
    block or two (HunyuanVideo 1.5 at 480p x 121 frames under 24 GiB: 15.6 GiB of weights), would end in "no strategy
    could be measured". Instead its blocks' frozen weights go to host memory at the first step, the rows that ran out
    of memory leave the cost table, and it is planned as a model larger than its GPU: each candidate measured with
    the cut model's blocks lent to the device. The plan keeps resident what the budget holds (here everything: the
    weights fit), trains exactly like the config it prints, and the next model of the same shapes reads the table:
    nothing measured, nothing runs out of memory, no block's weights leave the device."""
    from gradseam.offload.weights import WeightStream
    from gradseam.tools import plan_check

    monkeypatch.setattr(plan_check, "SLOWER", float("inf"))  # CPU timings: a plan is never re-planned for its time
    lent: list[int] = []
    lend = WeightStream.lent
    monkeypatch.setattr(WeightStream, "lent", lambda self, modules: _counting(lend(self, modules), lent))
    tried: list[bool] = []
    runs: list = []
    previous = use_planner(functools.partial(
        auto_planner.plan, measure_on=_no_room_beside_resident_weights(_timed_by_copies(_cpu_measure_on), tried),
        check_on=_cpu_check_on(runs)))
    model = _frozen_blocks()
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    keys = {**AUTO, "gradient_checkpointing_gpu_memory": 2 * weights, "gradient_checkpointing_host_memory": 8}
    try:
        with cpu_test_mode():
            handle = gradseam.patch(model, keys)
            assert handle.weights is None, "it fits its budget: nothing streams before it is planned"
            got = _step(model, _inputs())
            err = capsys.readouterr().err
            resident_tries = tried.index(True)
            assert resident_tries == len(auto_planner.CANDIDATES) and all(tried[resident_tries:]), tried
            assert re.search(rf"every candidate measured \({resident_tries}\) ran out of memory beside the model's "
                             r"[0-9.]+ GiB of weights and inputs; every block's frozen weights go to host memory", err)
            assert sum(lent) > 0, "no candidate found its blocks lent to the device"
            planned = handle.auto.planned
            assert planned.source == "measured" and len(runs) == 1 and planned.measured is not None
            assert "nothing could be measured beside the model's weights on the GPU, so every block's frozen weights" \
                in planned.report
            config = handle.auto.config
            assert handle.weights is None, f"the budget holds every block, and the plan streamed some: {config}"
            table = cost_cache.load(cost_cache.key_of(Request(model, _inputs(), None, None, family_for(model)),
                                                      auto_planner.CANDIDATES))
            assert table is not None and table.complete
            assert not any(isinstance(r, str) and r.startswith("OOM") for r in table.results.values()), table.results
            again = _step(model, _inputs())
            tried.clear()
            second = _frozen_blocks()
            with gradseam.patch(second, keys) as cached:
                _step(second, _inputs())
                assert cached.auto.planned.source == "cached" and cached.auto.config == config
                assert cached.weights is None and not tried
            assert "measuring" not in capsys.readouterr().err
            explicit = _frozen_blocks()
            with gradseam.patch(explicit, config.given_keys()):
                expected = _step(explicit, _inputs())
    finally:
        use_planner(previous)
    _assert_trains_like_unpatched_and_its_config(got, again, expected, "auto, its weights in host memory to measure")


def _assert_trains_like_unpatched_and_its_config(got: Step, again: Step, expected: Step, what: str) -> None:
    """``got`` and ``again`` (the first two steps of ``what``) equal the unpatched frozen model's step, and ``got`` that
    of the explicit config it printed (``expected``)."""
    want = _step(_frozen_blocks(), _inputs())
    assert_same_step(want, got, what=f"{what}, vs unpatched")
    assert_same_step(want, again, what="its second step")
    assert_same_step(expected, got, what="auto vs the config it printed")


def test_a_model_with_no_room_beside_its_weights_even_streamed_gets_its_weights_back_with_the_error(_cache):
    """Where nothing can be measured with the weights in host memory either, the planner's error stands, and the
    model is left as the step found it: unplanned, every weight back where it was."""
    class Everywhere(list):
        def append(self, item):  # a stand-in GPU with no room at all: out of memory with the weights in host memory too
            super().append(item)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.90 GiB (a stand-in)")

    tried = Everywhere()
    previous = use_planner(functools.partial(
        auto_planner.plan, measure_on=_no_room_beside_resident_weights(_cpu_measure_on, tried)))
    model = _frozen_blocks()
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    try:
        with cpu_test_mode():
            handle = gradseam.patch(model, {**AUTO, "gradient_checkpointing_gpu_memory": 40})
            with pytest.raises(NoFitError, match="no strategy could be measured"):
                _step(model, _inputs())
            assert True in tried and False in tried, "not measured both ways"
            assert handle.auto.planned is None and handle.weights is None and not handle.regions()
            for name, p in model.named_parameters():  # the same parameters, their values where the model keeps them
                kept, value = before[name]
                assert p is kept and p.device == value.device and torch.equal(p, value), name
            handle.remove()
    finally:
        use_planner(previous)
    assert_same_step(_step(_frozen_blocks(), _inputs()), _step(model, _inputs()), what="after remove(), vs unpatched")


def _refusing_to_stream(real_plan):
    """``real_plan`` (gradseam's planning, where a module imported it), refusing to stream every block's weights
    as it refuses quantized ones."""
    from gradseam.auto import UNPLANNED_STREAMED

    def refusing(model, family, config):
        if config is UNPLANNED_STREAMED:
            raise UnsupportedStrategyError("quantized weights cannot stream (a stand-in refusal)")
        return real_plan(model, family, config)

    return refusing


def test_a_model_with_no_room_beside_its_weights_that_cannot_stream_says_both(_cache, monkeypatch):
    """Where the blocks' weights cannot go to host memory (quantized, say), the planner's finding stands, with the
    refusal: nothing could be measured beside the weights, and why they cannot make room."""
    import gradseam.handle

    monkeypatch.setattr(gradseam.handle, "plan", _refusing_to_stream(gradseam.handle.plan))
    tried: list[bool] = []
    previous = use_planner(functools.partial(
        auto_planner.plan, measure_on=_no_room_beside_resident_weights(_cpu_measure_on, tried)))
    model = _frozen_blocks()
    try:
        with cpu_test_mode():
            handle = gradseam.patch(model, {**AUTO, "gradient_checkpointing_gpu_memory": 40})
            with pytest.raises(GradseamError, match=r"no candidate could be measured beside WanTransformer3DModel's "
                               r"[0-9.]+ GiB of weights and inputs: every one ran out of memory \(\d+ measured, for "
                               r"depth 5.*\)\. Its blocks' weights cannot stream from host memory to make room: "
                               r"quantized weights cannot stream \(a stand-in refusal\)"):
                _step(model, _inputs())
            assert handle.auto.planned is None and handle.weights is None and not any(tried)
            handle.remove()
    finally:
        use_planner(previous)
    assert_same_step(_step(_frozen_blocks(), _inputs()), _step(model, _inputs()), what="after remove(), vs unpatched")


def test_where_streaming_refuses_a_model_larger_than_its_budget_it_runs_unplanned_with_a_warning(monkeypatch):
    """Quantized weights do not stream, say: "auto" then cannot hold the model in host memory until planned, and
    says so at patch time (it must fit the GPU first), instead of failing on a key the user never set."""
    import gradseam.patcher

    monkeypatch.setattr(gradseam.patcher, "plan", _refusing_to_stream(gradseam.patcher.plan))
    model = _frozen_blocks()
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    with cpu_test_mode(), pytest.warns(gradseam.errors.GradseamWarning, match=r"WanTransformer3DModel's weights are "
                                       r"more than the GPU budget.*cannot stream \(quantized weights cannot stream "
                                       r"\(a stand-in refusal\)\).*must fit there first"):
        handle = gradseam.patch(model, {**AUTO, "gradient_checkpointing_gpu_memory": weights / 2})
    assert handle.weights is None and handle.auto is not None and not handle.regions()
    handle.remove()


def test_a_run_stopped_while_measuring_resumes_from_the_candidates_it_measured(_cache, capsys):
    """Measuring a large model takes minutes; the table is saved after each candidate, marked incomplete, and the
    next run measures only what is missing (the rows measured before are kept as they were), then plans."""
    calls: list[str] = []

    def stopping_after(n: int | None):
        def measure_on(request: Request):
            run, note, static = _cpu_measure_on(request)

            def measure(config):
                if n is not None and len(calls) == n:
                    raise KeyboardInterrupt  # the user's Ctrl-C, a preemption
                calls.append(json.dumps(config, sort_keys=True))
                return run(config)

            return measure, note, static
        return measure_on

    inputs = _inputs()
    model = WAN.fresh()
    request = Request(model, inputs, 40.0, 8.0, family_for(model))
    key = cost_cache.key_of(request, auto_planner.CANDIDATES)
    with cpu_test_mode():
        with pytest.raises(KeyboardInterrupt):
            auto_planner.plan(request, measure_on=stopping_after(11))
        partial = cost_cache.load(key)
        assert partial is not None and not partial.complete and len(partial.results) == 11
        assert [label for label, _ in partial.missing()] == [label for label, _ in auto_planner.CANDIDATES[11:]]
        before = dict(partial.results)
        calls.clear()
        planned = auto_planner.plan(request, measure_on=stopping_after(None))
    total = len(auto_planner.CANDIDATES)
    assert f"resuming: 11 of {total} candidates are cached; measuring the other {total - 11}" in capsys.readouterr().err
    assert calls == [json.dumps(c, sort_keys=True) for _, c in auto_planner.CANDIDATES[11:]]
    table = cost_cache.load(key)
    assert table.complete and not table.missing() and planned.source == "measured"
    assert {label: table.results[label] for label in before} == before, "a row measured before was measured again"


def test_streamed_rows_a_budget_asks_for_are_saved_one_by_one(_cache, monkeypatch):
    """The rows with streamed weights are measured only when a budget asks for them, at the first step; each is in
    the cache before the next one starts, so a run ended without unwinding (a time limit's SIGTERM: Python runs no
    ``finally``; on an H100, Flux's compiled rows with 31 blocks streamed took 68 s each, and a bench under
    ``timeout`` lost every one) keeps what it measured, and the next run measures only the rest."""
    monkeypatch.setattr(auto_planner, "streamable_gib", lambda request: [BLOCK_GIB] * UNITS)
    model, inputs = _frozen_blocks(), _inputs()
    _write_table(model, inputs, static=STATIC + UNITS * BLOCK_GIB)
    request = Request(model, inputs, 8.4, 64.0, family_for(model))
    key = cost_cache.key_of(request, auto_planner.CANDIDATES)
    calls: list = []
    measure_on = _streaming_measure_on(calls)
    on_disk: list[set[str]] = []

    def stopping_at_the_second(request):
        run, note, static = measure_on(request)

        def measure(config):
            if calls:  # the second row: what is on disk now is what a killed run would leave
                on_disk.append({json.dumps(c, sort_keys=True) for _, c in cost_cache.load(key).candidates})
                raise KeyboardInterrupt
            return run(config)

        return measure, note, static

    with pytest.raises(KeyboardInterrupt):
        auto_planner.plan(request, measure_on=stopping_at_the_second)
    first = json.dumps(calls[0], sort_keys=True)
    assert len(calls) == 1 and on_disk and first in on_disk[0], "the first streamed row was not saved before the next"
    calls.clear()
    auto_planner.plan(request, measure_on=measure_on)
    assert calls and first not in [json.dumps(c, sort_keys=True) for c in calls], "a saved row was measured again"


def test_a_streamed_unit_is_predicted_to_take_at_least_the_time_the_same_candidate_takes_resident():
    """Streaming runs the same kernels and waits for copies besides. Measured on an H100 (Flux dev 4k, depths 2 and
    4, 19 units), ``torch-ffn + attention offload + stream 41`` ran its deeper step faster than its shallower one:
    -11.4 ms a unit, 36.5 ms predicted for the whole model where the same candidate resident takes 767.6. The
    prediction takes the resident time per unit instead, its own fixed part kept; the memory, already above the
    resident's (the ``-ffn`` backends keep attention's weights), stays as measured."""
    from gradseam.tools.advise import Estimate, UnitCosts, at_least_resident

    resident = Estimate(767.61, 767.61, 11.07, 0.1908, "predicted at depth 19",
                        UnitCosts(19, 40.9487, -10.4113, 0.1908, 0.6746, 0.5830, -0.0059))
    streamed = Estimate(11.88, 36.49, 10.56, 0.6007, "predicted at depth 19",
                        UnitCosts(19, -11.3871, 252.8466, 0.6007, 0.4680, 0.5557, -0.0020))
    got = at_least_resident(streamed, resident.unit_costs)
    assert got.unit_costs.step_ms == resident.unit_costs.step_ms
    assert got.step_ms == pytest.approx(252.8466 + 19 * 40.9487, abs=0.01)  # 1,030.9 ms: slower than resident
    assert got.step_ms > resident.step_ms
    assert (got.peak_gib, got.growth_gib, got.unit_costs.peak_gib) == (11.88, 0.6007, 0.6007)  # memory as measured
    assert at_least_resident(got, resident.unit_costs) is got


def test_a_streamed_unit_is_predicted_to_hold_at_least_what_the_same_candidate_holds_resident():
    """Streaming moves weights, not activations. Measured on an H100 (this session's cost tables, Flux dev 4k,
    19 units), ``compile + stream all`` fitted 0.089 GiB a unit against ``compile``'s 0.177, and its plan ran at a
    4.67 GiB activation peak where 3.15 was predicted (-33%): the planner (advise's, which ``auto`` shares) now
    predicts 4.83 (+3.4%, on the safe side). A streamed line above the resident one (the ``-ffn`` backends keep
    attention's weight copies for their backward) stays as measured."""
    from gradseam.tools.advise import Estimate, UnitCosts, at_least_resident

    resident = Estimate(4.1993, 481.31, 0.0, 0.1772, "predicted at depth 19",
                        UnitCosts(19, 25.329, 0.059, 0.1772, 0.8334, 0.0, 0.0))
    streamed = Estimate(3.1516, 892.35, 0.0, 0.0889, "predicted at depth 19",
                        UnitCosts(19, 46.613, 6.709, 0.0889, 1.4632, 0.0, 0.0))
    got = at_least_resident(streamed, resident.unit_costs)
    assert got.unit_costs.peak_gib == resident.unit_costs.peak_gib and got.growth_gib == resident.growth_gib
    assert got.peak_gib == pytest.approx(1.4632 + 19 * 0.1772, abs=1e-3)  # its own depth-zero peak, the resident growth
    assert abs(got.peak_gib - 4.672) / 4.672 < 0.035  # what the whole model measured
    assert (got.step_ms, got.unit_costs.step_ms, got.pinned_gib) == (streamed.step_ms, 46.613, 0.0)  # time untouched
    assert at_least_resident(got, streamed.unit_costs) is got  # already above: as measured
    assert at_least_resident(streamed, None) is streamed  # nothing resident to go by (it ran out of memory)
    # and the planner reads it so: the streamed row it predicts from a table holds the resident growth
    model = _frozen_blocks()
    table = cost_cache.Table([("compile", {"gradient_checkpointing": True, "gradient_checkpointing_backend": "compile"}),
                              ("compile + stream all", {"gradient_checkpointing": True,
                                                        "gradient_checkpointing_backend": "compile",
                                                        auto_planner.STREAM_KEY: "all"})],
                             {"compile": resident, "compile + stream all": streamed}, 0.3, "depth 19")
    advice = auto_planner.choose(table, 16.0, 22.5, 64.0, model, block_gib=[22.2 / UNITS] * UNITS,
                                 candidates=table.candidates[:1])  # the streamed row as advise asks for it
    trial = next(t for t in advice.trials if t.label == "compile + stream all")
    assert trial.peak_gib == pytest.approx(got.peak_gib, abs=1e-3)  # (advise rounds its figures)


def test_a_candidate_out_of_memory_while_measuring_is_cached_with_where_it_ran_out():
    """The cost table keeps each failure's reason; an out-of-memory one also says where it was raised (gradseam's
    deepest frame and the innermost), so a table from a GPU run names the code that allocated."""
    from gradseam.testing import run_step

    model = WAN.fresh()
    model.blocks[0].register_forward_pre_hook(_allocate_too_much)

    def measure_on(request: Request):
        return (lambda config: run_step(model, WAN)), "depth 5", 0.0  # a step through gradseam's own code

    rows = auto_planner._Rows(Request(model, _inputs(), 40.0, 8.0, family_for(model)), measure_on)
    got = rows.one("torch", {"gradient_checkpointing": True})
    assert got.startswith("OOM while measuring: CUDA out of memory. Tried to allocate 50.00 MiB (at gradseam/testing/")
    assert "run_step; innermost tests/test_auto.py:" in got and "_allocate_too_much" in got, got


def test_a_candidate_out_of_memory_while_measured_on_a_gpu_says_what_was_allocated_when_its_step_began(monkeypatch):
    """An out-of-memory error names what was allocated when it failed; the cached failure also says what was allocated
    when the measured step began, which tells memory the step found (weights left on the GPU, an earlier row's) from
    memory it made: on an H100 every candidate for Wan 2.1 14B under 12 GiB failed with 11.3 to 11.9 GiB allocated,
    streamed ones included, where the same streamed row alone had peaked at 9.6 GiB. Read by the measuring protocol
    itself (:func:`gradseam.tools.measure.measure`), before its first step: here a GPU that holds 9.87 GiB."""
    from gradseam.testing import run_step

    # built before CUDA is faked: the model's first build imports diffusers' PEFT loader, which imports
    # bitsandbytes, whose CUDA backend then reaches for CUDA functions a CPU build of torch lacks (the test failed
    # so when run alone or first on its worker)
    model = WAN.fresh()
    model.blocks[0].register_forward_pre_hook(_allocate_too_much)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: int(9.87 * 2**30))

    def measure_on(request: Request):
        # the step raises in its warm-up, before the protocol synchronizes a device this CPU does not have
        return (lambda config: measuring.measure(lambda: run_step(model, WAN), device="cuda")), "depth 5", 0.0

    rows = auto_planner._Rows(Request(model, _inputs(), 40.0, 8.0, family_for(model)), measure_on)
    got = rows.one("torch", {"gradient_checkpointing": True})
    assert got.startswith("OOM while measuring: CUDA out of memory. Tried to allocate 50.00 MiB (at "), got
    assert got.endswith("_allocate_too_much; 9.87 GiB allocated when its step began)"), got
    # a failure from elsewhere than the protocol (no figure) reads as before
    rows = auto_planner._Rows(Request(model, _inputs(), 40.0, 8.0, family_for(model)),
                              lambda request: ((lambda config: run_step(model, WAN)), "depth 5", 0.0))
    assert "allocated when its step began" not in rows.one("torch", {"gradient_checkpointing": True})


@pytest.mark.parametrize("fails", [False, True], ids=["measured", "out-of-memory"])
def test_a_row_that_leaves_gpu_memory_allocated_stops_the_measuring_before_any_later_row_is_cached(monkeypatch, fails):
    """Each row is measured from the memory the first found. One that leaves some of its own allocated (a failed
    step's activations still referenced) would have every later row measured, and run out of memory, beside it, and
    cached so: measuring stops at it, naming the figures, with the rows before it cached and nothing after."""
    model, inputs = WAN.fresh(), _inputs()
    levels = iter([1.0, 1.0, 1.0, 10.0])  # GiB allocated beside the model's state: before and after each row
    monkeypatch.setattr(measuring, "allocated_beside", lambda model: int(next(levels) * 2**30))
    measured: list[str] = []

    def measure_on(request: Request):
        def run(config):
            measured.append(config["gradient_checkpointing_backend"])
            if fails and len(measured) == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 640.00 MiB")
            return _estimate(config["gradient_checkpointing_backend"])
        return run, "depth 5", 0.0

    rows = auto_planner._Rows(Request(model, inputs, 40.0, 8.0, family_for(model)), measure_on)
    candidates = [(label, {"gradient_checkpointing": True, "gradient_checkpointing_backend": label})
                  for label in ("torch", "unsloth", "torch-ffn")]
    saved: list[dict] = []
    with pytest.raises(GradseamError) as raised:
        auto_planner.measure(rows, candidates, save=lambda table: saved.append(dict(table.results)))
    failed = " after it ran out of memory" if fails else ""
    assert (f'"auto": measuring unsloth{failed} left 9.00 GiB allocated on the GPU that was not before it (1.00 GiB '
            "before, 10.00 GiB after its memory was released)") in str(raised.value)
    assert "measuring stops here" in str(raised.value) and "please report it" in str(raised.value)
    assert measured == ["torch", "unsloth"], measured  # torch-ffn never measured beside it
    assert saved and set(saved[-1]) == {"torch"}, saved  # and the row that left it is not cached either


def test_the_state_a_row_may_leave_is_the_models_parameters_buffers_and_gradients_each_storage_once():
    """What :func:`gradseam.tools.measure.state_bytes_on` counts out of the memory a row leaves: the model's own state on the
    device, which parking and lending move between rows and a measured backward adds to (its gradients); a tied
    weight (one storage behind two parameters) once, and nothing on another device."""
    model = WAN.fresh()
    cpu = torch.device("cpu")
    state = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()]}
    assert measuring.state_bytes_on(model, cpu) == sum(state.values())
    model.blocks[1].attn1.to_q.weight = model.blocks[0].attn1.to_q.weight  # tied: one storage, counted once
    tied = measuring.state_bytes_on(model, cpu)
    assert tied == sum(state.values()) - model.blocks[0].attn1.to_q.weight.untyped_storage().nbytes()
    model(**_inputs()).sample.square().mean().backward()
    grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    assert grads > 0 and measuring.state_bytes_on(model, cpu) == tied + grads
    assert measuring.state_bytes_on(model, torch.device("meta")) == 0


def test_a_candidate_out_of_memory_on_a_gpu_is_cached_with_the_memory_it_was_measured_within(monkeypatch):
    """On a GPU the failure also says how much memory the process could use (its per-process fraction of the card),
    which is what the out-of-memory error is relative to: a larger limit measures the row again (below)."""
    monkeypatch.setattr(auto_planner, "gpu_limit_gib", lambda device: 32.0)
    model = WAN.fresh()
    model.blocks[0].register_forward_pre_hook(_allocate_too_much)

    def measure_on(request: Request):
        return (lambda config: model(**_inputs())), "depth 5", 0.0

    rows = auto_planner._Rows(Request(model, _inputs(), 40.0, 8.0, family_for(model)), measure_on)
    got = rows.one("torch", {"gradient_checkpointing": True})
    assert got.startswith("OOM while measuring within 32.00 GiB: CUDA out of memory. Tried to allocate 50.00 MiB"), got
    assert cost_cache.measured_within_gib(got) == 32.0


def test_a_row_out_of_memory_under_a_smaller_limit_is_measured_again_where_the_process_may_use_more(
        _cache, monkeypatch, capsys):
    """One table serves every budget, but an out-of-memory row says only that the row did not fit the memory it was
    measured within: measured under a 32 GiB cap (bench's ``auto @ 32GiB`` on an H100), HunyuanVideo 1.5's eager
    candidates all ran out, and read back on the whole card they would have been ruled out of every plan. A run that
    may use more measures those rows again, and only those; one that may use the same or less reads them as cached."""
    model, inputs = WAN.fresh(), _inputs()
    request = Request(model, inputs, 40.0, 16.0, family_for(model))
    key = cost_cache.key_of(request, auto_planner.CANDIDATES)
    _write_table(model, inputs)
    table = cost_cache.load(key)
    capped = "OOM while measuring within 32.00 GiB: CUDA out of memory. Tried to allocate 4.90 GiB (at x.py:1 f)"
    table.results["unsloth"] = capped
    table.results["torch + attention kept"] = capped.replace("32.00", "79.18")
    table.results["torch"] = "OOM while measuring: CUDA out of memory (a file from before the limit was written)"
    streamed = {**dict(auto_planner.CANDIDATES)["unsloth"], "gradient_checkpointing_stream_weights": "all"}
    table.add("unsloth + stream all", streamed, capped)
    cost_cache.save(key, table)
    measured: list[dict] = []
    measure_on = _recording(measured, "unsloth")

    def plan_within(limit: float):
        monkeypatch.setattr(auto_planner, "gpu_limit_gib", lambda device: limit)
        return auto_planner.plan(request, measure_on=measure_on)

    with pytest.raises(NoFitError):  # the limit it was measured within: read as cached, so nothing fits
        plan_within(32.0)
    assert measured == [] and cost_cache.load(key).results["unsloth"] == capped
    plan_within(79.18)
    assert measured == [dict(auto_planner.CANDIDATES)["unsloth"]], "measured again: only the row the cap ruled out"
    err = capsys.readouterr().err
    assert "cached rows that ran out of memory within less GPU memory than this process may use (79.18 GiB) are " \
           "measured again (a streamed one where a budget asks for it): unsloth, unsloth + stream all" in err, err
    again = cost_cache.load(key)
    assert again.complete and again.results["unsloth"] == _estimate("unsloth")
    assert again.results["torch + attention kept"] == capped.replace("32.00", "79.18")
    assert again.results["torch"].startswith("OOM while measuring: "), "a row without its limit was dropped"
    # the streamed row a budget had asked for left the table: measured again only where a budget asks for it
    assert again.lookup(streamed) is None
    # a table whose only outgrown row is a streamed one is complete, and says so before planning
    again.add("unsloth + stream all", streamed, capped)
    cost_cache.save(key, again)
    plan_within(79.18)
    assert measured == [dict(auto_planner.CANDIDATES)["unsloth"]], "a ladder row was measured again"
    assert "are measured again (a streamed one where a budget asks for it): unsloth + stream all" \
        in capsys.readouterr().err


def _allocate_too_much(module, args):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 50.00 MiB")


def _cpu_check_on(runs: list):
    """advise's whole-model run on the CPU (saved bytes for the peak), counting its runs."""
    from gradseam.tools.advise import full_depth_check

    def check_on(request: Request):
        check = full_depth_check(request.model, request.inputs, family=request.family, device="cpu")

        def run(config):
            runs.append(dict(config))
            return check(config)

        return run

    return check_on


def test_the_plan_is_run_on_the_whole_model_before_the_first_step_which_trains_exactly_like_its_config(_cache, capsys,
                                                                                                      monkeypatch):
    """The first step's forward measures the candidates, runs the plan once on the whole model (advise's
    full-depth run, on the CPU here), and only then runs; nothing of those runs reaches the step, and a restart
    reads what the plan took from the cache instead of running it again."""
    from gradseam.tools import plan_check

    monkeypatch.setattr(plan_check, "SLOWER", float("inf"))  # CPU timings: a plan is never re-planned for its time
    runs: list = []
    previous = use_planner(functools.partial(auto_planner.plan, measure_on=_cpu_measure_on,
                                             check_on=_cpu_check_on(runs)))
    try:
        with cpu_test_mode():
            model = WAN.fresh()
            handle = gradseam.patch(model, {**AUTO, "gradient_checkpointing_gpu_memory": 40})
            torch.manual_seed(3)
            got = _step(model, _inputs())
            planned = handle.auto.planned
            assert len(runs) == 1 and CheckpointConfig.from_dict(runs[0]) == planned.config
            assert planned.measured is not None and planned.measured["step_ms"] > 0
            assert "checked on the whole model before the first step: " in planned.report
            err = capsys.readouterr().err
            assert "running the plan on the whole model before its first step" in err
            assert re.search(r"the plan ran in \d+\.\d s", err)
            explicit = WAN.fresh()
            with gradseam.patch(explicit, planned.config.given_keys()):
                torch.manual_seed(3)
                expected = _step(explicit, _inputs())
            assert_same_step(expected, got, what="auto (its plan run on the whole model first) vs its config")
            table = json.loads(next(_cache.glob("costs/*.json")).read_text())
            assert [json.loads(item["id"]) for item in table["checked"]] == runs
            again = WAN.fresh()
            with gradseam.patch(again, {**AUTO, "gradient_checkpointing_gpu_memory": 40}) as second:
                _step(again, _inputs())
                assert second.auto.config == planned.config and second.auto.planned.measured == planned.measured
            assert len(runs) == 1, "a restart ran the plan again"
    finally:
        use_planner(previous)


def test_the_plans_whole_model_run_gives_its_allocator_retries_with_its_measured_figures(_cache):
    """``handle.auto.planned.measured`` holds what the plan's run took, its allocator retries too (GPU runs count them;
    a fake run here answers as HunyuanVideo 1.5's plan did under a 32 GiB cap on an H100)."""
    model, inputs = WAN.fresh(), _inputs()
    request = Request(model, inputs, 40.0, 16.0, family_for(model))
    runs: list[dict] = []

    def check_on(request):
        def run(config):
            runs.append(dict(config))
            return Estimate(1.5, 20.0, 0.5, None, "measured at depth 5", alloc_retries=113)
        return run

    with cpu_test_mode():
        planned = auto_planner.plan(request, measure_on=_cpu_measure_on, check_on=check_on)
    assert len(runs) == 1 and planned.measured["alloc_retries"] == 113, planned.measured
    assert "113 allocator retries in its step" in planned.report


def test_after_an_out_of_memory_run_what_its_step_held_is_released_once_the_error_is_gone(monkeypatch):
    """The measuring call releases memory while the error's traceback still holds the failed step's tensors (the
    Wan 14B fault's ~20 GiB of activations); the rows release again once the error is dropped, for a candidate and
    for the plan's whole-model run alike, so the next run starts with that memory back."""
    import weakref

    from gradseam.tools import measure as measuring

    held: list = []
    freed_at_release: list[bool] = []
    monkeypatch.setattr(measuring, "release", lambda device="cuda": freed_at_release.append(held[-1]() is None))

    def failing(config):
        activations = torch.empty(1024)  # what a failed step's frames hold while its error is alive
        held.append(weakref.ref(activations))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 50.00 MiB")

    model = WAN.fresh()
    rows = auto_planner._Rows(Request(model, _inputs(), 40.0, 8.0, family_for(model)),
                              lambda request: (failing, "depth 5", 0.0))
    assert rows.one("torch", {"gradient_checkpointing": True}).startswith("OOM while measuring")
    assert rows.checker(lambda request: failing, lambda config: 0.0)({"gradient_checkpointing": True}).startswith("OOM on the whole model")
    assert freed_at_release == [True, True]


def test_the_plan_check_reads_the_streamed_weights_in_host_memory_not_on_the_gpu():
    """A plan's whole-model run reports its peak above what its step began with (which lacks the weights the plan
    streams) and its activations' pinned pool: the check counts the streamed weights in host memory, as the host
    budget does, and out of the GPU peak measured against the static memory that holds them all. Read alone, Flux
    dev 4k's mix under 12 GiB on an H100 showed 3.27 GiB pinned against 15.64 predicted."""
    model = WAN.fresh()
    rows = auto_planner._Rows(Request(model, _inputs(), 40.0, 8.0, family_for(model)),
                              lambda request: (None, "depth 5", 0.0))
    got = rows.checker(lambda request: lambda config: Estimate(5.0, 100.0, 1.0), lambda config: 3.0)(
        {"gradient_checkpointing": True, auto_planner.STREAM_KEY: "all"})
    assert (got.peak_gib, got.pinned_gib, got.step_ms) == (2.0, 4.0, 100.0)


def test_a_streamed_block_that_keeps_no_weight_on_the_gpu_is_predicted_to_hold_the_resident_peak_and_what_is_in_flight():
    """Flux dev 4k on an H100 (this session's cost table, depths 2 and 4): ``unsloth-compile + stream 32`` streams
    3 of the 6 blocks at depth 2 (a double and a single in flight at most: 0.90 GiB) and 7 of 12 at depth 4 (two
    doubles: 1.27 GiB); the fit read the difference as 0.184 GiB a unit and predicted 4.79 GiB of activations at 19
    units, where ``+ stream 35`` measured 2.03 on the whole model. Capped at the resident 0.78 and the 1.27 in
    flight: 2.05. Only where nothing a block keeps for its backward can be a weight on the GPU (the backend's kind
    says): not ``compile`` or the ``-ffn`` backends, whose measured lines stand."""
    from gradseam.tools.advise import (
        Trial,
        UnitCosts,
        at_most_resident_and_in_flight,
        in_flight_gib,
        keeps_no_weight_on_the_gpu,
    )

    double, single = 0.6328, 0.2637
    block_gib = [double] * 19 + [single] * 38
    config = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-compile",
              auto_planner.STREAM_KEY: 32}
    assert in_flight_gib(block_gib, config) == pytest.approx(2 * double)
    assert in_flight_gib(block_gib, {**config, "gradient_checkpointing_stream_prefetch": 0}) == pytest.approx(double)
    assert in_flight_gib(block_gib, {"gradient_checkpointing": True}) == 0.0
    resident = Trial("unsloth-compile", {}, peak_gib=0.784, unit_costs=UnitCosts(19, 26.379, 3.83, 0.0006, 0.7725,
                                                                                 0.1895, 0.1973))
    streamed = Estimate(4.793, 667.4, 3.56, 0.1843, "predicted at depth 19",
                        UnitCosts(19, 35.069, 1.091, 0.1843, 1.2914, 0.1758, 0.2246))
    got = at_most_resident_and_in_flight(streamed, resident, in_flight_gib(block_gib, config))
    assert got.peak_gib == pytest.approx(0.784 + 2 * double) and abs(got.peak_gib - 2.03) / 2.03 < 0.02
    units = got.unit_costs
    assert units.peak_gib == 0.0006 and units.peak_fixed_gib + 19 * units.peak_gib == pytest.approx(got.peak_gib)
    assert (got.step_ms, units.step_ms, got.pinned_gib) == (667.4, 35.069, 3.56)  # time and host untouched
    low = Estimate(1.5, 600.0, 0.0, 0.0, "", UnitCosts(19, 30.0, 0.0, 0.0, 1.5, 0.0, 0.0))
    assert at_most_resident_and_in_flight(low, resident, 2 * double) is low  # under the cap: as measured
    for kept in ({"gradient_checkpointing_backend": "unsloth-compile"}, {"gradient_checkpointing_backend": "unsloth"},
                 {}, {"gradient_checkpointing_offload_attention": True}, {"gradient_checkpointing_keep_attention": True}):
        assert keeps_no_weight_on_the_gpu({"gradient_checkpointing": True, **kept}), kept
    for kept in ({"gradient_checkpointing_backend": "compile"}, {"gradient_checkpointing_backend": "torch-ffn"},
                 {"gradient_checkpointing_backend": "unsloth-ffn"}):
        assert not keeps_no_weight_on_the_gpu({"gradient_checkpointing": True, **kept}), kept
    assert not keeps_no_weight_on_the_gpu({"gradient_checkpointing": False})


def test_under_12_gib_flux_is_planned_as_the_uniform_streamed_row_the_cap_lets_fit(even_spread):
    """The H100 run's costs (Flux dev 4k, 19 units, every candidate resident and streamed, as ``auto`` measured them
    for 16 and 12 GiB), replayed under that run's budget (12 GiB, 22.29 GiB of static memory): with the two-depth
    fits of the streamed ``unsloth-compile`` rows capped, ``unsloth-compile + stream 32`` fits and is chosen,
    predicted at 667 ms; the run itself, without the cap, chose a mix predicted at 742 ms that took 770 ms, where the
    hand-chosen ``unsloth-compile + stream 35`` took 709 ms (another call, another H100)."""
    import json
    from pathlib import Path

    from diffusers import FluxTransformer2DModel

    from gradseam.tools import plan_check

    with torch.device("meta"):
        flux = FluxTransformer2DModel(num_layers=19, num_single_layers=38, guidance_embeds=False)
    blocks = [sum(p.numel() for p in b.parameters()) * 2 / 2**30
              for b in [*flux.transformer_blocks, *flux.single_transformer_blocks]]
    data = json.loads((Path(__file__).parent / "data" / "auto" / "flux-dev-4k-h100-streamed-counts.json").read_text())
    # read as the current format: under even_spread each count streams the blocks it streamed when measured
    data = {**data, "format": cost_cache.FORMAT}
    advice = auto_planner.choose(cost_cache.Table.from_json(data), 12.0, 22.29, 64.0, flux, block_gib=blocks,
                                 streamed_per_block=len(auto_planner.CANDIDATES))
    said = plan_check.predicted(advice)
    assert plan_check.name_of(advice) == "unsloth-compile + stream 32", plan_check.name_of(advice)
    assert said is not None and said["gpu_gib"] <= 12.0 and said["step_ms"] < 742.3, said


def _saved_file(cache_dir) -> Path:
    (path,) = cache_dir.glob("costs/*.json")
    return path


def test_a_table_from_before_checked_plans_counted_streamed_weights_keeps_its_rows_and_runs_its_plans_again(_cache):
    """Format 1 kept a checked plan's pinned figure without the weights it streamed (a plan over the host budget by
    its weights passed): such a file's measured rows are read, its checked plans are not, and a format-2 file keeps
    both. A format this reader does not know is measured again."""
    model, inputs = WAN.fresh(), _inputs()
    key = cost_cache.key_of(Request(model, inputs, None, None, family_for(model)), auto_planner.CANDIDATES)
    _write_table(model, inputs)
    table = cost_cache.load(key)
    table.checked[cost_cache.config_id({"gradient_checkpointing": True})] = Estimate(2.0, 100.0, 1.0)
    cost_cache.save(key, table)
    path = _saved_file(_cache)
    data = json.loads(path.read_text())
    assert data["format"] == cost_cache.FORMAT == 5
    assert cost_cache.load(key).checked, "a current file lost its checked plans"
    path.write_text(json.dumps({**data, "format": 1}))
    old = cost_cache.load(key)
    assert old is not None and old.checked == {} and old.results == table.results and old.complete
    path.write_text(json.dumps({**data, "format": 6}))
    assert cost_cache.load(key) is None


def test_a_gpu_table_timed_by_the_engine_before_batched_copies_measures_its_offloading_rows_and_plans_again(
        _cache, monkeypatch):
    """Format 4: the offload engine issues a group's copies together and bounds how far the CPU runs ahead, so a row
    that moves activations to host memory steps at another speed than a file before 4 says. Such a GPU file keeps the
    rows that move nothing, measures the rest again (the table is incomplete until it has) and runs its checked
    plans again; a CPU file keeps everything (its figures are saved bytes, which the engine does not change)."""
    from dataclasses import replace

    model, inputs = WAN.fresh(), _inputs()
    request = Request(model, inputs, None, None, family_for(model))
    _write_table(model, inputs)
    cpu_key = cost_cache.key_of(request, auto_planner.CANDIDATES)
    table = cost_cache.load(cpu_key)
    # rows measured on the model as it is, which format 5's rule (predicted rows measured again) leaves alone: this
    # test is format 4's (the next one is 5's)
    table.results = {label: replace(r, source="measured") if isinstance(r, Estimate) else r
                     for label, r in table.results.items()}
    table.checked[cost_cache.config_id({"gradient_checkpointing": True})] = Estimate(2.0, 100.0, 1.0)
    data = {**table.to_json(cpu_key), "format": 3}
    assert set(cost_cache.Table.from_json(data).results) == set(table.results), "a CPU file lost rows"
    assert cost_cache.Table.from_json(data).checked == table.checked
    on_gpu = {**data, "key": {**cpu_key, "device": "NVIDIA H100 80GB HBM3"}}
    old = cost_cache.Table.from_json(on_gpu)
    offloading = {label for label, config in auto_planner.CANDIDATES if cost_cache.moves_activations(config)}
    assert {"unsloth", "unsloth-compile", "attention offload"} <= offloading and "torch" not in offloading
    assert set(old.results) == set(table.results) - offloading, sorted(old.results)
    assert {label for label, _ in old.missing()} == offloading and not old.complete
    assert old.checked == {}, "a plan timed by the old engine was trusted"
    assert set(cost_cache.Table.from_json({**on_gpu, "format": 5}).results) == set(table.results)


def test_a_gpu_table_from_before_pass_lines_were_confirmed_deeper_measures_its_predicted_rows_again(_cache):
    """Format 5: where one pass's own line through the fit depths decides a row's peak, the row is measured again at a
    deeper cut (advise.confirming_depth). A GPU file before 5 cannot say which line decided, so its predicted rows are
    measured again; its rows measured on the model as it is, out of memory or unsupported stay, and so do its
    checked plans (measured on the whole model). A CPU file keeps everything (its rows have no pass lines)."""
    from dataclasses import replace

    model, inputs = WAN.fresh(), _inputs()
    request = Request(model, inputs, None, None, family_for(model))
    _write_table(model, inputs)
    cpu_key = cost_cache.key_of(request, auto_planner.CANDIDATES)
    table = cost_cache.load(cpu_key)
    labels = [label for label, r in table.results.items() if isinstance(r, Estimate)]
    assert len(labels) >= 3
    table.results[labels[0]] = replace(table.results[labels[0]], source="measured")
    table.results[labels[1]] = "OOM while measuring within 12.00 GiB: CUDA out of memory."
    table.checked[cost_cache.config_id({"gradient_checkpointing": True})] = Estimate(2.0, 100.0, 1.0)
    data = {**table.to_json(cpu_key), "format": 4}
    assert cost_cache.Table.from_json(data).results == table.results, "a CPU file lost rows"
    on_gpu = {**data, "key": {**cpu_key, "device": "NVIDIA H100 80GB HBM3"}}
    old = cost_cache.Table.from_json(on_gpu)
    predicted = {label for label, r in table.results.items()
                 if isinstance(r, Estimate) and r.source.startswith("predicted")}
    assert labels[2] in predicted and labels[0] not in predicted and labels[1] not in predicted
    assert set(old.results) == set(table.results) - predicted
    assert {label for label, _ in old.missing()} == predicted and not old.complete
    assert old.checked == table.checked, "a plan measured on the whole model was dropped"
    assert cost_cache.Table.from_json({**on_gpu, "format": 5}).results == table.results


def test_a_table_from_before_counts_were_placed_by_size_measures_its_counted_streamed_rows_again(_cache):
    """Format 2 measured "+ stream N" with the N blocks placed evenly; placed by size they are other blocks on a model
    whose blocks differ (Flux): such rows and checked plans are dropped (measured again where a budget asks), and
    everything else is kept, "+ stream all" and the per-block entries streaming "all" among it."""
    from gradseam.config import STREAM_KEY

    model, inputs = WAN.fresh(), _inputs()
    key = cost_cache.key_of(Request(model, inputs, None, None, family_for(model)), auto_planner.CANDIDATES)
    _write_table(model, inputs)
    table = cost_cache.load(key)
    torch_rung = dict(auto_planner.CANDIDATES)["torch"]
    counted, every = {**torch_rung, STREAM_KEY: 3}, {**torch_rung, STREAM_KEY: "all"}
    entry = {**torch_rung, "gradient_checkpointing_blocks": [{"blocks": "blocks[0:2]", STREAM_KEY: 2}]}
    for label, config in (("torch + stream 3", counted), ("torch + stream all", every), ("entry", entry)):
        table.add(label, config, Estimate(1.0, 10.0, 1.0))
        table.checked[cost_cache.config_id(config)] = Estimate(1.0, 10.0, 1.0)
    table.checked[f"{cost_cache.config_id(counted)} under 8.00 GiB"] = "OOM on the whole model"
    cost_cache.save(key, table)
    path = _saved_file(_cache)
    data = json.loads(path.read_text())
    assert cost_cache.load(key).results.keys() == table.results.keys(), "a current file lost rows"
    path.write_text(json.dumps({**data, "format": 2}))
    old = cost_cache.load(key)
    assert "torch + stream 3" not in old.results and "entry" not in old.results and "torch + stream all" in old.results
    assert all(label not in ("torch + stream 3", "entry") for label, _ in old.candidates) and old.complete
    assert set(old.checked) == {cost_cache.config_id(every)}


def test_a_cached_row_whose_step_fell_with_depth_is_measured_again_and_only_it(_cache, monkeypatch):
    """A file written before advise timed such rows again holds their falling line (on an H100, 36.5 ms predicted for a
    row that took 767 ms resident): read back, the row is missing, the table incomplete, and a run that can measure
    measures that row alone."""
    model, inputs = WAN.fresh(), _inputs()
    request = Request(model, inputs, 40.0, 8.0, family_for(model))
    cpu_key = cost_cache.key_of(request, auto_planner.CANDIDATES)
    _write_table(model, inputs)
    data = json.loads(_saved_file(_cache).read_text())
    row = next(c for c in data["candidates"] if c["label"] == "torch")
    row["result"]["unit_costs"]["step_ms"] = -11.4
    # a row whose costs were moved onto what the whole model took (plan_check.measured_costs) is a measurement, not a
    # line: on a tiny model its fixed part can exceed the whole step, and dropping it made a cached run measure again
    # and plan unlike the run that wrote the table (test_gpu_auto under xdist on an H100)
    moved = next(c for c in data["candidates"] if c["label"] == "unsloth")["result"]
    moved["unit_costs"]["step_ms"], moved["source"] = -3.0, "measured at the real depth (depth 5) when auto checked"
    _saved_file(_cache).write_text(json.dumps(data))
    assert cost_cache.load(cpu_key).complete, "a CPU table's row was dropped (its step time is noise there)"
    # the same table as a GPU measured it
    real_key_of = cost_cache.key_of
    monkeypatch.setattr(cost_cache, "key_of", lambda *a: {**real_key_of(*a), "device": "NVIDIA H100 80GB HBM3"})
    key = cost_cache.key_of(request, auto_planner.CANDIDATES)
    for old_file in _cache.glob("costs/*.json"):
        old_file.unlink()
    cost_cache.save(key, cost_cache.Table.from_json({**data, "key": key}))
    table = cost_cache.load(key)
    assert not table.complete and [label for label, _ in table.missing()] == ["torch"]
    measured: list[dict] = []
    measure_on = _recording(measured, "torch")

    auto_planner.plan(request, measure_on=measure_on)
    assert measured == [dict(auto_planner.CANDIDATES)["torch"]]
    again = cost_cache.load(key)
    assert again.complete and again.results["torch"] == _estimate("torch")


def test_each_progress_line_says_about_how_long_the_rest_of_the_measuring_takes(monkeypatch, capsys):
    """Measuring a large model takes minutes, and compiled candidates far longer than eager ones (Flux dev 4k on an
    H100: 15 to 68 s against 2 to 3 s): after each row, the rows still to measure are estimated at the mean of those
    of their kind measured so far (of every row where none of their kind is yet)."""
    clock = iter([0.0, 2.0, 10.0, 14.0, 20.0, 60.0, 100.0, 104.0])  # rows of 2, 4, 40 and 4 s
    monkeypatch.setattr(auto_planner.time, "perf_counter", lambda: next(clock))
    eager = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch"}
    compiled = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "compile"}
    candidates = [("torch", eager), ("unsloth", {**eager, "gradient_checkpointing_backend": "unsloth"}),
                  ("compile", compiled), ("torch-ffn", {**eager, "gradient_checkpointing_backend": "torch-ffn"})]

    class Request:
        model = torch.nn.Linear(1, 1)
        streamed = False

    rows = auto_planner._Rows(Request(), lambda request: (lambda config: Estimate(1.0, 1.0), "depths 1 and 2", 0.0))
    auto_planner.measure(rows, candidates)
    lines = [line for line in capsys.readouterr().err.splitlines() if ": measured in " in line]
    assert [line.split(": measured in ")[1] for line in lines] == [
        "2.0 s; about 6 s left for the 3 still to measure",  # no compiled row yet: every row at the mean, 2 s
        "4.0 s; about 6 s left for the 2 still to measure",  # eager at 3 s, compiled at the mean of all, 3 s
        "40.0 s; about 3 s left for the 1 still to measure",  # the last is eager: 3 s
        "4.0 s",
    ]


def _hunyuanvideo15_costs(file: str):
    """HunyuanVideo 1.5 built on the meta device (its real sizes, no memory), each block's bf16 weights in GiB in
    forward order, and the cost table ``tests/data/auto/<file>`` an H100 measured for it."""
    from diffusers import HunyuanVideo15Transformer3DModel

    with torch.device("meta"):
        model = HunyuanVideo15Transformer3DModel()
    blocks = [sum(p.numel() for p in b.parameters()) * 2 / 2**30
              for b in [*model.context_embedder.token_refiner.refiner_blocks, *model.transformer_blocks]]
    data = json.loads((Path(__file__).parent / "data" / "auto" / file).read_text())
    # read as the current format: the H100's figures as it measured them (a live run would measure again the rows
    # predicted before a pass's line was confirmed deeper, format 5)
    return model, blocks, cost_cache.Table.from_json({**data, "format": cost_cache.FORMAT})


def test_hunyuanvideo15_under_32_gib_and_a_64_gib_host_is_planned_as_the_compiled_row_that_pins_within_the_host():
    """The H100 run's costs (HunyuanVideo 1.5 at 480p x 121 frames, LoRA r=16, every candidate at depths 2 and 4 under
    bench's 32 GiB cap; thirtieth session), replayed under its budgets (32 GiB GPU with 15.82 GiB static, 64 GiB
    pinned host). ``unsloth-compile`` at its default budget is predicted fastest but pins 66 GiB (65.995 measured on
    the whole model), over the host; at budget 0.05 it pins 42.8 and is the plan, as on the GPU (40,716 ms measured,
    40,376 predicted). The best mix (2 units ``compile``, the rest ``unsloth-compile``) is 0.38% faster, under the
    0.5% a mix must win by. With a 96 GiB host the default budget fits and is chosen. Under 24 GiB and a 64 GiB host
    no uniform candidate of the table holds both (``unsloth-compile + stream all`` pins 81 GiB; the eager rows ran
    out of memory under the cap, the whole model's weights on the GPU beside them), and the plan is a mix: some units
    at each compiler budget, some streamed, each budget held (not run on a GPU)."""
    from gradseam.tools import plan_check

    model, blocks, table = _hunyuanvideo15_costs("hunyuanvideo15-480p-h100-32gib.json")

    def plan(gpu: float, host: float):
        advice = auto_planner.choose(table, gpu, 15.82, host, model, block_gib=blocks)
        return plan_check.name_of(advice), plan_check.predicted(advice), advice

    name, said, advice = plan(32.0, 64.0)
    assert name == "unsloth-compile, budget 0.05", name
    assert said["host_gib"] <= 64.0 and said["gpu_gib"] <= 32.0 and said["step_ms"] == pytest.approx(40376.2, abs=0.1)
    assert "is not faster than unsloth-compile, budget 0.05" in advice.per_block_note, advice.per_block_note
    name, said, _ = plan(32.0, 96.0)
    assert name == "unsloth-compile" and said["host_gib"] == pytest.approx(65.98, abs=0.01), (name, said)
    name, said, _ = plan(24.0, 64.0)
    assert name.startswith("the mix") and "stream all" in name and "budget 0.05" in name, name
    assert said["gpu_gib"] <= 24.0 and said["host_gib"] <= 64.0 and said["step_ms"] < 40376.2, said


def test_hunyuanvideo15_under_24_gib_and_a_64_gib_host_settles_on_the_mix_the_h100_ran_without_running_it():
    """The same costs after bench's ``auto @ 24GiB`` on an H100 (thirty-first session): the rows with a count of blocks
    streamed that this budget asked for ran out of memory while measured (the rest of the model's weights resident
    beside the cut model), and the plan, replayed here from the table's own static memory, is the mix the GPU chose:
    15 units streamed with ``unsloth-compile``, 15 at compiler budget 0.05, the rest at its default. Its run on the
    whole model is in the table, so a run reading it settles on that plan without running it again, both budgets held
    (GPU 23.33 GiB, pinned 63.73) and its step as measured (40,991.4 ms, 1.8% over the 40,278.0 predicted). Its step
    retried 128 allocations, so it is planned again with more room; that plan is not in the table and a replay
    runs nothing, so the plan that ran stands."""
    from gradseam.tools import plan_check

    model, blocks, table = _hunyuanvideo15_costs("hunyuanvideo15-480p-h100-24gib.json")
    assert all(isinstance(table.results[label], str) and "within 24.00 GiB" in table.results[label]
               for label, config in table.candidates if isinstance(config.get(auto_planner.STREAM_KEY), int))

    def rechoose(gpu: float, host: float | None):
        return auto_planner.choose(table, gpu, table.static_gib, host, model, block_gib=blocks)

    advice = rechoose(24.0, 64.0)
    assert advice.chosen is None and advice.per_block is not None
    assert advice.per_block.config["gradient_checkpointing_blocks"] == [
        {"blocks": "transformer_blocks[0:15]", "gradient_checkpointing_stream_weights": "all"},
        {"blocks": "transformer_blocks[39:54]", "gradient_checkpointing_memory_budget": 0.05}]
    settled = plan_check.settle(advice, table, None, rechoose, gpu_gib=24.0, host_gib=64.0)
    assert settled.measured is not None and settled.advice is advice
    predicted = plan_check.predicted(advice)
    gpu = table.static_gib + settled.measured.peak_gib
    assert gpu <= 24.0 and settled.measured.pinned_gib <= 64.0
    assert gpu == pytest.approx(predicted["gpu_gib"], rel=0.03), (gpu, predicted)  # within 3%, as issue 41 asks
    assert settled.measured.step_ms == pytest.approx(predicted["step_ms"], rel=0.03), (settled.measured, predicted)
    # it retried 128 allocations, so a run that can run plans would try one with more room; a replay cannot, and the
    # plan that ran stands rather than one only predicted
    report = settled.report()
    assert "128 allocator retries in its step: planned again to leave more room" in report, report
    assert "not run here, so the plan that ran stands" in report, report


def test_hunyuanvideo15_under_32_gib_replays_the_h100s_second_round_that_streamed_13_blocks_for_room():
    """``auto @ 32GiB`` with a 64 GiB host on an H100 (thirty-ninth session, its cost table as the GPU saved it): the
    first plan, ``unsloth-compile`` at budget 0.05 on every block, held both budgets on the whole model but retried 113
    allocations (41,126.5 ms); planned again to leave twice the room, the planner measured the streamed rows that
    budget asked for and chose the same with 13 blocks' weights streamed, which ran in 37,092.2 ms with 2 retries and
    is the plan. Replayed, the table settles on it without running anything; planned with each run answered by what
    the GPU measured, the same two plans run in the same order: the planner makes the GPU's decisions from its costs."""
    from gradseam.tools import plan_check

    model, blocks, table = _hunyuanvideo15_costs("hunyuanvideo15-480p-h100-32gib-room.json")

    def rechoose(gpu: float, host: float | None):
        return auto_planner.choose(table, gpu, table.static_gib, host, model, block_gib=blocks)

    uniform = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-compile",
               "gradient_checkpointing_memory_budget": 0.05}
    streamed = {**uniform, auto_planner.STREAM_KEY: 13}
    first = rechoose(32.0, 64.0)
    assert plan_check.config_of(first) == uniform, plan_check.name_of(first)
    settled = plan_check.settle(first, table, None, rechoose, gpu_gib=32.0, host_gib=64.0)
    assert plan_check.config_of(settled.advice) == streamed, plan_check.name_of(settled.advice)
    assert settled.measured is not None and settled.measured.step_ms == pytest.approx(37092.2, abs=0.1)
    gpu = table.static_gib + settled.measured.peak_gib
    predicted = plan_check.predicted(settled.advice)
    assert gpu <= 32.0 and settled.measured.pinned_gib <= 64.0, (gpu, settled.measured)
    assert gpu == pytest.approx(predicted["gpu_gib"], rel=0.03), (gpu, predicted)  # within 3%, as issue 41 asks
    report = settled.report()
    assert "113 allocator retries in its step: planned again to leave more room" in report, report
    assert "not run here" not in report, report

    ran = dict(table.checked)
    table.checked.clear()
    runs: list[dict] = []

    def check(config: dict):
        runs.append(config)
        return ran[cost_cache.config_id(config)]

    again = plan_check.settle(rechoose(32.0, 64.0), table, check, rechoose, gpu_gib=32.0, host_gib=64.0)
    assert runs == [uniform, streamed] and plan_check.config_of(again.advice) == streamed
