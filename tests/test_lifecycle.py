"""A patched model through its ordinary life: dtype moves, train/eval, deepcopy, state dicts,
pickling, freezing, meta-device construction, several models at once, and re-patching.

Every check compares against an unpatched twin on the CPU in float32 (float64 where the test
moves the model there), to the bit.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import io
import weakref
from collections import Counter

import pytest
import torch
from cases import FLUX, WAN
from cases import STRATEGIES as CONFIGS
from seam_probe import installed_seam
from torch import nn

import gradseam
from gradseam.offload import cpu_test_mode
from gradseam.testing import Case, assert_same_step, run_step

NAMES = list(CONFIGS)
MATRIX = [(case, name) for case in (FLUX, WAN) for name in NAMES]
IDS = [f"{case.name}-{name}" for case, name in MATRIX]
matrix = pytest.mark.parametrize(("case", "name"), MATRIX, ids=IDS)


# -- helpers -------------------------------------------------------------------------------------


def build(case: Case, seed: int | None = None) -> nn.Module:
    torch.manual_seed(case.seed if seed is None else seed)
    return case.build()


def patch(model: nn.Module, name: str):
    with cpu_test_mode():  # lets the offload strategies run on the CPU model, through host buffers
        return gradseam.patch(model, CONFIGS[name])


_EXPECTED: dict = {}


def unpatched(case: Case, what: str, run=None, seed: int | None = None):
    """``run(twin)`` on an unpatched twin built with ``seed`` (default: a plain step); once per case."""
    key = (case.name, what, seed)
    if key not in _EXPECTED:
        _EXPECTED[key] = (run or (lambda m: run_step(m, case)))(build(case, seed))
    return _EXPECTED[key]


def regions(handle) -> int:
    """Checkpoint regions one training forward opens: every planned region runs exactly once."""
    return sum(1 for r in handle.plan.regions if r.shape != "attention")


def seamed(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if installed_seam(m) is not None]


def instance_forwards(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


def with_inputs(case: Case, transform) -> Case:
    def inputs(g: torch.Generator) -> dict:
        return {k: transform(v) if isinstance(v, torch.Tensor) else v for k, v in case.inputs(g).items()}

    return dataclasses.replace(case, inputs=inputs)


def as_float64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() else t


def perturb(model: nn.Module, amount: float = 0.25) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(amount)


def assert_points_at(model: nn.Module, handle) -> None:
    """Every wrapper of ``model`` calls into ``model``'s own modules, and its chains hold only them."""
    own = {id(m) for m in model.modules()}
    assert seamed(model), "nothing is patched"
    for name, module in seamed(model):
        seam = installed_seam(module)
        assert seam.module is module, f"{name}: the wrapper calls another model's module"
        chain = getattr(seam.handler, "chain", None)
        if chain is not None:
            assert all(id(m) in own for m in chain.members), f"{name}: chain members of another model"
            assert all(o is None or id(o.module) in own for o in chain._originals), name
        # AttentionOffload handlers and RegionScope runners both name their engine `.engine`
        offload = seam.handler if chain is None else chain.runner.scope
        if offload is not None and offload.engine is not None:
            assert offload.engine is handle.engine, f"{name}: offloads through another model's engine"


# -- dtype, train/eval ------------------------------------------------------------------------------


@matrix
def test_dtype_round_trip_and_train_eval(case, name, checkpoint_calls):
    model = build(case)
    handle = patch(model, name)
    reference = unpatched(case, "step")
    case64 = with_inputs(case, as_float64)
    checkpoint_calls.clear()
    assert_same_step(reference, run_step(model, case), what="float32")
    assert len(checkpoint_calls) == regions(handle)

    model.to(torch.float64)
    checkpoint_calls.clear()
    copies = handle.engine.copies if handle.engine is not None else 0
    got = run_step(model, case64)
    assert got.outputs[0].dtype == torch.float64
    assert_same_step(unpatched(case, "float64", lambda m: run_step(m.to(torch.float64), case64)), got, what="float64")
    assert len(checkpoint_calls) == regions(handle)
    if handle.engine is not None:
        assert handle.engine.copies > copies, "float64 activations were not offloaded"

    model.to(torch.float32)
    assert_same_step(reference, run_step(model, case), what="back to float32")

    model.eval()
    checkpoint_calls.clear()
    assert_same_step(unpatched(case, "eval", lambda m: run_step(m.eval(), case)), run_step(model, case), what="eval")
    assert len(checkpoint_calls) == regions(handle)  # eval() is not no_grad: still checkpointed
    model.train()
    assert_same_step(reference, run_step(model, case), what="train again")
    assert gradseam.handle_of(model) is handle and handle.active
    assert_points_at(model, handle)


# -- deepcopy ---------------------------------------------------------------------------------------


def _perturbed_step(case: Case):
    def run(model: nn.Module):
        perturb(model)
        return run_step(model, case)

    return run


@matrix
def test_deepcopy_is_patched_on_its_own_modules(case, name, checkpoint_calls):
    model = build(case)
    handle = patch(model, name)
    reference = unpatched(case, "step")
    assert_same_step(reference, run_step(model, case))  # leave whatever a step leaves behind

    clone = copy.deepcopy(model)
    clone_handle = gradseam.handle_of(clone)
    assert clone_handle is not None and clone_handle is not handle
    assert clone_handle.active and clone_handle.model is clone
    assert gradseam.handle_of(model) is handle
    assert [n for n, _ in seamed(clone)] == [n for n, _ in seamed(model)]
    assert_points_at(clone, clone_handle)
    if handle.engine is not None:
        assert clone_handle.engine is not handle.engine and clone_handle.engine.store.checked_out == 0
        watched = getattr(clone_handle.engine, "_model", None)  # the engine knows whose weights to leave alone
        assert watched is None or watched() is clone

    # The copy follows its own weights: changing the original's must not reach it.
    perturb(model)
    checkpoint_calls.clear()
    copies = clone_handle.engine.copies if clone_handle.engine is not None else 0
    assert_same_step(reference, run_step(clone, case), what="copy after perturbing the original")
    assert len(checkpoint_calls) == regions(clone_handle) == regions(handle)  # and still checkpoints
    if clone_handle.engine is not None:
        assert clone_handle.engine.copies > copies, "the copy no longer offloads"

    # ... and the original follows its new weights, still patched.
    perturbed = unpatched(case, "perturbed", _perturbed_step(case))
    assert_same_step(perturbed, run_step(model, case), what="perturbed original")

    clone_handle.remove()
    assert instance_forwards(clone) == [] and gradseam.handle_of(clone) is None
    assert handle.active and gradseam.handle_of(model) is handle and seamed(model)


def test_patched_models_are_not_kept_alive():
    """Nothing global holds a patched model: dropping it (and its handle) frees it."""
    model = build(WAN)
    handle = patch(model, "unsloth-interval2")
    run_step(model, WAN)
    ref = weakref.ref(model)
    del model, handle
    gc.collect()
    assert ref() is None


# -- state dicts and pickling --------------------------------------------------------------------------


@matrix
def test_state_dict_round_trip(case, name):
    twin, model = build(case), build(case)
    keys = list(twin.state_dict())
    patch(model, name)
    assert list(model.state_dict()) == keys
    other = build(case, seed=7)  # different weights
    model.load_state_dict(other.state_dict())  # strict: every key matches
    expected = unpatched(case, "step", seed=7)
    assert_same_step(expected, run_step(model, case), what="loaded into the patched model")
    twin.load_state_dict(model.state_dict())  # and out of it, into an unpatched model
    assert_same_step(expected, run_step(twin, case), what="loaded from the patched model")


@matrix
def test_pickle_whole_model(case, name, checkpoint_calls):
    model = build(case)
    handle = patch(model, name)
    reference = unpatched(case, "step")
    run_step(model, case)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)

    loaded_handle = gradseam.handle_of(loaded)
    assert loaded_handle is not None and loaded_handle is not handle and loaded_handle.model is loaded
    assert_points_at(loaded, loaded_handle)
    perturb(model)  # the loaded model owns its weights
    checkpoint_calls.clear()
    assert_same_step(reference, run_step(loaded, case), what="unpickled")
    assert len(checkpoint_calls) == regions(loaded_handle)
    if loaded_handle.engine is not None:
        assert loaded_handle.engine.copies > 0 and loaded_handle.engine.store.checked_out == 0
        watched = getattr(loaded_handle.engine, "_model", None)
        assert watched is None or watched() is loaded
    loaded_handle.remove()
    assert instance_forwards(loaded) == []
    assert_same_step(reference, run_step(loaded, case), what="unpickled, then removed")


# The backends and variants the matrix above leaves out, whose regions hold more: kernel outputs kept on the device
# or offloaded (the kernel set's memos, keyed by torch's own callables), a compiled block (its compiled functions and
# weak per-block maps).
COPIED = {
    "unsloth + attention offload": {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth",
                                    "gradient_checkpointing_offload_attention": True},
    "torch-ffn + attention kept": {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn",
                                   "gradient_checkpointing_keep_attention": True},
    "unsloth-compile": {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-compile"},
}


@pytest.mark.parametrize("name", list(COPIED))
def test_deep_copies_and_pickles_of_the_other_backends_train_on_their_own(name):
    """After a step (when the regions' caches are full), ``copy.deepcopy`` and ``torch.save`` of the whole model give
    a patched copy that steps like the unpatched model, and ``remove()`` restores each; the original is unchanged.
    (Before, the kernel set's memos made both fail, and a compiled block's caches made pickling fail.)"""
    from gradseam.testing import COMPILED_TOLERANCE

    atol = COMPILED_TOLERANCE if "compile" in name else 0.0
    reference = unpatched(WAN, "step")
    model = build(WAN)
    with cpu_test_mode():
        handle = gradseam.patch(model, COPIED[name])
        run_step(model, WAN)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        for copied in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
            other = gradseam.handle_of(copied)
            assert other is not None and other is not handle and other.model is copied
            assert_same_step(reference, run_step(copied, WAN), atol=atol, what=f"{name}: a copy")
            other.remove()
            assert_same_step(reference, run_step(copied, WAN), atol=atol, what=f"{name}: a copy, removed")
        assert_same_step(reference, run_step(model, WAN), atol=atol, what=f"{name}: the original")
        handle.remove()


# -- freezing ------------------------------------------------------------------------------------------


def _lora_like(name: str) -> bool:
    return ".to_q." in name or ".to_v." in name


@matrix
def test_requires_grad_changes_give_exact_grads(case, name, checkpoint_calls):
    model = build(case)
    handle = patch(model, name)
    frozen_inputs = with_inputs(case, lambda t: t.detach())
    last = "single_transformer_blocks.4" if case is FLUX else "blocks.4"  # the model's last block
    phases = [
        ("lora-like", _lora_like, case),
        ("last block only, inputs frozen", lambda n: n.startswith(last + "."), frozen_inputs),
        ("nothing but the inputs", lambda n: False, case),
        ("everything again", lambda n: True, case),
    ]
    for what, trainable, feed in phases:

        def freeze(m: nn.Module, trainable=trainable) -> nn.Module:
            for n, p in m.named_parameters():
                p.requires_grad_(trainable(n))
            return m

        freeze(model)
        checkpoint_calls.clear()
        got = run_step(model, feed)
        expected = unpatched(case, what, lambda m, freeze=freeze, feed=feed: run_step(freeze(m), feed))
        assert_same_step(expected, got, what=what)
        assert sorted(got.param_grads) == sorted(n for n, _ in model.named_parameters() if trainable(n)), what
        assert len(checkpoint_calls) == regions(handle), what
        if handle.engine is not None:
            assert handle.engine.store.checked_out == 0


# -- meta device ----------------------------------------------------------------------------------------


@matrix
def test_patch_on_meta_then_materialize(case, name, checkpoint_calls):
    reference = build(case)  # its state dict is what the meta model loads
    with torch.device("meta"):
        model = build(case)
    assert next(model.parameters()).is_meta
    handle = patch(model, name)
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    # Non-persistent buffers (Wan's rotary tables) are not in a state dict; a meta-initialised
    # model gets them from its constructor code or, as here, from the reference.
    persistent = set(reference.state_dict())
    for buffer_name, buffer in reference.named_buffers():
        if buffer_name not in persistent:
            model.get_buffer(buffer_name).copy_(buffer)
    assert gradseam.handle_of(model) is handle and handle.active
    assert_points_at(model, handle)
    checkpoint_calls.clear()
    assert_same_step(unpatched(case, "step"), run_step(model, case), what="materialized from meta")
    assert len(checkpoint_calls) == regions(handle)
    if handle.engine is not None:
        assert handle.engine.copies > 0


# -- several models, re-patching -----------------------------------------------------------------------


@matrix
def test_two_models_with_different_configs_stay_independent(case, name, checkpoint_calls):
    other_name = NAMES[(NAMES.index(name) + 3) % len(NAMES)]
    a, b = build(case), build(case, seed=1)
    ref_a, ref_b = unpatched(case, "step"), unpatched(case, "step", seed=1)
    handle_a = patch(a, name)
    handle_b = patch(b, other_name)
    assert gradseam.handle_of(a) is handle_a and gradseam.handle_of(b) is handle_b
    if handle_a.engine is not None and handle_b.engine is not None:
        assert handle_a.engine is not handle_b.engine
    assert_points_at(a, handle_a)
    assert_points_at(b, handle_b)
    for step in (1, 2):  # interleaved steps
        for model, handle, ref, label in ((a, handle_a, ref_a, name), (b, handle_b, ref_b, other_name)):
            checkpoint_calls.clear()
            assert_same_step(ref, run_step(model, case), what=f"{label} step {step}")
            assert len(checkpoint_calls) == regions(handle), label
    assert handle_a.config.describe() in str(handle_a.summary())
    assert handle_b.config.describe() in str(handle_b.summary())

    handle_a.remove()
    checkpoint_calls.clear()
    assert_same_step(ref_a, run_step(a, case), what="a removed")
    assert checkpoint_calls == []
    assert handle_b.active and gradseam.handle_of(b) is handle_b
    assert_same_step(ref_b, run_step(b, case), what="b after a removed")
    assert len(checkpoint_calls) == regions(handle_b)


def _count_class_forwards(monkeypatch, modules) -> Counter:
    """Counts calls of ``type(m).forward`` per module object (what a wrapper finally reaches)."""
    counts: Counter = Counter()
    for cls in {type(m) for m in modules}:
        real = cls.forward

        def make(real=real):
            @functools.wraps(real)
            def counting(self, *args, **kwargs):
                counts[id(self)] += 1
                return real(self, *args, **kwargs)

            return counting

        monkeypatch.setattr(cls, "forward", make())
    return counts


def _forward_backward_counts(model: nn.Module, case: Case, counts: Counter) -> tuple[dict, dict]:
    names = {id(m): n for n, m in seamed(model)}
    counts.clear()
    model.zero_grad(set_to_none=True)
    out = case.output(model(**case.inputs(torch.Generator().manual_seed(1))))
    forward = {names[k]: v for k, v in counts.items() if k in names}
    counts.clear()
    sum(o.square().mean() for o in (out if isinstance(out, tuple) else (out,))).backward()
    backward = {names[k]: v for k, v in counts.items() if k in names}
    return forward, backward


@pytest.mark.parametrize("via", ["same-model", "deepcopy"])
@matrix
def test_repatch_replaces_without_double_wrapping(case, name, via, monkeypatch, checkpoint_calls):
    second = NAMES[(NAMES.index(name) + 1) % len(NAMES)]
    model = build(case)
    reference = unpatched(case, "step")
    first_handle = patch(model, name)
    run_step(model, case)
    if via == "deepcopy":  # the copy carries its own handle (so does an unpickled model: same mechanism)
        model = copy.deepcopy(model)
    previous = gradseam.handle_of(model)
    assert previous is not None and (previous is first_handle) == (via == "same-model")
    handle = patch(model, second)
    assert not previous.active and gradseam.handle_of(model) is handle
    for n, m in seamed(model):
        assert installed_seam(m).original.previous is None, f"{n}: wraps an older wrapper"

    fresh = build(case)
    fresh_handle = patch(fresh, second)
    # no hook left over from the first patch either
    assert len(model._forward_pre_hooks) == len(fresh._forward_pre_hooks)
    assert len(model._forward_hooks) == len(fresh._forward_hooks)
    assert [n for n, _ in seamed(model)] == [n for n, _ in seamed(fresh)]
    counts = _count_class_forwards(monkeypatch, [m for _, m in seamed(model)])
    expected = _forward_backward_counts(fresh, case, counts)
    checkpoint_calls.clear()
    got = _forward_backward_counts(model, case, counts)
    assert len(checkpoint_calls) == regions(handle) == regions(fresh_handle)
    assert got == expected  # each module's own forward is reached as often as under a single patch
    assert set(got[0].values()) == {1}  # once per call in forward
    assert_same_step(reference, run_step(model, case), what=f"{name} then {second} via {via}")
    handle.remove()
    assert instance_forwards(model) == [] and not model._forward_pre_hooks and not model._forward_hooks
    assert_same_step(reference, run_step(model, case), what="removed")
