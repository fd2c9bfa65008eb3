"""What streamed weights add to a step, modelled from the host link's rate (:mod:`gradseam.tools.host_link`), and
``auto`` planning streamed candidates from it instead of their lines through two shallow depths.

The figures are an H100's (Flux dev at 4,096 tokens, LoRA r=16, bf16; 2026-12-05/06): the resident steps and forward,
the streamed rows measured on the whole model, and the link's rate as ``compile + stream 31`` moved its weights."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gradseam.config import STREAM_KEY
from gradseam.tools import auto_planner, cost_cache, plan_check
from gradseam.tools.advise import Estimate, Trial, spread_weights_gib, with_link_waits
from gradseam.tools.estimates import UnitCosts
from gradseam.tools.host_link import FORWARD_SHARE, added_ms, pass_ms, waits_ms

DATA = Path(__file__).parent / "data" / "auto"
FLUX_GIB = [0.633] * 19 + [0.262] * 38  # Flux dev's double and single blocks' bf16 weights
LINK = 49.5  # GiB/s: 11.87 GiB in compile + stream 31's 239.9 ms forward on the H100
RESIDENT_STEP, RESIDENT_FORWARD = 489.4, 170.4  # unsloth-compile, uncapped, each row in its own process


def test_a_pass_with_nothing_streamed_is_its_compute():
    assert pass_ms([3.0, 4.0, 5.0], [1.0, 1.0, 1.0], [], LINK) == pytest.approx(12.0)


def test_a_copy_with_compute_before_it_hides_and_one_without_waits():
    """Block 2 of four 10 ms blocks streams a 5 ms copy issued as the pass starts: hidden. Block 0 streaming the same
    copy waits for all of it, in the forward; in the backward it runs last, and its copy hides."""
    gib = 5.0 * LINK / 1000.0  # 5 ms on the link
    assert pass_ms([10.0] * 4, [gib] * 4, [2], LINK) == pytest.approx(40.0)
    assert pass_ms([10.0] * 4, [gib] * 4, [0], LINK) == pytest.approx(45.0)
    assert waits_ms([gib] * 4, [0], 40.0, 80.0, LINK) == pytest.approx((5.0, 0.0))


def test_every_block_streamed_on_a_slower_link_is_bound_by_the_link():
    """Each copy is issued when the streamed block before it starts: with copies longer than compute the pass is
    every copy back to back, then the last block's compute."""
    gib = 7.0 * LINK / 1000.0
    assert pass_ms([2.0] * 6, [gib] * 6, range(6), LINK) == pytest.approx(6 * 7.0 + 2.0)


def test_a_copy_is_issued_when_the_streamed_block_before_it_starts():
    """Blocks 1 and 2 of four 10 ms blocks stream 15 ms copies: block 1's copy starts with the pass and hides behind
    block 0 but for 5 ms; block 2's starts when block 1 does (15) and ends at 30, where block 1 ended at 25. Streaming
    blocks 0 and 1 instead, nothing runs beside the first copy."""
    gib = 15.0 * LINK / 1000.0
    assert pass_ms([10.0] * 4, [gib] * 4, [1, 2], LINK) == pytest.approx(30.0 + 20.0)
    assert pass_ms([10.0] * 4, [gib] * 4, [0, 1], LINK) == pytest.approx(15.0 + 15.0 + 10.0 + 20.0)


def _even(count: int, total: int) -> list[int]:
    return [((2 * k + 1) * total) // (2 * count) for k in range(count)]


@pytest.mark.parametrize(("count", "measured", "line"), [(35, 684.2, 933.8), (44, 872.8, 696.0)])
def test_the_model_is_nearer_the_whole_model_than_the_shallow_lines_were(count, measured, line):
    """On the H100 the lines through depths 2 and 4 predicted Flux's streamed rungs at 934 ms (``unsloth-compile,
    budget 0.05 + stream 35``, which ran 684 ms as ``unsloth-compile + stream 35``) and 696 ms (``compile + stream 44``,
    which ran 873): -20% to +36%. From the resident step and forward (compile: 481.3 ms, forward taken as the
    uncapped unsloth-compile's) and the blocks as they were placed then (evenly), the model is within 10%."""
    step = RESIDENT_STEP if count == 35 else 481.3
    ahead, behind = added_ms(FLUX_GIB, _even(count, len(FLUX_GIB)), RESIDENT_FORWARD, step - RESIDENT_FORWARD, LINK)
    modelled = step + ahead + behind
    assert abs(modelled / measured - 1) < 0.10 < abs(line / measured - 1), (modelled, measured)
    waits = waits_ms(FLUX_GIB, _even(count, len(FLUX_GIB)), RESIDENT_FORWARD, step - RESIDENT_FORWARD, LINK)
    assert waits[0] > waits[1]  # the forward has a third of the compute to hide the same copies behind


def test_the_model_meets_the_placement_by_size_as_measured():
    """``unsloth-compile + stream 30`` placed by size under 16 GiB on the H100 (2026-12-06, beside a 501.6 ms
    resident step with a 182.3 ms forward, each row in its own process): 591.8 ms."""
    from gradseam.planning import spread

    ahead, behind = added_ms(FLUX_GIB, spread(30, FLUX_GIB), 182.3, 501.6 - 182.3, LINK)
    assert 501.6 + ahead + behind == pytest.approx(591.8, rel=0.03)


def _trial(step: float, forward: float | None, units: int = 19) -> Trial:
    costs = UnitCosts(units, (step - 5.0) / units, 5.0, 0.0, 0.78, 0.19, 0.2)
    return Trial("unsloth-compile", {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-compile"},
                 peak_gib=0.78, step_ms=step, unit_costs=costs, forward_ms=forward)


def test_a_streamed_rungs_step_becomes_its_resident_rungs_plus_the_modelled_waits():
    """Memory and pinned figures stay as measured; the per-unit step carries the waits, the fixed part is the
    resident's, so a uniform plan of the rung predicts exactly the modelled step; the source says how it was made."""
    resident = _trial(RESIDENT_STEP, RESIDENT_FORWARD)
    config = {**resident.config, STREAM_KEY: 25}
    line = Estimate(2.0, 933.8, 3.7, 0.18, "predicted at depth 19", UnitCosts(19, 50.0, -16.2, 0.18, 1.3, 0.2, 0.1))
    got = with_link_waits(line, resident, FLUX_GIB, config, LINK)
    from gradseam.planning import spread

    ahead, behind = added_ms(FLUX_GIB, spread(25, FLUX_GIB), RESIDENT_FORWARD, RESIDENT_STEP - RESIDENT_FORWARD, LINK)
    assert got.step_ms == pytest.approx(RESIDENT_STEP + ahead + behind)
    costs = got.unit_costs
    assert costs.step_fixed_ms + costs.units * costs.step_ms == pytest.approx(got.step_ms)
    assert (got.peak_gib, got.pinned_gib, costs.peak_gib) == (line.peak_gib, line.pinned_gib, 0.18)
    assert "modelled at 49.5 GiB/s" in got.source and "unsloth-compile's 489.4 ms" in got.source
    # placed by size, the same count's copies hide better than they did evenly placed
    even = sum(added_ms(FLUX_GIB, _even(25, 57), RESIDENT_FORWARD, RESIDENT_STEP - RESIDENT_FORWARD, LINK))
    assert ahead + behind < even


def test_without_a_timed_forward_the_step_is_split_by_the_stated_share():
    resident = _trial(RESIDENT_STEP, None)
    line = Estimate(2.0, 700.0, 3.7, 0.18, "predicted", UnitCosts(19, 36.0, 16.0, 0.18, 1.3, 0.2, 0.1))
    got = with_link_waits(line, resident, FLUX_GIB, {**resident.config, STREAM_KEY: "all"}, LINK)
    forward = RESIDENT_STEP * FORWARD_SHARE
    assert got.step_ms == pytest.approx(RESIDENT_STEP + sum(added_ms(FLUX_GIB, range(57), forward,
                                                                       RESIDENT_STEP - forward, LINK)))


def test_the_depth_fit_carries_the_forwards_own_time(monkeypatch):
    """GPU measurements time each pass; the estimate at the target depth carries the forward's line, which the model
    splits a resident step by. CPU measurements (no pass times) leave it unknown."""
    from gradseam.tools import advise

    def fake(model, inputs, config, depth, loss_fn=None, **_):
        forward = 10.0 * depth + 2.0 if config.get("timed") else None
        return SimpleNamespace(peak_gib=0.1 * depth, step_ms=30.0 * depth + 5.0, pinned_gib=0.0, forward_ms=forward)

    monkeypatch.setattr(advise, "measure_once", fake)
    plan = SimpleNamespace(full=19, describe=lambda d: f"depth {d}", unit_note=lambda: "", unseen_note=lambda d: "",
                           leading_note=lambda: "", default_depths=lambda: None)
    measure, _ = advise.depth_measure(object(), {}, family=object(), depths=(2, 4), plan=plan, device="cpu")
    assert measure({"timed": True}).forward_ms == pytest.approx(192.0)
    assert measure({}).forward_ms is None


def test_the_link_rate_is_kept_with_the_table_and_an_older_table_has_none(tmp_path):
    table = cost_cache.Table([], {}, 1.0, "depth 19", link_gib_s=51.2)
    data = json.loads(json.dumps(table.to_json({"model": "m"})))
    assert cost_cache.Table.from_json(data).link_gib_s == 51.2
    del data["link_gib_s"]
    assert cost_cache.Table.from_json(data).link_gib_s is None


@pytest.fixture(scope="module")
def flux():
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        return FluxTransformer2DModel(num_layers=19, num_single_layers=38, guidance_embeds=False)


def _settle_at_12gib(flux, link: float | None) -> list[dict]:
    """The H100's Flux dev 4k table replayed under 12 GiB (22.29 GiB static), a fake whole-model run answering as the
    H100 did: ``unsloth-compile + stream 32`` (either budget) out of memory, ``compile + stream 44`` 872.8 ms, any
    other unsloth-compile count 684.2 ms at 2.03 GiB (as ``+ stream 35`` ran by hand). Returns the plans run."""
    blocks = [sum(p.numel() for p in b.parameters()) * 2 / 2**30
              for b in [*flux.transformer_blocks, *flux.single_transformer_blocks]]
    data = json.loads((DATA / "flux-dev-4k-h100-streamed-counts.json").read_text())
    table = cost_cache.Table.from_json({**data, "format": cost_cache.FORMAT})

    def more(label, config):  # a count the table lacks, measured at two depths: as the rung's measured count did
        rung = label.rsplit(" + stream ", 1)[0]
        return next((found for name, found in table.results.items() if name.rsplit(" + stream ", 1)[0] == rung
                     and " + stream " in name and isinstance(found, Estimate)), "unsupported: not measured here")

    def rechoose(gpu, host):
        return auto_planner.choose(table, gpu, 22.29, host, flux, block_gib=blocks, more=more,
                                   streamed_per_block=len(auto_planner.CANDIDATES), link_gib_s=link)

    runs: list[dict] = []

    def check(config):
        runs.append(config)
        weights = spread_weights_gib(blocks, config.get(STREAM_KEY))
        if config.get("gradient_checkpointing_backend") == "compile" and config.get(STREAM_KEY) == 44:
            return Estimate(4.67 - weights, 872.8, weights)
        if config.get(STREAM_KEY) == 32:
            return "OOM on the whole model: CUDA out of memory. Tried to allocate 54.00 MiB"
        if config.get("gradient_checkpointing_backend") == "unsloth-compile" and isinstance(config.get(STREAM_KEY), int):
            return Estimate(2.03 - weights, 684.2, 3.72 + weights)
        raise AssertionError(f"the H100 ran no such plan: {config}")

    settled = plan_check.settle(rechoose(12.0, 64.0), table, check, rechoose, gpu_gib=12.0, host_gib=64.0,
                                depth="depth 19")
    assert settled.measured is not None and settled.measured.step_ms == 684.2
    return runs


def test_auto_at_12gib_plans_the_hand_plans_rung_without_running_compile_stream_44(flux, even_spread):
    """Without the link's rate (the H100's run, 2026-12-05), the planner ran ``compile + stream 44`` second, predicted
    696 ms from its lines, and it took 873. With it, that rung is modelled at about 820 ms and the planner goes from
    the out-of-memory ``stream 32`` straight to unsloth-compile with more blocks streamed."""
    without = _settle_at_12gib(flux, None)
    assert any(run.get("gradient_checkpointing_backend") == "compile" for run in without), without
    runs = _settle_at_12gib(flux, LINK)
    assert [run.get("gradient_checkpointing_backend") for run in runs] == ["unsloth-compile"] * len(runs), runs
    assert runs[0][STREAM_KEY] == 32 and all(run[STREAM_KEY] > 32 for run in runs[1:]) and len(runs) == 2, runs


@pytest.mark.cuda
def test_gpu_the_link_is_measured_as_streaming_uses_it():
    """One block's tensors copied host-to-device from pinned memory: a rate a PCIe or NVLink host link can have
    (a byte/ms or MiB mix-up would be off by 1000x), and a block of many small tensors no faster than one of the same
    bytes in a few large ones (each copy has its own launch)."""
    from gradseam.tools.host_link import measure_gib_s

    few = measure_gib_s([64 * 2**20] * 4, "cuda")
    many = measure_gib_s([2**20] * 256, "cuda")
    assert 2.0 < few < 1000.0, few
    assert many < few * 1.1, (many, few)


def test_advise_says_the_link_rate_its_streamed_rows_were_modelled_from():
    from gradseam.tools.estimates import Advice

    resident = _trial(RESIDENT_STEP, RESIDENT_FORWARD)
    streamed = Trial("unsloth-compile + stream 25", {**resident.config, STREAM_KEY: 25}, peak_gib=2.0, step_ms=540.0)
    assert "host link 49.5 GiB/s" in Advice(16.0, 22.3, [resident, streamed], link_gib_s=LINK).report()
    assert "host link" not in Advice(16.0, 22.3, [resident], link_gib_s=LINK).report()  # nothing streamed
    assert Advice(16.0, 22.3, [resident, streamed], link_gib_s=LINK).to_dict()["link_gib_s"] == LINK  # advise --json


def test_off_cuda_there_is_no_link_to_measure_and_the_streamed_steps_stay_the_lines():
    """A model on the CPU: no rate (advise and auto then keep each streamed row's two-depth line); a block's tensors
    to copy are the largest block's frozen ones."""
    from gradseam.patcher import family_for
    from gradseam.tools.host_link import block_tensor_bytes, measure_model_gib_s

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(8, 8)])
    model.blocks[1].bias.requires_grad_(False)
    model.blocks[1].weight.requires_grad_(False)
    assert sorted(block_tensor_bytes(list(model.blocks))) == [32, 256]  # the 8x8 block's frozen weight and bias
    from cases import WAN

    wan = WAN.fresh()
    assert measure_model_gib_s(wan, family_for(wan)) is None
    line = Estimate(2.0, 700.0, 3.7, 0.18, "predicted", UnitCosts(19, 36.0, 16.0, 0.18, 1.3, 0.2, 0.1))
    from gradseam.tools.advise import _try_streamed
    from gradseam.tools.estimates import Advice

    resident = _trial(RESIDENT_STEP, RESIDENT_FORWARD)
    trial = Trial("unsloth-compile + stream all", {**resident.config, STREAM_KEY: "all"})
    advice = Advice(80.0, 1.0, block_gib=FLUX_GIB, link_gib_s=None)
    _try_streamed(trial, advice, lambda config: line, sum(FLUX_GIB), resident)
    assert trial.step_ms == 700.0  # no rate: the line (at least the resident step), as before
    advice.link_gib_s = LINK
    _try_streamed(trial, advice, lambda config: line, sum(FLUX_GIB), resident)
    assert trial.step_ms != 700.0 and "GiB/s" in trial.source
