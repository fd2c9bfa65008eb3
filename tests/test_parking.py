"""The blocks a cut model leaves out, parked while it is measured (:mod:`gradseam.tools.parking`): inside a session,
each cut parks what it leaves out and brings back what it runs; leaving the session puts every tensor back, the same
object with the same data, gradient included; what the cut model still uses (a tensor tied into it) and what cannot be
swapped (a quantized subclass) stays. On the CPU the host copy is the tensor itself, so the checks here are on the
swaps; tests/test_gpu_auto.py checks on the GPU that the memory leaves and comes back."""

from __future__ import annotations

import pytest
import torch
from cases import WAN

from gradseam.patcher import family_for
from gradseam.testing import assert_same_step, run_step
from gradseam.tools.depth import at_depth, plan_for
from gradseam.tools.parking import parking, session_of


def _wan() -> tuple[torch.nn.Module, object]:
    model = WAN.fresh()
    return model, plan_for(model, family_for(model))


def _snapshot(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int, torch.Tensor, torch.Tensor | None]]:
    """Each tensor of the state dict: the object, its data pointer, a copy of its data and of its gradient."""
    return {name: (t, t.data_ptr(), t.detach().clone(), t.grad.clone() if t.grad is not None else None)
            for name, t in model.state_dict(keep_vars=True).items()}


def _assert_as_before(model: torch.nn.Module, before: dict) -> None:
    now = model.state_dict(keep_vars=True)
    assert list(now) == list(before), "the state dict's keys changed"
    for name, (tensor, pointer, data, grad) in before.items():
        assert now[name] is tensor, f"{name} is another object"
        assert tensor.data_ptr() == pointer and torch.equal(tensor, data), f"{name}'s data changed"
        if grad is None:
            assert tensor.grad is None, f"{name} gained a gradient"
        else:
            assert torch.equal(tensor.grad, grad), f"{name}'s gradient changed"


def _parked(block: torch.nn.Module) -> bool:
    tensors = [*block.parameters(), *block.buffers()]
    return bool(tensors) and all(t.numel() == 0 and t.grad is None for t in tensors)


def _bytes(blocks: list[torch.nn.Module]) -> int:
    return sum(p.nbytes + (p.grad.nbytes if p.grad is not None else 0) for b in blocks for p in b.parameters()) + \
        sum(t.nbytes for b in blocks for t in b.buffers())


def test_each_cut_parks_what_it_leaves_out_and_the_session_puts_every_tensor_back_as_it_was():
    model, plan = _wan()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)  # accumulated before: parked with the weight, back with it
    blocks = list(model.blocks)
    assert len(blocks) == plan.full == 5
    before = _snapshot(model)
    with parking(model) as session:
        assert session_of(model) is session
        with at_depth(model, plan, 2):
            assert [_parked(b) for b in blocks] == [False, False, True, True, True]
            assert session.parked_bytes == _bytes(blocks[:2]) * 3 // 2 == session.moved_bytes  # alike blocks
        assert _parked(blocks[4]), "left at once, not when the session ends"
        with at_depth(model, plan, 4):
            assert [_parked(b) for b in blocks] == [False, False, False, False, True], "a deeper cut brings back"
        with at_depth(model, plan, plan.full):
            assert not any(_parked(b) for b in blocks) and session.parked_bytes == 0
        with at_depth(model, plan, 1):
            assert [_parked(b) for b in blocks] == [False, True, True, True, True]
    assert session_of(model) is None and session.parked_bytes == 0
    _assert_as_before(model, before)


def test_a_cut_model_steps_exactly_alike_with_the_blocks_it_leaves_out_parked():
    model, plan = _wan()
    with at_depth(model, plan, 2):
        want = run_step(model, WAN)
    with parking(model), at_depth(model, plan, 2):
        got = run_step(model, WAN)
    assert_same_step(want, got, what="the cut model with the rest parked vs not")


def test_a_tensor_the_cut_model_still_uses_a_quantized_one_and_a_view_stay_where_they_are():
    class Quantized(torch.Tensor):
        """A stand-in for a quantized weight's tensor subclass, whose data a swap is not defined for."""

    model, plan = _wan()
    blocks = list(model.blocks)
    shared = blocks[0].ffn.net[0].proj.weight
    blocks[4].ffn.net[0].proj.weight = shared  # tied: block 0 runs it
    blocks[4].register_buffer("scale", torch.ones(8).as_subclass(Quantized))
    flat = torch.zeros(16)
    blocks[4].register_buffer("slice", flat[8:])  # a view into a larger buffer
    before = _snapshot(model)
    with parking(model), at_depth(model, plan, 2):
        assert shared.numel() > 0, "parked a tensor the cut model uses"
        assert blocks[4].scale.numel() == 8, "parked a tensor subclass"
        assert blocks[4].slice.numel() == 8, "parked a view into a larger buffer"
        assert blocks[4].ffn.net[0].proj.bias.numel() == 0, "the rest of the block is parked"
    _assert_as_before(model, before)


def test_sessions_nest_the_outer_one_restores_and_an_error_inside_still_restores():
    model, plan = _wan()
    blocks = list(model.blocks)
    before = _snapshot(model)
    with parking(model) as outer:
        with parking(model) as inner, at_depth(model, plan, 1):
            assert inner is outer
        assert _parked(blocks[1]), "the inner session is the outer one: it left the blocks parked"
    _assert_as_before(model, before)
    with pytest.raises(RuntimeError, match="a failed measurement"), parking(model), at_depth(model, plan, 1):
        raise RuntimeError("a failed measurement")
    assert session_of(model) is None
    _assert_as_before(model, before)


def test_without_a_session_a_cut_parks_nothing():
    model, plan = _wan()
    blocks = list(model.blocks)
    with at_depth(model, plan, 1):
        assert not any(_parked(b) for b in blocks)


def test_each_move_is_reported_with_its_size():
    model, plan = _wan()
    lines: list[str] = []
    with parking(model, lines.append), at_depth(model, plan, 3):
        pass
    assert len(lines) == 2, lines
    assert "moved to host memory" in lines[0] and "GiB parked now" in lines[0]
    assert "moved back from host memory" in lines[1] and "(0.00 GiB parked now)" in lines[1]


def test_advise_measures_the_users_whole_model_with_the_blocks_outside_each_cut_parked(monkeypatch):
    """``gradseam.advise`` on the user's whole model (the Python API; the CLI builds its model cut already): every cut
    it measures runs with the blocks it leaves out parked, and the model is as it was after, gradients included (until
    the thirty-third session every measured backward accumulated into them). The GPU measurement is swapped for the
    CPU one, which runs the same cuts; ``tests/test_gpu_auto.py`` checks the memory on the GPU."""
    from gradseam.tools import advise as advising

    model, plan = _wan()
    blocks = list(model.blocks)
    seen: list[list[bool]] = []

    def loss_fn(output: object) -> torch.Tensor:  # runs inside each measured step, on the model as cut
        seen.append([_parked(b) for b in blocks])
        return output[0].float().square().mean()

    def cpu_measure(model, inputs, loss_fn, static_gib, depths, depth, plan):  # _gpu_measure's signature
        measure, note = advising.depth_measure(model, inputs, loss_fn, depths=depths, device="cpu")
        return measure, note, 0.0, True

    monkeypatch.setattr(advising, "_gpu_measure", cpu_measure)
    monkeypatch.setattr(advising, "LADDER", [("none", dict(advising.OFF))])
    model.blocks[0].ffn.net[0].proj.weight.grad = torch.full_like(model.blocks[0].ffn.net[0].proj.weight, 0.5)
    before = _snapshot(model)
    lines: list[str] = []
    advice = advising.advise(model, WAN.inputs(torch.Generator().manual_seed(0)), 80.0, loss_fn, block_gib=[],
                             pinnable_gib=64.0, progress=lambda line, done: lines.append(line), depths=(1, 2))
    assert advice.chosen is not None and advice.chosen.label == "none"
    cuts = {tuple(s) for s in seen}
    assert cuts == {(False, True, True, True, True), (False, False, True, True, True)}, seen
    assert any(line.startswith("parking: ") for line in lines), lines  # each move is reported with the rest
    assert session_of(model) is None
    _assert_as_before(model, before)


def test_advise_parks_nothing_where_the_model_has_no_block_past_its_deepest_cut(monkeypatch):
    """``gradseam advise`` (the CLI) builds its model at the deepest depth it measures: parking would move the
    blocks between its two depths out and back for every candidate and free nothing the model needs room for."""
    from gradseam.tools import advise as advising

    model, plan = _wan()
    seen: list[list[bool]] = []

    def loss_fn(output: object) -> torch.Tensor:
        seen.append([_parked(b) for b in model.blocks])
        return output[0].float().square().mean()

    def cpu_measure(model, inputs, loss_fn, static_gib, depths, depth, plan):
        measure, note = advising.depth_measure(model, inputs, loss_fn, depths=depths, device="cpu")
        return measure, note, 0.0, True

    monkeypatch.setattr(advising, "_gpu_measure", cpu_measure)
    monkeypatch.setattr(advising, "LADDER", [("none", dict(advising.OFF))])
    lines: list[str] = []
    advising.advise(model, WAN.inputs(torch.Generator().manual_seed(0)), 80.0, loss_fn, block_gib=[],
                    pinnable_gib=64.0, progress=lambda line, done: lines.append(line), depths=(2, plan.full))
    assert seen and not any(any(s) for s in seen), seen
    assert not any(line.startswith("parking: ") for line in lines), lines
