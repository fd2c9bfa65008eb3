"""Two ways a fit from two shallow depths under-predicts the real depth, and what the tools do about them.

1. A fixed transient in one pass sets the whole step's peak at both fit depths, so the fit is flat
   while the other pass grows per block (Ideogram 4's `torch` on the H200: 3.10 GiB at 2 and 4
   blocks, 3.91 at 34). GPU steps read each pass's peak on its own; the prediction is the highest
   of the three lines at the depth asked for.
2. An approximate depth plan keeps short lists at one block at both fit depths, so the fit never
   sees them grow (Flux 3's mode lists: none measured 12% above its fit). The plan says which
   lists, and the depths that would see them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradseam.tools import bench_report as report
from gradseam.tools import measure as measuring
from gradseam.tools.depth import DepthPlan, predict, predict_peak
from gradseam.tools.results import RealRun, Result

GiB = 1 << 30

# Ideogram 4's `torch` row, shaped like the H200 run: the forward's transient (3.10) sets the step's
# peak at 2 and 4 blocks; the backward starts from what every block kept (~27 MiB each) and adds one
# block's working set, so its own line climbs past 3.10 further down.
FORWARD = {2: 3.10, 4: 3.10, 8: 3.10}
BACKWARD = {2: 2.95, 4: 3.004, 8: 3.112}  # still climbing from 4 to 8 blocks: what each block keeps


def _rows(strategy: str = "torch", phases: bool = True) -> list[Result]:
    return [Result("w", 6144, strategy, max(FORWARD[d], BACKWARD[d]), 100.0 * d, depth=d, blocks=f"{d} blocks",
                   forward_peak_gib=FORWARD[d] if phases else None, backward_peak_gib=BACKWARD[d] if phases else None)
            for d in (2, 4)]


def test_the_backwards_own_line_predicts_the_peak_the_flat_step_fit_misses():
    rows = _rows()
    step_only, _ = predict(rows, "w", "torch", (2, 4), 34, "peak_gib")
    value, line, source = predict_peak(rows, "w", "torch", (2, 4), 34)
    assert step_only == pytest.approx(3.10)
    assert source == "backward"
    assert value == pytest.approx(3.004 + 30 * 0.027) and line.growth == pytest.approx(0.027)


def test_without_pass_peaks_or_when_the_step_line_is_highest_the_step_fit_speaks():
    value, line, source = predict_peak(_rows(phases=False), "w", "torch", (2, 4), 34)
    assert source == "step" and value == pytest.approx(3.10)
    # the backward sets the peak at both depths: its line is the step's line, and the step's is kept
    rows = [Result("w", 1, "none", 1.0 + d, 1.0, depth=d, forward_peak_gib=0.5 * d, backward_peak_gib=1.0 + d)
            for d in (2, 4)]
    assert predict_peak(rows, "w", "none", (2, 4), 40)[2] == "step"
    assert predict_peak([], "w", "none", (2, 4), 40) is None


def _run(plan: DepthPlan, full: int) -> RealRun:
    none = [Result("w", 6144, "none", 1.65 * d, 65.0 * d, depth=d, forward_peak_gib=0.4 * d,
                   backward_peak_gib=1.65 * d) for d in (2, 4)]
    return RealRun(plan, (2, 4), full, none + _rows())


def test_the_full_depth_table_marks_a_peak_predicted_from_one_pass():
    run = _run(DepthPlan({"blocks": 34}), 34)
    rows = report.full_depth_rows(run)
    torch_row = next(r for r in rows if r["strategy"] == "torch")
    assert torch_row["peak_fit"] == "backward" and torch_row["peak_source"] == "predicted"
    assert torch_row["peak_gib"] == pytest.approx(3.814) and torch_row["growth_gib_per_unit"] == pytest.approx(0.027)
    assert next(r for r in rows if r["strategy"] == "none")["peak_fit"] == "step"
    text = report.full_depth_markdown(rows, report.depth_info(run, measured_full=False))
    assert "| torch | ~3.81 † |" in text
    assert "† predicted from the backward pass's own peak" in text
    assert "Note:" not in text  # one list: nothing the fit cannot see


def test_flux3_like_plan_names_the_lists_the_fit_depths_cannot_see_grow():
    plan = DepthPlan({"mode_a": 5, "mode_b": 5, "mode_c": 5, "single": 28})
    assert plan.counts(2)["mode_a"] == plan.counts(4)["mode_a"] == 1
    assert plan.unseen((2, 4)) == ["mode_a", "mode_b", "mode_c"]
    assert plan.unseen_share((2, 4)) == pytest.approx(12 / 43)
    better = plan.depth_growing_every_list(2)
    assert all(plan.counts(better)[p] > plan.counts(2)[p] for p in ("mode_a", "single"))
    assert plan.counts(better - 1)["mode_a"] == 1  # the smallest such depth
    assert plan.unseen((2, better)) == []
    note = plan.unseen_note((2, 4))
    assert note.startswith("the fit depths 2 and 4 keep the same blocks of mode_a (1 of 5), mode_b (1 of 5), mode_c (1 of 5)")
    assert f"--depths 2,{better} (every list grows there) or --full" in note
    run = _run(plan, 28)
    info = report.depth_info(run, measured_full=False)
    assert info["unseen_lists"] == ["mode_a", "mode_b", "mode_c"] and info["warning"] == note
    assert f"Note: {note}" in report.full_depth_markdown(report.full_depth_rows(run), info)


@pytest.mark.parametrize(("totals", "warns"), [
    ({"transformer_blocks": 19, "single_transformer_blocks": 38}, False),  # exact: every list grows
    ({"token_refiner": 2, "double": 20, "single": 40}, False),  # 1 of 62 blocks unseen: under the threshold
    ({"noise_refiner": 2, "context_refiner": 2, "layers": 30}, True),  # 2 of 34
])
def test_only_a_share_of_unseen_blocks_worth_a_figure_warns(totals, warns):
    assert (DepthPlan(totals).unseen_note((2, 4)) is not None) == warns


BASE = 100 * GiB  # what the fake allocator holds before the timed steps


@pytest.fixture
def allocator(monkeypatch):
    """The CUDA calls measure() makes, answered as an allocator holding :data:`BASE` would: no GPU needed."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: BASE)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    # the step reset the allocator's peak: what max_memory_allocated reads after the loop is stale
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: BASE)


def test_measure_takes_the_peak_from_the_passes_a_step_read(allocator):
    base = BASE
    got_phases = iter([measuring.Phases(base + 9 * GiB, base + 9 * GiB),  # warm-up: not counted
                       measuring.Phases(base + 3 * GiB, base + 2 * GiB),
                       measuring.Phases(base + 3 * GiB, base + 4 * GiB)])
    got = measuring.measure(lambda: next(got_phases), steps=2, warmup=1, device="cuda")
    assert (got.forward_peak_gib, got.backward_peak_gib, got.peak_gib) == (3.0, 4.0, 4.0)


class _Keyworded(nn.Module):
    """``inner`` called as the step calls a model: ``model(hidden_states=...)``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.inner(hidden_states)


class _Event:
    """Stands in for a CUDA event recorded at ``at_ms`` on the compute stream."""

    def __init__(self, at_ms: float) -> None:
        self.at_ms = at_ms

    def elapsed_time(self, later: _Event) -> float:
        return later.at_ms - self.at_ms


def test_measure_times_each_pass_from_the_events_a_step_recorded(allocator):
    base = BASE

    def timed(start: float, forward: float, backward: float) -> measuring.Phases:
        events = (_Event(start), _Event(start + forward), _Event(start + forward + backward))
        return measuring.Phases(base + GiB, base + GiB, events)

    got_phases = iter([timed(0, 500, 900),  # warm-up: not counted
                       timed(1000, 10, 30), timed(2000, 14, 20), timed(3000, 12, 25)])
    got = measuring.measure(lambda: next(got_phases), steps=3, warmup=1, device="cuda")
    assert (got.forward_ms, got.backward_ms) == (12, 25)  # each pass's own median, not one step's
    # a step without events (inputs not on a GPU) leaves the pass times unknown, never zero
    plain = iter([measuring.Phases(base, base)] * 2)
    got = measuring.measure(lambda: next(plain), steps=1, warmup=1, device="cuda")
    assert (got.forward_ms, got.backward_ms) == (None, None)


def test_forward_backward_reads_each_pass_between_resets(monkeypatch):
    events: list[str] = []
    reading = iter([7, 11])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: (events.append("read"), next(reading))[1])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: events.append("reset"))
    model = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    x.register_hook(lambda g: events.append("backward"))

    step = measuring.forward_backward(_Keyworded(model), {"hidden_states": x}, phases=True)
    assert step() == measuring.Phases(7, 11)
    assert events == ["read", "reset", "backward", "read", "reset"]
    assert x.grad is not None
    # on CPU tensors the default is no phases: the step's usual 0
    assert measuring.forward_backward(_Keyworded(model), {"hidden_states": x})() == 0


def test_advise_predicts_from_the_highest_pass(monkeypatch):
    from gradseam.tools.advise import depth_measure
    from gradseam.tools.synthetic import SyntheticStack, ensure_registered

    ensure_registered()
    model = SyntheticStack(34, 16)
    x = {"hidden_states": torch.randn(1, 4, 16, requires_grad=True)}

    def fake(step, **kwargs):
        d = len(model.blocks)
        return measuring.Measurement(max(FORWARD[d], BACKWARD[d]), 1.0, forward_peak_gib=FORWARD[d],
                                     backward_peak_gib=BACKWARD[d])

    monkeypatch.setattr(measuring, "measure", fake)
    measure, _ = depth_measure(model, x, device="cpu", depths=(2, 4))
    got = measure({"gradient_checkpointing": True})
    # the backward's line decides, and seen again from 4 and 8 blocks it climbs as it did: kept
    assert got.peak_gib == pytest.approx(3.814) and got.growth_gib == pytest.approx(0.027)
    assert got.source == "predicted at depth 34 (its backward line from depths 4 and 8)"


# Wan 2.1 14B's `unsloth-compile + stream all`: the forward's peak climbs over the first blocks and then stops (4.13,
# 5.40, 6.06 and 6.28 GiB at 1, 2, 4 and 40 blocks on an H200 and an H100); the backward sets the step's peak
SATURATING = {2: (5.402, 8.287), 4: (6.062, 8.299), 8: (6.200, 8.311)}
CLIMBING = {**SATURATING, 8: (7.382, 8.311)}


@pytest.mark.parametrize(("passes", "expected", "decides"), [
    (SATURATING, 8.311 + 26 * 0.003, "step"), (CLIMBING, 7.382 + 26 * 0.33, "forward")])
def test_a_pass_line_that_decides_is_measured_again_deeper_and_kept_only_if_it_still_climbs(
        monkeypatch, passes, expected, decides):
    """Where one pass's own line through the fit depths is the highest at the full depth, the candidate is measured
    at twice the deeper fit depth, and the prediction comes from the deeper pair: a forward peak that stops climbing
    (a pipeline filled) no longer predicts twice what the full model uses; one that still climbs still decides."""
    got, seen = _predicted_from(monkeypatch, lambda d: passes[d])
    assert seen == [2, 4, 8]
    assert got.peak_gib == pytest.approx(expected, abs=2e-3)
    assert got.source == f"predicted at depth 34 (its {decides} line from depths 4 and 8)"


def test_where_the_whole_steps_line_decides_no_deeper_cut_is_measured(monkeypatch):
    got, seen = _predicted_from(monkeypatch, lambda d: (1.0, 2.0 + 0.1 * d))
    assert seen == [2, 4] and got.source == "predicted at depth 34" and got.peak_gib == pytest.approx(5.4)


def _predicted_from(monkeypatch, passes):
    """advise's prediction at 34 blocks from depths 2 and 4 of a synthetic stack whose measurement at each depth has
    the (forward, backward) peaks ``passes(depth)`` gives, the step's the higher; and the depths measured."""
    from gradseam.tools.advise import depth_measure
    from gradseam.tools.synthetic import SyntheticStack, ensure_registered

    ensure_registered()
    model = SyntheticStack(34, 16)
    x = {"hidden_states": torch.randn(1, 4, 16, requires_grad=True)}
    seen: list[int] = []

    def fake(step, **kwargs):
        seen.append(len(model.blocks))
        forward, backward = passes(seen[-1])
        return measuring.Measurement(max(forward, backward), 1.0 + seen[-1], forward_peak_gib=forward,
                                     backward_peak_gib=backward)

    monkeypatch.setattr(measuring, "measure", fake)
    measure, _ = depth_measure(model, x, device="cpu", depths=(2, 4))
    return measure({"gradient_checkpointing": True}), seen


@pytest.mark.cuda
def test_on_a_gpu_each_pass_is_timed_and_the_two_make_the_step():
    """Real events on a GPU: a backward that does twice the forward's work (each layer's two gradients) takes
    longer than the forward, and the passes' times add up to the step (the step's own time also counts the
    host's launch gap and the final synchronize)."""
    layers = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)]).cuda()
    x = {"hidden_states": torch.randn(8192, 4096, device="cuda", requires_grad=True)}
    got = measuring.measure(measuring.forward_backward(_Keyworded(layers), x), steps=3, device="cuda")
    assert got.forward_ms is not None and got.backward_ms is not None
    assert 0 < got.forward_ms < got.backward_ms
    assert got.forward_ms + got.backward_ms == pytest.approx(got.step_ms, rel=0.25)


@pytest.mark.cuda
def test_on_a_gpu_a_forward_transient_no_longer_hides_what_each_block_keeps():
    """A real allocator: a 256 MiB transient at the start of the forward, then blocks that each keep a
    16 MiB input for backward. At 2 and 4 blocks the transient is the step's peak; at 32 blocks the
    backward's start (everything kept) is. The pass-wise fit predicts it; the step's fit alone did not."""
    from gradseam.tools.depth import at_depth

    tokens, dim = 4096, 1024  # fp32: one block's kept input is 16 MiB

    class Transient(nn.Module):
        def __init__(self, blocks: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(blocks))
            self.requires_grad_(False)

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            scratch = torch.ones(64, 1024, 1024, device=hidden_states.device)  # 256 MiB, freed before the blocks
            hidden_states = hidden_states + scratch.mean()
            del scratch
            for block in self.blocks:
                hidden_states = torch.tanh(block(hidden_states))
            return hidden_states

    model = Transient(32).cuda()
    plan = DepthPlan({"blocks": 32})
    x = {"hidden_states": torch.randn(tokens, dim, device="cuda", requires_grad=True)}
    rows = []
    for depth in (2, 4, 32):
        with at_depth(model, plan, depth):
            got = measuring.measure(measuring.forward_backward(model, x), steps=2, device="cuda")
        rows.append(Result("t", tokens, "none", got.peak_gib, got.step_ms, depth=depth,
                           forward_peak_gib=got.forward_peak_gib, backward_peak_gib=got.backward_peak_gib))
        measuring.release()
    measured = rows[-1].peak_gib
    step_only, _ = predict(rows, "t", "none", (2, 4), 32, "peak_gib")
    value, _, source = predict_peak(rows, "t", "none", (2, 4), 32)
    assert source == "backward"
    assert value == pytest.approx(measured, rel=0.1)
    assert step_only < 0.8 * measured
