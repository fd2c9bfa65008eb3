"""gradseam stacked with diffusers' own hooks and with torch.compile, on the CPU.

diffusers hooks (``apply_group_offloading``, ``enable_layerwise_casting``) replace ``module.forward``
per instance, as gradseam does; whichever is installed later wraps the other. A hook installed
*after* gradseam wraps the seam, so its pre/post work (cast weights to the compute dtype, onload
them) runs around the seam's call; a checkpoint recompute in backward must run it again, or it
would compute with bfloat16 weights (casting) or offloaded ones (group offloading on a GPU). The
tests run both orders and check the result against the same hooks without gradseam.

Group offloading runs here with ``onload_device=offload_device=cpu`` and ``use_stream=False``
(streams need an accelerator), so a skipped onload would not fail on its own: the tests also count
the hook's calls in backward and require the same in both orders. On CUDA (checked once on an
H200, not a test here) group offloading cannot train even without gradseam: ``post_forward`` moves
the weights back to the CPU before backward needs them ("weight is on cpu"). Layerwise casting
cannot be removed (diffusers raises on deinitialisation), so only gradseam's removal is checked
with it; on CUDA it matched casting-only in both orders for torch, torch-ffn and unsloth.

torch.compile (per-block, ``compile_repeated_blocks``; ``eager`` / ``aot_eager`` backends, cheap on
the CPU) must give the compiled-unpatched results, to 1e-6. What compiles, as of torch 2.13:

* ``-ffn`` backends: each block compiles to a graph with the FFN checkpoint inside (a higher-order
  op); exact. Every block instance has its own seam objects, which dynamo guards by identity, so
  each block compiles once for itself: at most ``torch._dynamo.config.recompile_limit`` (8) blocks
  are compiled, the rest run eagerly (still exact).
* ``torch``: each block compiles with its checkpoint inside (tests/test_compile.py proves it).
* ``unsloth``: the offload hooks read storage addresses (``UntypedStorage.data_ptr``), which dynamo
  cannot trace, so the block frame runs eagerly: correct, no speed-up from compile there; aot_eager
  then differs from compiled-unpatched by float rounding (the reference is compiled, the patched
  block is not).
"""

from __future__ import annotations

import copy

import pytest
import torch
from cases import FLUX, WAN, flux_inputs, wan_inputs
from diffusers.hooks import HookRegistry, apply_group_offloading
from diffusers.hooks import group_offloading as diffusers_group_offloading
from seam_probe import installed_seam

import gradseam
from gradseam.offload import cpu_test_mode
from gradseam.testing import Case, Step, assert_same_step, config_id, run_step

TORCH = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch"}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}
INTERVAL = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch", "gradient_checkpointing_interval": 2}
UNSLOTH = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"}
UNSLOTH_FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-ffn"}
CONFIGS = [TORCH, FFN, INTERVAL, UNSLOTH]
CASES = [FLUX, WAN]


def _base(case) -> torch.nn.Module:
    torch.manual_seed(case.seed)
    return case.build()


def _stack(model, config, hook, order):
    """Install gradseam and a diffusers hook in the given order; returns the gradseam handle."""
    with cpu_test_mode():
        if order == "gradseam-first":
            handle = gradseam.patch(model, config)
            hook(model)
        else:
            hook(model)
            handle = gradseam.patch(model, config)
    return handle


def _no_gradseam_left(model) -> None:
    assert gradseam.handle_of(model) is None
    assert not [n for n, m in model.named_modules() if installed_seam(m) is not None]


# -- group offloading -------------------------------------------------------------------------

GROUP_HOOKS = ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading")


def _group_offload(level):
    def apply(model):
        apply_group_offloading(model, onload_device="cpu", offload_device="cpu", offload_type=level,
                               num_blocks_per_group=1 if level == "block_level" else None, use_stream=False)
    return apply


def _remove_group_offload(model) -> None:
    registry = HookRegistry.check_if_exists_or_initialize(model)
    for name in GROUP_HOOKS:
        registry.remove_hook(name, recurse=True)


@pytest.fixture
def backward_onloads(monkeypatch):
    """Counts GroupOffloadingHook.pre_forward calls (the hook that onloads a group) in backward."""
    count = {"forward": 0, "backward": 0, "phase": "forward"}
    original = diffusers_group_offloading.GroupOffloadingHook.pre_forward

    def pre_forward(self, module, *args, **kwargs):
        count[count["phase"]] += 1
        return original(self, module, *args, **kwargs)

    monkeypatch.setattr(diffusers_group_offloading.GroupOffloadingHook, "pre_forward", pre_forward)
    return count


def _step_phases(model, case, count) -> Step:
    """run_step, with the onload counter switched to 'backward' between the two passes."""
    model.zero_grad(set_to_none=True)
    count.update(forward=0, backward=0, phase="forward")
    inputs = case.inputs(torch.Generator().manual_seed(1))
    outputs = case.output(model(**inputs))
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    count["phase"] = "backward"
    sum(o.square().mean() for o in outputs).backward()
    count["phase"] = "forward"
    return Step(
        tuple(o.detach() for o in outputs),
        {k: v.grad for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.grad is not None},
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        0,
    )


GROUP_MATRIX = [(c, lvl, k) for c in CASES for lvl in ("block_level", "leaf_level") for k in CONFIGS]


@pytest.mark.parametrize(
    ("case", "level", "config"), GROUP_MATRIX, ids=[f"{c.name}-{lvl}-{config_id(k)}" for c, lvl, k in GROUP_MATRIX]
)
def test_group_offloading_gradients_in_both_orders(case, level, config, backward_onloads):
    base = _base(case)
    hooked = copy.deepcopy(base)
    _group_offload(level)(hooked)
    reference = _step_phases(hooked, case, backward_onloads)
    assert backward_onloads["backward"] == 0  # nothing recomputes without gradseam
    onloads = {}
    for order in ("gradseam-first", "hooks-first"):
        model = copy.deepcopy(base)
        handle = _stack(model, config, _group_offload(level), order)
        with cpu_test_mode():
            assert_same_step(reference, _step_phases(model, case, backward_onloads), what=f"{order}")
        onloads[order] = backward_onloads["backward"]
        handle.remove()
    # a recompute onloads its group first, whichever was installed first
    assert onloads["gradseam-first"] == onloads["hooks-first"]
    if config is not FFN or level == "leaf_level":
        assert onloads["gradseam-first"] > 0


@pytest.mark.parametrize("removal", ["gradseam-then-hooks", "hooks-then-gradseam"])
@pytest.mark.parametrize("order", ["gradseam-first", "hooks-first"])
@pytest.mark.parametrize("level", ["block_level", "leaf_level"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_group_offloading_and_gradseam_remove_in_any_order(case, level, order, removal):
    base = _base(case)
    untouched = run_step(copy.deepcopy(base), case)
    hooks_only = copy.deepcopy(base)  # diffusers leaves attributes behind on its own; compare with that
    _group_offload(level)(hooks_only)
    _remove_group_offload(hooks_only)
    run_step(hooks_only, case)
    model = copy.deepcopy(base)
    handle = _stack(model, FFN if level == "leaf_level" else INTERVAL, _group_offload(level), order)
    run_step(model, case)
    if removal == "gradseam-then-hooks":
        handle.remove()
        _remove_group_offload(model)
    else:
        _remove_group_offload(model)
        handle.remove()
    after = run_step(model, case)  # a pass-through seam a hook put back unlinks itself on this call
    assert_same_step(untouched, after, what=f"{order}, {removal}")
    _no_gradseam_left(model)
    sd, ref_sd = model.state_dict(), base.state_dict()
    assert list(sd) == list(ref_sd) and all(torch.equal(sd[k], ref_sd[k]) for k in sd)
    extra = {
        name: set(m.__dict__) - set(hooks_only.get_submodule(name).__dict__) for name, m in model.named_modules()
    }
    assert not {k: v for k, v in extra.items() if v}, "attributes left beyond what diffusers itself leaves"


# -- layerwise casting ------------------------------------------------------------------------


def _cast(model):
    model.enable_layerwise_casting(storage_dtype=torch.bfloat16, compute_dtype=torch.float32)


CAST_MATRIX = [(c, k) for c in CASES for k in [*CONFIGS, UNSLOTH_FFN]]


@pytest.mark.parametrize("order", ["gradseam-first", "hooks-first"])
@pytest.mark.parametrize(("case", "config"), CAST_MATRIX, ids=[f"{c.name}-{config_id(k)}" for c, k in CAST_MATRIX])
def test_layerwise_casting_gradients_in_both_orders(case, config, order):
    """Flux torch-ffn, gradseam first, is the case that needs the recompute to re-run the hook:
    its FFN seam starts at the ``proj_mlp`` Linear, which carries a casting hook itself."""
    base = _base(case)
    cast_only = copy.deepcopy(base)
    _cast(cast_only)
    reference = run_step(cast_only, case)
    model = copy.deepcopy(base)
    handle = _stack(model, config, _cast, order)
    with cpu_test_mode():
        patched = run_step(model, case)
    assert_same_step(reference, patched, what=f"{case.name} {config_id(config)} {order}")
    assert patched.saved_bytes < reference.saved_bytes
    handle.remove()  # casting stays (diffusers cannot remove it): the model is the cast-only one again
    assert_same_step(reference, run_step(model, case), what="after remove()")
    _no_gradseam_left(model)


def test_casting_group_offloading_and_gradseam_together():
    base = _base(FLUX)
    reference_model = copy.deepcopy(base)
    _cast(reference_model)
    _group_offload("block_level")(reference_model)
    reference = run_step(reference_model, FLUX)
    model = copy.deepcopy(base)
    handle = gradseam.patch(model, FFN)
    _cast(model)
    _group_offload("block_level")(model)
    assert_same_step(reference, run_step(model, FLUX))
    handle.remove()
    _remove_group_offload(model)
    assert_same_step(reference, run_step(model, FLUX))
    _no_gradseam_left(model)


# -- torch.compile ----------------------------------------------------------------------------


def _small_flux():
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=[2, 2, 4],
    )


def _small_wan():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
    )


SMALL = [Case("flux", _small_flux, flux_inputs), Case("wan", _small_wan, wan_inputs)]


def _compiled_step(model, case) -> Step:
    # run_step's saved-bytes counter is a saved-tensors hook dynamo would trace (and recompile) too
    model.zero_grad(set_to_none=True)
    inputs = case.inputs(torch.Generator().manual_seed(1))
    outputs = case.output(model(**inputs))
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    sum(o.square().mean() for o in outputs).backward()
    return Step(
        tuple(o.detach() for o in outputs),
        {k: v.grad for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.grad is not None},
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        0,
    )


# aot_eager runs AOT autograd over the checkpoint (the stronger test); one eager run checks exactness.
# The offload backends run on the smaller (cheaper to compile) Wan model only. Under `-m compiled` only
# (pyproject.toml deselects the mark by default): the torch rows, which tests/test_compile.py's
# test_whole_block_regions_compile runs with the same cases, config and compile against the same reference,
# checking that each compiled graph holds the checkpoint; and Flux's rows of the configs Wan's rows run too
# (~17 s of compiling on the project's 2-core machine, the suite's 10-minute aim).
def _compiled_only(case: Case, config: dict) -> list:
    return [pytest.mark.compiled] if config is TORCH or case.name == "flux" else []


COMPILE_MATRIX = [pytest.param(c, k, "aot_eager", marks=_compiled_only(c, k)) for c in SMALL for k in (TORCH, FFN)]
COMPILE_MATRIX += [(SMALL[1], k, "aot_eager") for k in (UNSLOTH, UNSLOTH_FFN)] + [(SMALL[1], FFN, "eager")]
# whole blocks keeping attention: compiled regions use torch's selective checkpoint (kernels kept on the
# device); with offload the eager path around the compiled code still moves the region inputs
KEEP = {**TORCH, "gradient_checkpointing_keep_attention": True}
UNSLOTH_OFFLOAD = {**UNSLOTH, "gradient_checkpointing_offload_attention": True}
COMPILE_MATRIX += [pytest.param(c, KEEP, "aot_eager", marks=_compiled_only(c, KEEP)) for c in SMALL]
COMPILE_MATRIX += [(SMALL[1], UNSLOTH_OFFLOAD, "aot_eager")]
_compiled_references: dict[tuple[str, str], Step] = {}


def _compiled_reference(case, backend) -> Step:
    key = (case.name, backend)
    if key not in _compiled_references:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = case.build()
        model.compile_repeated_blocks(backend=backend)
        _compiled_references[key] = _compiled_step(model, case)
    return _compiled_references[key]


@pytest.mark.parametrize(
    ("case", "config", "backend"), COMPILE_MATRIX,
    ids=[f"{c.name}-{config_id(k)}-{b}" for c, k, b in (getattr(p, "values", p) for p in COMPILE_MATRIX)],
)
def test_compiled_blocks_match_compiled_unpatched(case, config, backend):
    reference = _compiled_reference(case, backend)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = case.build()
    compiling: list[bool] = []  # for each batch of copies the engine issued: whether dynamo was tracing it
    with cpu_test_mode():
        handle = gradseam.patch(model, config)
        if handle.engine is not None:
            issue = handle.engine._issue

            def watched(device: torch.device, batch: list) -> None:
                compiling.append(torch.compiler.is_compiling())
                issue(device, batch)

            handle.engine._issue = watched
        model.compile_repeated_blocks(backend=backend)
        for step in (1, 2):
            got = _compiled_step(model, case)
            assert_same_step(reference, got, atol=1e-6 if backend != "eager" else 0.0, what=f"step {step}")
    # gradseam's regions ran inside the compiled blocks (attention seams count no calls)
    assert all(r.ran for r in handle.regions() if r.shape != "attention"), handle.regions()
    if handle.engine is not None:
        assert handle.engine.copies > 0  # the offload hooks ran (eagerly, around the compiled code)
        # and so did the copies they issue: traced, a CUDA copy's record_stream landed in an inductor graph, which
        # refused it (an H200; the CPU's copies have none, so only this says that the engine ran outside the graph)
        assert compiling and not any(compiling), compiling
    handle.remove()
    torch._dynamo.reset()


@pytest.mark.parametrize("config", [UNSLOTH, UNSLOTH_FFN], ids=config_id)
def test_an_offload_backend_on_a_group_offloaded_cpu_model_names_group_offloading(config):
    """Outside the CPU test mode, a group-offloaded model keeps its weights in CPU memory between uses: the
    refusal says so and names the two ways out (gradseam's weight streaming, or a backend that offloads
    nothing), instead of asking to move a model that group offloading would move back."""
    model = _base(WAN)
    _group_offload("block_level")(model)
    with pytest.raises(gradseam.UnsupportedStrategyError, match=(
            r"diffusers' group offloading on, which keeps its weights in CPU memory between uses.*"
            r"gradient_checkpointing_stream_weights.*backend 'torch(-ffn)?'")):
        gradseam.patch(model, config)
