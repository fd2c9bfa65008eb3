"""Attention kept inside whole-block regions: kernels matched as operators, not recomputed, exact.

The conformance suite (tests/test_conformance.py) runs the kept-attention configurations on every
built-in family and checks that their attention kernels run once per step; this file covers the
extension point (a plugin naming its own kernel) and what is kept where.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradseam
from gradseam import BlockClass, BlockList, Carry, Family, hookimpl
from gradseam.errors import PluginError
from gradseam.offload import cpu_test_mode
from gradseam.testing import Case, assert_same_step, check_strategy, count_kernels, run_step


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v


@torch.library.custom_op("gradseam_test::attention", mutates_args=())
def toy_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _reference_attention(q, k, v)


@toy_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        return torch.autograd.grad(_reference_attention(q, k, v), (q, k, v), grad)


toy_attention.register_autograd(_backward, setup_context=_setup)


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(toy_attention(q.contiguous(), k.contiguous(), v.contiguous()))


class Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.attn, self.ff = Attention(dim), nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(hidden_states)
        return hidden_states + self.ff(hidden_states)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor]:
        for block in self.blocks:
            hidden_states = block(hidden_states)
        return (hidden_states,)


CASE = Case("custom-kernel", Model, lambda g: {"hidden_states": torch.randn(2, 64, 16, generator=g).requires_grad_(True)})
FAMILY = Family(name="custom-kernel", models=(Model,),
                block_lists=(BlockList("blocks", carry=Carry({"hidden_states": None})),),
                block_classes=(BlockClass(Block, ffn=(("ff",),), attention=("attn",)),))
KEEP = {"gradient_checkpointing": True, "gradient_checkpointing_keep_attention": True}


class FamilyPlugin:
    @hookimpl
    def register_families(self, register):
        register(FAMILY)


class KernelPlugin:  # a plugin may implement only this hook
    @hookimpl
    def register_attention_kernels(self, register):
        register("gradseam_test::attention")


@pytest.fixture
def family():
    name = gradseam.register(FamilyPlugin(), name="custom-kernel-family")
    yield
    gradseam.unregister(name)


def _kernel_calls(config: dict) -> tuple[int, int]:
    torch.manual_seed(0)
    model = Model()
    with count_kernels() as unpatched:
        reference = run_step(model, CASE)
    with gradseam.patch(model, config), count_kernels() as patched:
        assert_same_step(reference, run_step(model, CASE))
    return unpatched[0], patched[0]


def test_unknown_kernels_are_recomputed_exactly(family):
    assert _kernel_calls(KEEP) == (0, 0)  # not an attention kernel for gradseam: not even counted
    from gradseam.run.kernels import attention_kernels

    assert "gradseam_test::attention" not in attention_kernels().names


def test_a_plugin_names_its_kernel_and_it_is_kept(family):
    name = gradseam.register(KernelPlugin(), name="custom-kernel-ops")
    try:
        assert _kernel_calls(KEEP) == (3, 3)  # once per block, forward only
        assert _kernel_calls({"gradient_checkpointing": True}) == (3, 6)  # whole blocks recompute it
        check_strategy(CASE, KEEP, whole=True)
        with cpu_test_mode():
            report = check_strategy(CASE, {**KEEP, "gradient_checkpointing_offload_attention": True}, whole=True)
        assert report.patched.saved_bytes < report.reference.saved_bytes
    finally:
        gradseam.unregister(name)


def test_kernel_outputs_go_to_the_engine_with_offload():
    from cases import WAN

    moved = {}
    for attention in (False, True):
        torch.manual_seed(0)
        model = WAN.build()
        config = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth",
                  "gradient_checkpointing_offload_attention": attention}
        with cpu_test_mode(), gradseam.patch(model, config) as handle:
            run_step(model, WAN)
            moved[attention] = handle.engine.offloaded_bytes
            text = str(handle.summary())
        if attention:
            assert "except attention kernels (outputs kept in CPU memory) + CPU offload of region inputs" in text
    assert moved[True] > moved[False] > 0


def test_a_bad_kernel_name_is_refused_naming_the_plugin():
    class Bad:
        @hookimpl
        def register_attention_kernels(self, register):
            register("attention")  # no namespace

    with pytest.raises(PluginError) as info:
        gradseam.register(Bad(), name="bad-kernels")
    assert "bad-kernels" in str(info.value) and "'mylib::attention'" in str(info.value)
    assert "bad-kernels" not in {i.plugin for i in gradseam.installed()}


def test_keep_attention_warns_where_it_has_no_effect():
    from cases import WAN

    from gradseam.errors import GradseamWarning

    torch.manual_seed(0)
    model = WAN.build()
    for config, why in (({"gradient_checkpointing": False, "gradient_checkpointing_keep_attention": True},
                         "no checkpointing runs"),
                        ({"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn",
                          "gradient_checkpointing_keep_attention": True}, "never recomputes attention")):
        with pytest.warns(GradseamWarning, match=why):
            gradseam.patch(model, config).remove()


@torch.library.custom_op("gradseam_test::attention_dropout", mutates_args=())
def toy_attention_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    mask = (torch.rand(weights.shape) >= dropout_p).to(weights.dtype) / (1 - dropout_p)
    return (weights * mask) @ v, mask


def _dropout_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3], output[1])


def _dropout_backward(ctx, grad, _grad_mask):
    *qkv, mask = ctx.saved_tensors
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in qkv)
        out = (torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) * mask) @ v
        return (*torch.autograd.grad(out, (q, k, v), grad), None)


toy_attention_dropout.register_autograd(_dropout_backward, setup_context=_dropout_setup)


class DropoutAttentionBlock(nn.Module):
    """Attention drawing random numbers inside its kernel, then a dropout after it."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.contiguous() for t in self.qkv(hidden_states).chunk(3, dim=-1))
        a, _ = toy_attention_dropout(q, k, v, 0.3)
        return hidden_states + torch.nn.functional.dropout(self.out(a), 0.2, training=self.training)


class DropoutModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DropoutAttentionBlock() for _ in range(2))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor]:
        for block in self.blocks:
            hidden_states = block(hidden_states)
        return (hidden_states,)


def test_attention_dropout_is_recomputed_with_the_same_masks():
    family = Family(name="dropout-attention", models=(DropoutModel,), block_lists=(BlockList("blocks"),),
                    block_classes=(BlockClass(DropoutAttentionBlock, attention=("qkv",)),))

    class Plugin:
        @hookimpl
        def register_families(self, register):
            register(family)

        @hookimpl
        def register_attention_kernels(self, register):
            register("gradseam_test::attention_dropout")

    name = gradseam.register(Plugin(), name="dropout-attention")
    try:
        case = Case("dropout-attention", lambda: DropoutModel().train(),
                    lambda g: {"hidden_states": torch.randn(2, 32, 16, generator=g).requires_grad_(True)})

        def seeded(model):
            torch.manual_seed(7)
            return run_step(model, case)

        torch.manual_seed(0)
        model = case.build()
        reference = seeded(model)
        with gradseam.patch(model, KEEP), count_kernels(kept_only=False) as calls, count_kernels() as kept:
            assert_same_step(reference, seeded(model), what="attention dropout, attention kept")
        assert calls[0] == 4  # a kernel that drew random numbers is not kept: it ran again in the recompute
        assert kept[0] == 0  # ... so the kit's count, of the calls kept attention keeps, leaves it out
    finally:
        gradseam.unregister(name)


def test_cross_attention_to_few_keys_is_recomputed():
    """Keeping pays where recomputing is dear: self-attention yes, attention to a short context no."""
    from gradseam.run.kernels import attention_kernels

    kernels = attention_kernels()
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.randn(1, 2, 64, 8)
    assert kernels.keeps(op, (q, q, q), {})
    assert kernels.keeps(op, (q, q[:, :, :16], q[:, :, :16]), {})  # a quarter as many keys: kept
    assert not kernels.keeps(op, (q, q[:, :, :15], q[:, :, :15]), {})
    assert not kernels.keeps(op, (q, q, q, 0.1), {})  # dropout_p > 0
