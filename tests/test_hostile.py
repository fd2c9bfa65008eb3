"""Hostile use, round 3: what an attention processor, a weight-sharing model or a re-patch mid-step does.

Each case is compared bit for bit against an unpatched twin (same seed, CPU fp32), or must be refused
with an error naming the cause. Offloading rows run through the engine's CPU test mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from cases import FLUX, WAN

import gradseam
from gradseam.errors import GradseamWarning, UnsupportedStrategyError
from gradseam.offload import cpu_test_mode
from gradseam.testing import Case, assert_same_step, run_step

ON = {"gradient_checkpointing": True}
KEEP = {**ON, "gradient_checkpointing_keep_attention": True}
OFFLOAD = {**ON, "gradient_checkpointing_offload_attention": True}
KEPT = {"keep": KEEP, "offload": OFFLOAD, "unsloth + offload": {**OFFLOAD, "gradient_checkpointing_backend": "unsloth"}}
REPLAY_MISSED = "a kept attention kernel output did not match the recomputed call (computed again)"
_SDPA = F.scaled_dot_product_attention


@contextlib.contextmanager
def _attention_as(kernel: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Every attention call of the model (diffusers' native dispatch) goes through ``kernel``."""
    F.scaled_dot_product_attention = kernel
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _SDPA


def _ffn_only(model: torch.nn.Module) -> None:
    """LoRA-style training of the FFN only: nothing upstream of the first attention needs gradients."""
    for name, p in model.named_parameters():
        p.requires_grad_(".ff." in name or "proj_mlp" in name)


def _no_input_grads(case: Case) -> Case:
    def inputs(g: torch.Generator) -> dict:
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in case.inputs(g).items()}

    return Case(case.name, case.build, inputs)


def _both(model, reference, case: Case, config: dict, kernel: Callable[..., torch.Tensor] | None, reset=None):
    with cpu_test_mode(), gradseam.patch(model, config) as handle:
        with _attention_as(kernel) if kernel else contextlib.nullcontext():
            if reset:
                reset()
            want = run_step(reference, case, count_bytes=False)  # no saved-tensor hooks: autograd's own
            if reset:                                             # in-place checks stay on
                reset()
            got = run_step(model, case, count_bytes=False)
        return want, got, [dict(r.fallbacks) for r in handle.regions()]


# -- kept kernel outputs are not aliases the model can change -----------------------------------
def _editing(*args, **kwargs):
    out = _SDPA(*args, **kwargs)
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())):
        out.mul_(0.5)  # legal unpatched only where autograd does not record the kernel
    return out


@pytest.mark.parametrize("config", KEPT.values(), ids=KEPT.keys())
def test_an_attention_processor_editing_its_output_in_place_is_exact(config):
    """The kept output is the tensor the model goes on with: the edit must not be applied twice."""
    model, reference = FLUX.twins()
    for m in (model, reference):
        _ffn_only(m)
    want, got, fallbacks = _both(model, reference, _no_input_grads(FLUX), config, _editing)
    assert_same_step(want, got)
    assert sum(f.get(REPLAY_MISSED, 0) for f in fallbacks) >= 1  # the edited output was computed again


def test_a_second_backward_after_an_edit_in_the_recompute_is_exact():
    """Each recompute edits what the replay handed it: the next recompute must not start from that."""
    model, reference = FLUX.twins()
    for m in (model, reference):
        _ffn_only(m)
    case = _no_input_grads(FLUX)

    def grads(m):
        loss = m(**case.inputs(torch.Generator().manual_seed(1)))[0].square().mean()
        first = torch.autograd.grad(loss, [p for p in m.parameters() if p.requires_grad], retain_graph=True)
        second = torch.autograd.grad(loss, [p for p in m.parameters() if p.requires_grad])
        return first, second

    with gradseam.patch(model, KEEP), _attention_as(_editing):
        got, want = grads(model), grads(reference)
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(g, w)


class _CalibratingOnce:
    """An attention call made once, in the forward only: a lazy calibration or a cached mask."""

    def __init__(self, grad: bool) -> None:
        self.grad, self.done = grad, False

    def reset(self) -> None:
        self.done = False

    def __call__(self, *args, **kwargs):
        if not self.done:
            self.done = True
            with torch.set_grad_enabled(self.grad and torch.is_grad_enabled()):
                _SDPA(*args, **kwargs).sum()  # its result is thrown away
        return _SDPA(*args, **kwargs)


@pytest.mark.parametrize("config", KEPT.values(), ids=KEPT.keys())
def test_an_attention_call_made_in_the_forward_only_does_not_shift_the_replay(config):
    model, reference = FLUX.twins()
    kernel = _CalibratingOnce(grad=False)
    want, got, _ = _both(model, reference, FLUX, config, kernel, reset=kernel.reset)
    assert_same_step(want, got)


@pytest.mark.parametrize("config", [ON, KEEP], ids=["torch", "keep"])
def test_a_forward_only_call_that_autograd_records_raises_as_diffusers_own_checkpointing_does(config):
    """With gradients on, a call made in the forward only saves tensors the recompute does not: no
    recompute can reproduce that, so it must raise, never train on (torch's checkpoint check)."""
    kernel = _CalibratingOnce(grad=True)
    with _attention_as(kernel):
        for patched in (False, True):
            model = FLUX.build()
            kernel.reset()
            if patched:
                context = gradseam.patch(model, config)
            else:
                model.enable_gradient_checkpointing()
                context = contextlib.nullcontext()
            with context, pytest.raises(torch.utils.checkpoint.CheckpointError, match="different number of tensors"):
                run_step(model, FLUX, count_bytes=False)


# -- one block instance at several positions ------------------------------------------------------
@pytest.mark.parametrize("config", [ON, {**ON, "gradient_checkpointing_backend": "torch-ffn"}, KEEP,
                                    {**ON, "gradient_checkpointing_interval": 2}],
                         ids=["torch", "torch-ffn", "keep", "interval 2"])
def test_a_block_shared_across_positions_is_refused_naming_the_positions(config):
    model = WAN.build()
    block = model.blocks[0]
    model.blocks = torch.nn.ModuleList([block, model.blocks[1], block])
    with pytest.raises(UnsupportedStrategyError, match=r"blocks\[2\] is the same WanTransformerBlock instance as "
                                                        r"blocks\[0\]"):
        gradseam.patch(model, config)
    assert "forward" not in block.__dict__  # refused before anything was touched


# -- a patch changed between a forward and its backward ------------------------------------------
CONFIGS = {
    "torch": ON,
    "torch-ffn": {**ON, "gradient_checkpointing_backend": "torch-ffn"},
    "keep": KEEP,
    "interval 2": {**ON, "gradient_checkpointing_interval": 2},
    "unsloth": {**ON, "gradient_checkpointing_backend": "unsloth"},
    "unsloth-ffn + offload": {**OFFLOAD, "gradient_checkpointing_backend": "unsloth-ffn"},
}
PAIRS = [(a, b) for a in CONFIGS for b in CONFIGS if a != b] + [("torch", "torch"), ("keep", "keep")]


@pytest.mark.parametrize(("first", "second"), PAIRS, ids=[f"{a} -> {b}" for a, b in PAIRS])
def test_repatching_between_forward_and_backward_keeps_the_old_graph_exact(first, second):
    case = FLUX
    model, reference = case.twins()
    with cpu_test_mode():
        gradseam.patch(model, CONFIGS[first])
        loss = model(**case.inputs(torch.Generator().manual_seed(1)))[0].square().mean()
        handle = gradseam.patch(model, CONFIGS[second])  # replaces the first patch; the graph is pending
        loss.backward()
        want = reference(**case.inputs(torch.Generator().manual_seed(1)))[0].square().mean()
        want.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad), name
        assert_same_step(run_step(reference, case, seed=2), run_step(model, case, seed=2))  # the new patch
        handle.remove()


# -- a plugin whose Carry names the outputs the wrong way round ----------------------------------
class _TwoStreams(torch.nn.Module):
    """A block returning (text, image) like Flux's double block, streams of different lengths."""

    def __init__(self) -> None:
        super().__init__()
        self.text, self.image = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor):
        return encoder_hidden_states + self.text(encoder_hidden_states).tanh(), hidden_states + self.image(hidden_states)


class _TwoStreamModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_TwoStreams() for _ in range(4))

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor):
        for block in self.blocks:
            encoder_hidden_states, hidden_states = block(hidden_states, encoder_hidden_states)
        return (hidden_states,)


def test_a_carry_declared_the_wrong_way_round_falls_back_exactly_and_says_so():
    """The chunk feeds the next block what the Carry names; swapped, the run-time check sees the
    argument it stands for was not what the model passed, and the chunk computes block by block."""
    from gradseam import BlockClass, BlockList, Carry, Family, hookimpl

    family = Family(name="two-streams-swapped", models=(_TwoStreamModel,), block_classes=(BlockClass(_TwoStreams),),
                    block_lists=(BlockList("blocks", carry=Carry({"hidden_states": 0, "encoder_hidden_states": 1})),))

    class Plugin:
        @hookimpl
        def register_families(self, register):
            register(family)

    case = Case("two-streams", _TwoStreamModel, lambda g: {"hidden_states": torch.randn(1, 6, 8, generator=g),
                                                           "encoder_hidden_states": torch.randn(1, 3, 8, generator=g)})
    name = gradseam.register(Plugin(), name="two-streams-swapped")
    try:
        model, reference = case.twins()
        with pytest.warns(GradseamWarning, match="fell back to one region per block"):
            handle = gradseam.patch(model, {**ON, "gradient_checkpointing_interval": 2})
            got = run_step(model, case, count_bytes=False)
        assert_same_step(run_step(reference, case, count_bytes=False), got)
        assert all(r.fallbacks for r in handle.regions())
        handle.remove()
    finally:
        gradseam.unregister(name)


# -- offload: the one in-place edit the engine does not see, and the strict mode that does -----------
def _edit_through_a_detached_alias(engine, strict: bool) -> str:
    from gradseam.offload import strict_inplace

    x = torch.randn(512, 1024, requires_grad=True)  # 2 MiB: offloaded
    y = x * 2
    alias = y.detach()  # shares y's version counter, but is not a view: keeps no Python object alive
    view = y[:, :]
    with strict_inplace() if strict else contextlib.nullcontext(), engine.group():
        z = view.sin()  # saves `view`
    del y, view
    alias.mul_(3)
    try:
        z.sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "trained on"


def test_strict_inplace_catches_the_edit_through_a_detached_alias_that_the_engine_alone_misses():
    from gradseam.offload import engine_for

    with cpu_test_mode():
        engine = engine_for("host", 4)
        assert _edit_through_a_detached_alias(engine, strict=False) == "trained on"  # docs/strategies.md says so
        message = _edit_through_a_detached_alias(engine, strict=True)
    assert "modified by an inplace operation" in message and "gradseam's activation offload" in message


def test_strict_inplace_changes_no_result():
    with cpu_test_mode():
        from gradseam.offload import strict_inplace

        model, reference = FLUX.twins()
        with strict_inplace(), gradseam.patch(model, {**ON, "gradient_checkpointing_backend": "unsloth"}) as handle:
            assert_same_step(run_step(reference, FLUX), run_step(model, FLUX))
            assert handle.engine.copies > 0


# -- a loop that swaps a submodule's forward around each block call ------------------------------------------------


def _swapping_attention(model: torch.nn.Module) -> None:
    """What HiDream-O1's flash path does: around each block call, the attention's forward is replaced on the
    instance by other code (here: the same attention, scaled), and put back after the call. Done from the hooks
    of the model and of the block before (no pre-hook on a block: those make a chunk fall back on their own)."""
    blocks = list(model.blocks)

    def swap(attn: torch.nn.Module) -> None:
        plain = type(attn).forward
        attn.forward = lambda *a, **k: 1.5 * plain(attn, *a, **k)

    model.register_forward_pre_hook(lambda module, args: swap(blocks[0].attn1))
    for i, block in enumerate(blocks):
        def after(module: torch.nn.Module, args: tuple, out: object, i: int = i) -> None:
            del blocks[i].attn1.forward
            if i + 1 < len(blocks):
                swap(blocks[i + 1].attn1)

        block.register_forward_hook(after)


@pytest.mark.parametrize("config", [ON, {**ON, "gradient_checkpointing_interval": 2}], ids=["block", "interval 2"])
def test_a_forward_swapped_around_each_call_is_refused_at_the_recompute_naming_it(config):
    """The recompute in backward would run the forward in place then, not the swapped one: gradients wrong without
    an error (diffusers' own flag computes them so). gradseam notes the instance forwards a region ran with and
    refuses a recompute that finds others; a chunk's later block, run ahead without its swap, falls back first."""
    case = WAN
    model = case.fresh()
    _swapping_attention(model)
    want = run_step(model, case)
    assert want.outputs[0].abs().sum() > 0
    with gradseam.patch(model, config) as handle:
        with pytest.raises(RuntimeError, match=r"the forward of a WanAttention in this checkpointed WanTransformerBlock "
                                               r"was replaced on the instance between the region's forward and its "
                                               r"recompute"):
            run_step(model, case)
        if config.get("gradient_checkpointing_interval"):
            causes = {c for r in handle.regions() for c in r.fallbacks}
            assert any("forward was replaced on the instance between the chunk's first block" in c for c in causes)
