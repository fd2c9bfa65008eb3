"""The compiled backends under what real training loops do to them (reliability round 4).

Each case runs a patched model against an unpatched twin built from the same seed, the same steps in the
same order, and compares every output and gradient (to the compiled tolerance), which parameters have no
gradient at all (``None``, which an optimizer skips, against zeros, which it steps), and where the random
generator is left. On the CPU the compiled blocks run ``aot_eager``: the same partitioner under the same
memory budget as inductor on a GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from cases import FLUX, MAGEFLOW
from peft import LoraConfig, get_peft_model

import gradseam
from gradseam.offload import cpu_test_mode
from gradseam.testing import COMPILED_TOLERANCE

ON = {"gradient_checkpointing": True}
COMPILE = {**ON, "gradient_checkpointing_backend": "compile"}
OFFLOADED = {**ON, "gradient_checkpointing_backend": "unsloth-compile"}
BACKENDS = [COMPILE, OFFLOADED]
IDS = ["compile", "unsloth-compile"]
# Where what a test checks is the compiled call and the reach probe around it (unused outputs, adapters, hooks, the
# generator), `unsloth-compile` runs the same compiled function and probe as `compile`, inside the offload group:
# its row covers `compile`'s, which runs under `-m compiled` only (pyproject.toml deselects the mark by default) to
# keep the suite within CI's time. Tests of compile settings that the offload would hide (donated buffers: the
# offload reloads a second backward's tensors) keep both rows in the default run.
COVERED = [pytest.param(COMPILE, id="compile", marks=pytest.mark.compiled), pytest.param(OFFLOADED, id="unsloth-compile")]
# MageFlow's last block returns a text stream nothing reads: these parameters reach only that output.
TEXT_ONLY = ("attn.to_add_out", "txt_mlp")


def _build(case):
    torch.manual_seed(case.seed)
    return case.build()


def _loss(case, model, seed: int) -> torch.Tensor:
    out = case.output(model(**case.inputs(torch.Generator().manual_seed(seed))))
    return out.float().square().mean()


def _grads(model) -> dict[str, torch.Tensor | None]:
    return {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def _same(want: dict, got: dict, what: str) -> None:
    assert want.keys() == got.keys(), what
    nones = {n for n, g in want.items() if g is None}
    assert nones == {n for n, g in got.items() if g is None}, f"{what}: None gradients differ"
    for name, grad in want.items():
        if grad is not None:
            assert torch.allclose(got[name], grad, atol=COMPILED_TOLERANCE, rtol=COMPILED_TOLERANCE), f"{what}: {name}"


def _twin_run(case, config: dict, loop, *, prepare=None) -> tuple[list, list]:
    """``loop(model)`` on an unpatched model and on a patched twin (``prepare`` first on both)."""
    torch._dynamo.reset()
    results = []
    for patched in (False, True):
        model = _build(case)
        if prepare is not None:
            model = prepare(model)
        torch.manual_seed(7)  # the loop's own draws (dropout) start from the same generator state
        if patched:
            with cpu_test_mode(), gradseam.patch(model, config):
                results.append(loop(model))
        else:
            results.append(loop(model))
    return results[0], results[1]


# -- random ops: the masks backward sees are the forward's, and the generator is left in place --------


def _lora_with_dropout(model):
    model.requires_grad_(False)
    torch.manual_seed(123)
    config = LoraConfig(r=4, lora_alpha=4, lora_dropout=0.1, init_lora_weights="gaussian",
                        target_modules=["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"])
    return get_peft_model(model, config)


# The default budget (DEFAULT_MEMORY_BUDGET, 0.1) is below 1 already: with the random ops left unmarked
# (gradseam.run.compiler.save_random_ops made a no-op) the None rows fail as the 0.05 ones do, so the 0.05 rows
# run under `-m compiled` only (pyproject.toml deselects the mark by default), covered by the None rows.
@pytest.mark.parametrize("budget", [None, pytest.param(0.05, marks=pytest.mark.compiled)])
@pytest.mark.parametrize("config", COVERED)
def test_lora_dropout_in_compiled_blocks_keeps_its_masks_and_the_generator(config, budget):
    """PEFT LoRA dropout 0.1 on Flux: under a budget below 1 the partitioner would recompute the dropout in
    backward with fresh draws (gradients off by ~2e-3, the generator moved on)."""
    from gradseam.config import DEFAULT_MEMORY_BUDGET

    assert (budget or DEFAULT_MEMORY_BUDGET) < 1  # a budget that recomputes, or the rows would not tell
    config = {**config, "gradient_checkpointing_memory_budget": budget} if budget else config

    def loop(model):
        seen = []
        for seed in (1, 2):
            model.zero_grad(set_to_none=True)
            _loss(FLUX, model, seed).backward()
            seen.append((_grads(model), torch.get_rng_state()))
        return seen

    eager, patched = _twin_run(FLUX, config, loop, prepare=_lora_with_dropout)
    for step, ((want, want_rng), (got, got_rng)) in enumerate(zip(eager, patched)):
        assert any(g is not None for g in want.values())
        _same(want, got, f"step {step}")
        assert torch.equal(want_rng, got_rng), f"step {step}: the generator is not where eager leaves it"


def test_random_ops_are_marked_saved_in_the_joint_graph():
    """The marking itself, on a graph with dropout, rand_like and a plain op."""
    from torch.utils.checkpoint import CheckpointPolicy

    from gradseam.run.compiler import save_random_ops

    def f(x):
        return torch.nn.functional.dropout(x, 0.5) + torch.rand_like(x) + x.sin()

    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.randn(3))
    assert save_random_ops(gm) >= 2
    marked = [n for n in gm.graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_SAVE]
    assert marked and all("sin" not in str(n.target) for n in marked)


# -- parameters that only an unused output reaches: None, never a lost gradient ----------------------


def _two_steps(model, *, between=None, penalty: float = 0.0):
    seen = []
    for seed in (1, 2):
        model.zero_grad(set_to_none=True)
        loss = _loss(MAGEFLOW, model, seed)
        if penalty:
            loss = loss + penalty * sum(p.square().sum() for p in model.parameters() if p.requires_grad)
        loss.backward()
        seen.append(_grads(model))
        if between is not None and seed == 1:
            between(model)
    return seen


@pytest.mark.parametrize("config", COVERED)
def test_a_penalty_on_the_weights_keeps_its_gradient_where_an_output_is_unused(config):
    eager, patched = _twin_run(MAGEFLOW, config, lambda m: _two_steps(m, penalty=1e-3))
    text_only = [n for n in eager[0] if n.startswith("transformer_blocks.4.") and any(k in n for k in TEXT_ONLY)]
    assert text_only and all(eager[0][n] is not None for n in text_only)  # the penalty reaches them
    for step, (want, got) in enumerate(zip(eager, patched)):
        _same(want, got, f"step {step}")


@pytest.mark.parametrize("config", COVERED)
def test_weights_reloaded_with_assign_after_a_step_keep_training(config):
    """``load_state_dict(..., assign=True)`` gives the block new Parameter objects, whose ids Python may
    hand to parameters the loss uses: those must keep their gradients, the unused ones stay None."""
    def reload(model):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(state, assign=True)

    eager, patched = _twin_run(MAGEFLOW, config, lambda m: _two_steps(m, between=reload))
    assert any(g is None for g in eager[1].values())
    for step, (want, got) in enumerate(zip(eager, patched)):
        _same(want, got, f"step {step}")


def _add_adapter(model, name: str, seed: int) -> None:
    """A PEFT LoRA adapter on both streams of every block (MageFlow has no diffusers adapter mixin)."""
    from peft import inject_adapter_in_model

    torch.manual_seed(seed)
    config = LoraConfig(r=2, lora_alpha=2, init_lora_weights="gaussian",
                        target_modules=["to_q", "to_add_out", "txt_mlp.net.2", "img_mlp.net.2"])
    inject_adapter_in_model(config, model, adapter_name=name)


def _set_adapter(model, name: str) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.set_adapter(name)


@pytest.mark.parametrize("config", COVERED)
def test_an_adapter_added_or_switched_after_a_step_gets_none_where_eager_does(config):
    def loop(model):
        model.requires_grad_(False)
        seen = []

        def step(seed):
            model.zero_grad(set_to_none=True)
            _loss(MAGEFLOW, model, seed).backward()
            seen.append(_grads(model))

        step(1)
        _add_adapter(model, "a", 11)
        step(2)
        _add_adapter(model, "b", 12)
        _set_adapter(model, "b")
        step(3)
        return seen

    eager, patched = _twin_run(MAGEFLOW, config, loop)
    for step in (1, 2):  # not vacuous: an adapter on the unused text stream has None gradients in eager
        assert [n for n, g in eager[step].items() if "lora" in n and g is None and "to_add_out" in n], step
    for step, (want, got) in enumerate(zip(eager, patched)):
        _same(want, got, f"step {step}")


@pytest.mark.parametrize("config", COVERED)
def test_a_feature_capture_hook_fires_once_per_call_and_its_feature_trains(config):
    """A REPA-style hook keeps a block's output for an auxiliary loss: it must see the call once, and the
    tensor it keeps must run backward (the reach probe never shows it its own tensors)."""
    def loop(model):
        kept: list[torch.Tensor] = []
        hook = model.transformer_blocks[1].img_mlp.register_forward_hook(lambda m, a, out: kept.append(out))
        seen = []
        try:
            for seed in (1, 2):
                kept.clear()
                model.zero_grad(set_to_none=True)
                loss = _loss(MAGEFLOW, model, seed)
                assert len(kept) == 1, f"the hook fired {len(kept)} times for one forward"
                (loss + kept[0].float().mean()).backward()
                seen.append(_grads(model))
        finally:
            hook.remove()
        return seen

    eager, patched = _twin_run(MAGEFLOW, config, loop)
    for step, (want, got) in enumerate(zip(eager, patched)):
        _same(want, got, f"step {step}")


def test_group_offloading_enabled_before_patching_keeps_none_gradients():
    """diffusers' group offloading wraps each block's forward: the reach probe must run the wrapped call
    and read the block's own parameters (it was handed the wrapper's ``functools.partial``)."""
    import warnings

    def prepare(model):
        model.enable_group_offload(torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)
        return model

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*gradseam.*reaches.*")
        eager, patched = _twin_run(MAGEFLOW, COMPILE, _two_steps, prepare=prepare)
    assert any(g is None for g in eager[0].values())
    for step, (want, got) in enumerate(zip(eager, patched)):
        _same(want, got, f"step {step}")


# -- the compile settings gradseam owns -------------------------------------------------------------


@pytest.mark.parametrize("config", BACKENDS, ids=IDS)
def test_retain_graph_twice_after_the_batch_size_changed(config):
    """AOTAutograd's donated buffers refuse a second backward through a graph compiled with them."""
    from cases_video import MAGEFLOW_BATCH

    def loop(model):
        seen = []
        model.zero_grad(set_to_none=True)
        _loss(MAGEFLOW, model, 1).backward()
        model.zero_grad(set_to_none=True)
        loss = MAGEFLOW_BATCH.output(model(**MAGEFLOW_BATCH.inputs(torch.Generator().manual_seed(2))))
        loss = loss.float().square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
        seen.append(_grads(model))
        return seen

    eager, patched = _twin_run(MAGEFLOW, config, loop)
    _same(eager[0], patched[0], "two backwards")


def test_a_graph_break_inside_a_block_is_named_and_its_frames_dropped_on_remove():
    """HiDream's MoE routing breaks the block's graph inside a loop, so dynamo compiles the gate and the
    experts as frames of diffusers' own class-level functions, whose cache every handle shares: a warning
    names them, and remove() drops what was compiled there (a second model under another budget ran the
    first one's graphs)."""
    from test_family_hidream import HIDREAM
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    model = _build(HIDREAM)
    handle = gradseam.patch(model, COMPILE)
    try:
        with pytest.warns(UserWarning, match=r"MoEGate\.forward.*frames of their own"):
            _loss(HIDREAM, model, 1).backward()
    finally:
        handle.remove()
    classes = {type(m) for m in model.modules() if type(m).__module__.startswith("diffusers.")}
    functions = [f for cls in classes for f in vars(cls).values() if hasattr(f, "__code__")]
    cached = [f"{f.__qualname__}" for f in functions if _debug_get_cache_entry_list(f.__code__)]
    assert not cached, f"dynamo's code for diffusers' own functions outlived remove(): {cached}"


def test_a_graph_break_in_a_loop_names_the_functions_compiled_apart():
    """What :func:`frames_compiled_apart` sees after dynamo skipped a frame with a break in a loop."""
    from gradseam.run.compiler import drop_compiled, frames_compiled_apart

    class Inner(torch.nn.Module):
        def forward(self, x):
            return x.sin()

    class Looped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            for _ in range(2):
                x = self.inner(x)
                torch._dynamo.graph_break()
            return x

    torch._dynamo.reset()
    block = Looped()
    assert frames_compiled_apart(block) == {}
    torch.compile(lambda m, x: m(x), backend="aot_eager")(block, torch.randn(3, requires_grad=True))
    apart = frames_compiled_apart(block)
    assert "Inner.forward" in apart
    drop_compiled(apart.values())
    assert frames_compiled_apart(block) == {}
    torch._dynamo.reset()


def test_deepcopy_of_an_unused_output_model_still_matches():
    """A deep copy made after a step (EMA) is a model of its own: its blocks are probed on their own."""
    def loop(model):
        seen = _two_steps(model)
        twin = copy.deepcopy(model)
        twin.zero_grad(set_to_none=True)
        _loss(MAGEFLOW, twin, 3).backward()
        seen.append(_grads(twin))
        return seen

    eager, patched = _twin_run(MAGEFLOW, COMPILE, loop)
    for step, (want, got) in enumerate(zip(eager, patched)):
        _same(want, got, f"step {step}")


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("config", BACKENDS, ids=IDS)
def test_layerwise_casting_is_refused_naming_the_way_out(config, when):
    """diffusers' layerwise casting (float16 storage, float32 compute) made the compiled backward fail deep in
    the first step on mixed dtypes; refused at patch time, or at the first call when enabled after patching,
    before anything compiles."""
    from gradseam.errors import UnsupportedStrategyError

    torch._dynamo.reset()
    model = _build(FLUX)
    cast = lambda: model.enable_layerwise_casting(storage_dtype=torch.float16, compute_dtype=torch.float32)  # noqa: E731
    with cpu_test_mode():
        if when == "before":
            cast()
            with pytest.raises(UnsupportedStrategyError, match="layerwise casting.*eager backend"):
                gradseam.patch(model, config)
            return
        with gradseam.patch(model, config):
            cast()
            with pytest.raises(UnsupportedStrategyError, match="layerwise casting.*eager backend"):
                _loss(FLUX, model, 1)
