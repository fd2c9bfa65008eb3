"""Faults and unusual step shapes: exceptions (and KeyboardInterrupt) in forward, in backward and
in a recompute; backward twice; forward without backward; gradient accumulation; grad mode
toggled around one block.

After a fault nothing of the failed step may stay behind: no saved-tensor hook, no open region,
no chain holding outputs, no host buffer checked out; and the next step is exact (equal to an
unpatched twin on the CPU in float32, to the bit).

Steps here run without :func:`gradseam.testing.run_step`'s saved-bytes counter: its identity
pack hook makes every saved *output* reference its own graph node, a cycle through C++ that
Python's GC cannot see, so a graph that backward never frees (a failed step, a forward without
backward) would leak by the counter's doing, unpatched models included.
"""

from __future__ import annotations

import gc

import pytest
import torch
from cases import FLUX, WAN
from cases import STRATEGIES as CONFIGS
from torch import nn

import gradseam
from gradseam.offload import cpu_test_mode
from gradseam.run import seams
from gradseam.run.chains import inside_region
from gradseam.run.links import PRE_HOOKS
from gradseam.testing import Case, Step, assert_same_step

RECOMPUTES_ATTENTION = {"torch", "torch-interval2", "unsloth", "unsloth-interval2"}
MATRIX = [(case, name) for case in (FLUX, WAN) for name in CONFIGS]
IDS = [f"{case.name}-{name}" for case, name in MATRIX]
matrix = pytest.mark.parametrize(("case", "name"), MATRIX, ids=IDS)


# -- helpers -------------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def _quick_gc():
    """Full collections (several per test) would each walk every object torch and diffusers made
    at import; freeze those so a collection only walks what the tests create."""
    frozen_before = gc.get_freeze_count()  # conftest.py froze what collection built (on a machine without CUDA)
    build(FLUX)
    build(WAN)
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
    if frozen_before:  # leave the process frozen as it was (what it holds now, as conftest.py would)
        gc.collect()
        gc.freeze()


def build(case: Case) -> nn.Module:
    torch.manual_seed(case.seed)
    return case.build()


def patched(case: Case, name: str):
    model = build(case)
    with cpu_test_mode():  # lets the offload strategies run on the CPU model, through host buffers
        handle = gradseam.patch(model, CONFIGS[name])
    return model, handle


_EXPECTED: dict = {}


def unpatched(case: Case, what: str, run, *args):
    """What ``run(twin, case, *args)`` gives on an unpatched twin; computed once per case."""
    key = (case.name, what, *args)
    if key not in _EXPECTED:
        _EXPECTED[key] = run(build(case), case, *args)
    return _EXPECTED[key]


def reference(case: Case):
    return unpatched(case, "step", run_step)


def block(model: nn.Module, case: Case, k: int = 1) -> nn.Module:
    """Block ``k`` of the list the fault goes in (k=1 is the second member of an interval-2 chunk)."""
    return model.single_transformer_blocks[k] if case is FLUX else model.blocks[k]


def site(model: nn.Module, case: Case, where: str) -> nn.Module:
    b = block(model, case)
    if where == "block":  # outside every region
        return b
    if where == "attention":  # inside a whole-block region and inside an attention-offload group
        return (b.attn if case is FLUX else b.attn1).to_q
    # inside the FFN: between the two members of Flux's proj_mlp -> act_mlp seam, inside Wan's ff
    return b.act_mlp if case is FLUX else b.ffn.net[2]


def hidden(out):
    """The hidden-states tensor of a block's output."""
    return out if isinstance(out, torch.Tensor) else out[1]


def raise_once(make):
    fired: list[int] = []

    def hook(*_):
        if not fired:
            fired.append(1)
            raise make()

    return hook


def failure(fn, kind: type[BaseException] = RuntimeError) -> str:
    """Run ``fn``, which must raise ``kind``; keep only the message (no traceback, so no tensors)."""
    try:
        fn()
    except kind as exc:
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError(f"expected {kind.__name__}")


def assert_clean(handle, what: str = "") -> None:
    """Nothing of an earlier step is left: hooks, regions, chain state, host buffers."""
    gc.collect()
    assert torch.is_grad_enabled(), what
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None, f"{what}: a saved-tensor hook stayed"
    assert not inside_region(), f"{what}: still inside a region"
    calls = getattr(seams, "_calls", None)  # seams' per-thread call stacks, where they keep any
    assert calls is None or not (calls.running or calls.bypass), f"{what}: a seam call stayed on the stack"
    for chain in handle._chains:  # the chains' own state: white-box on purpose, nothing public shows it
        assert chain._flight is None, f"{what}: {chain.label} holds state"
    # a fault injected through a pre-hook on a chain member makes that chain run per member while the
    # hook is there (counted as such); any other cause would mean the fault left something behind
    fell = [r.label for r in handle.regions() if set(r.fallbacks) - {PRE_HOOKS}]
    assert not fell, f"{what}: {fell} fell back"
    engine = handle.engine
    if engine is not None:
        assert engine.store.checked_out == 0, f"{what}: {engine.store.checked_out} host buffers still checked out"
        copies = engine.copies
        x = torch.randn(64, 64, requires_grad=True)
        (x * 2).sin().sum().backward()  # saved outside any region: must not be intercepted
        assert engine.copies == copies, f"{what}: a tensor saved outside gradseam was offloaded"


def loss_of(outputs) -> torch.Tensor:
    return sum(o.float().square().mean() for o in outputs)


def collect(model: nn.Module, inputs: dict, outputs: tuple) -> Step:
    input_grads = {
        k: v.grad.detach().clone()
        for k, v in inputs.items()
        if isinstance(v, torch.Tensor) and v.requires_grad and v.grad is not None
    }
    params = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return Step(tuple(o.detach().clone() for o in outputs), input_grads, params, 0)


def outputs_of(case: Case, out) -> tuple:
    value = case.output(out)
    return value if isinstance(value, tuple) else (value,)


def inputs(case: Case, seed: int = 1) -> dict:
    return case.inputs(torch.Generator().manual_seed(seed))


def run_step(model: nn.Module, case: Case, seed: int = 1) -> Step:
    """One forward + backward (the loss of gradseam.testing.run_step), with no hook of its own."""
    model.zero_grad(set_to_none=True)
    x = inputs(case, seed)
    outputs = outputs_of(case, model(**x))
    loss_of(outputs).backward()
    return collect(model, x, outputs)


# -- exceptions in forward ---------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["block", "attention", "mlp"])
@matrix
def test_exception_in_forward_leaves_nothing(case, name, where):
    model, handle = patched(case, name)
    assert_same_step(reference(case), run_step(model, case))
    hook = site(model, case, where).register_forward_pre_hook(raise_once(lambda: RuntimeError("injected fault")))
    assert "injected fault" in failure(lambda: run_step(model, case))
    hook.remove()
    assert_clean(handle, "right after the fault")
    assert_same_step(reference(case), run_step(model, case), what="step after the fault")
    assert_clean(handle, "after the next step")


@pytest.mark.parametrize("where", ["block", "attention"])
@matrix
def test_keyboard_interrupt_in_forward(case, name, where):
    model, handle = patched(case, name)
    hook = site(model, case, where).register_forward_pre_hook(raise_once(KeyboardInterrupt))
    failure(lambda: run_step(model, case), KeyboardInterrupt)
    hook.remove()
    gc.collect()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not inside_region()
    # torch runs always-called forward hooks for Exception only, so what a chain kept for its later
    # members is dropped when the model's next forward starts (any forward, even under no_grad).
    with torch.no_grad():
        model(**inputs(case))
    assert_clean(handle, "after a no_grad forward")
    assert_same_step(reference(case), run_step(model, case), what="step after the interrupt")
    assert_clean(handle, "after the next step")


# -- exceptions in backward -----------------------------------------------------------------------------


class _FailingBackward(torch.autograd.Function):
    armed: list[int] = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _FailingBackward.armed:
            _FailingBackward.armed.clear()
            raise RuntimeError("injected fault in backward")
        return grad


def _grad_hook_fault(model, case):
    raiser = raise_once(lambda: RuntimeError("injected fault in a tensor hook"))

    def hook(module, args, out):
        if hidden(out).requires_grad:
            hidden(out).register_hook(raiser)

    return block(model, case).register_forward_hook(hook)


def _function_fault(model, case):
    _FailingBackward.armed[:] = [1]
    return site(model, case, "attention").register_forward_hook(lambda m, a, out: _FailingBackward.apply(out))


def _recompute_fault(model, case):
    calls: list[int] = []

    def hook(module, args):
        if torch.is_grad_enabled():
            calls.append(1)
            if len(calls) == 2:  # the first call is the forward, the second its recompute in backward
                raise RuntimeError("injected fault in a recompute")

    return site(model, case, "attention").register_forward_pre_hook(hook)


FAULTS = {"tensor-hook": _grad_hook_fault, "function": _function_fault, "recompute": _recompute_fault}
BACKWARD_MATRIX = [
    (case, name, how) for case, name in MATRIX for how in FAULTS if how != "recompute" or name in RECOMPUTES_ATTENTION
]


@pytest.mark.parametrize(
    ("case", "name", "how"), BACKWARD_MATRIX, ids=[f"{c.name}-{n}-{h}" for c, n, h in BACKWARD_MATRIX]
)
def test_exception_in_backward_leaves_nothing(case, name, how):
    model, handle = patched(case, name)
    hook = FAULTS[how](model, case)
    assert "injected fault" in failure(lambda: run_step(model, case))
    hook.remove()
    _FailingBackward.armed.clear()
    # torch's autograd engine keeps the tasks still queued when a backward fails (and with them
    # that graph, patched or not) until the next backward on this thread starts: run a tiny one.
    x = torch.ones(2, requires_grad=True)
    (x * 2).sum().backward()
    assert_clean(handle, "right after the fault")
    assert_same_step(reference(case), run_step(model, case), what="step after the fault")
    assert_clean(handle, "after the next step")


# -- backward twice --------------------------------------------------------------------------------------


def _second_backward_error(model: nn.Module, case: Case, of_block: bool) -> str:
    captured = []
    hook = block(model, case).register_forward_hook(lambda m, a, out: captured.append(hidden(out)))
    outputs = outputs_of(case, model(**inputs(case)))
    hook.remove()
    loss = captured[0].square().mean() if of_block else loss_of(outputs)
    loss.backward()
    return failure(loss.backward)


def _retained_twice(model: nn.Module, case: Case) -> Step:
    """Backward twice with retain_graph=True: gradients add up."""
    model.zero_grad(set_to_none=True)
    x = inputs(case)
    outputs = outputs_of(case, model(**x))
    loss = loss_of(outputs)
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)
    return collect(model, x, outputs)


@matrix
def test_backward_twice(case, name):
    model, handle = patched(case, name)
    for of_block in (False, True):  # the model's loss, and a loss on one block's output
        expected = unpatched(case, "second backward", _second_backward_error, of_block)
        assert "backward through the graph a second time" in expected
        assert _second_backward_error(model, case, of_block) == expected
        assert_clean(handle, "after a refused second backward")
    got = _retained_twice(model, case)
    assert_same_step(unpatched(case, "retained", _retained_twice), got, what="retain_graph twice")
    assert_clean(handle, "after retain_graph twice")
    assert_same_step(reference(case), run_step(model, case), what="step after")


# -- forward without backward, accumulation ----------------------------------------------------------------


def _forward_only(model: nn.Module, case: Case, mode: str, grad: bool) -> torch.Tensor:
    model.train(mode == "train")
    with torch.set_grad_enabled(grad):
        out = model(**inputs(case, 5))[0]
    model.train()
    return out


@matrix
def test_forward_without_backward_then_step(case, name):
    model, handle = patched(case, name)
    for mode in ("train", "eval"):
        for grad in (False, True):  # validation under no_grad, and without it: a graph nobody backwards
            got = _forward_only(model, case, mode, grad)
            assert got.requires_grad == grad
            assert torch.equal(unpatched(case, "forward only", _forward_only, mode, grad), got), (mode, grad)
            del got
            assert_clean(handle, f"after a forward without backward ({mode}, grad={grad})")
    assert_same_step(reference(case), run_step(model, case), what="step after forwards without backward")


def _accumulate(model: nn.Module, case: Case) -> Step:
    """Two forwards, one backward of the summed loss."""
    model.zero_grad(set_to_none=True)
    first, second = inputs(case, 1), inputs(case, 2)
    out1 = outputs_of(case, model(**first))
    out2 = outputs_of(case, model(**second))
    (loss_of(out1) + loss_of(out2)).backward()
    step1, step2 = collect(model, first, out1), collect(model, second, out2)
    grads = {**{f"1.{k}": v for k, v in step1.input_grads.items()}, **{f"2.{k}": v for k, v in step2.input_grads.items()}}
    return Step(step1.outputs + step2.outputs, grads, step1.param_grads, 0)


@matrix
def test_gradient_accumulation_over_two_forwards(case, name):
    model, handle = patched(case, name)
    expected = unpatched(case, "accumulate", _accumulate)
    assert_same_step(expected, _accumulate(model, case), what="accumulated")
    assert_clean(handle, "after accumulation")
    assert_same_step(expected, _accumulate(model, case), what="accumulated again")


# -- grad mode toggled around one block ---------------------------------------------------------------------


def _toggle(target: nn.Module, inside: bool, captured: list) -> list:
    def pre(module, args):
        torch.set_grad_enabled(inside)

    def post(module, args, out):
        captured.append(hidden(out))
        torch.set_grad_enabled(not inside)

    return [target.register_forward_pre_hook(pre), target.register_forward_hook(post)]


def _no_grad_block_step(model: nn.Module, case: Case, k: int) -> Step:
    captured: list = []
    hooks = _toggle(block(model, case, k), False, captured)
    step = run_step(model, case)
    for h in hooks:
        h.remove()
    assert not captured[0].requires_grad
    return step


def _grad_block_in_no_grad(model: nn.Module, case: Case, k: int) -> Step:
    model.zero_grad(set_to_none=True)
    captured: list = []
    hooks = _toggle(block(model, case, k), True, captured)
    with torch.no_grad():
        out = outputs_of(case, model(**inputs(case)))
    for h in hooks:
        h.remove()
    assert captured[0].requires_grad and not out[0].requires_grad
    captured[0].square().mean().backward()  # only the one block has a graph
    return Step(out + (captured[0].detach(),), {}, collect(model, {}, ()).param_grads, 0)


@pytest.mark.parametrize("k", [0, 1], ids=["head", "follower"])
@matrix
def test_no_grad_block_inside_a_training_step(case, name, k):
    model, handle = patched(case, name)
    got = _no_grad_block_step(model, case, k)
    assert_same_step(unpatched(case, "no_grad block", _no_grad_block_step, k), got, what="block under no_grad")
    assert_clean(handle, "after the step")
    assert_same_step(reference(case), run_step(model, case), what="normal step after")


@pytest.mark.parametrize("k", [0, 1], ids=["head", "follower"])
@matrix
def test_grad_block_inside_a_no_grad_forward(case, name, k):
    model, handle = patched(case, name)
    got = _grad_block_in_no_grad(model, case, k)
    expected = unpatched(case, "grad block", _grad_block_in_no_grad, k)
    assert_same_step(expected, got, what="block under enable_grad in a no_grad forward")
    assert got.param_grads and all(f".{k}." in n for n in got.param_grads)
    assert_clean(handle, "after the forward")
    assert_same_step(reference(case), run_step(model, case), what="normal step after")
