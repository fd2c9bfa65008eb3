"""The conformance kit is what plugin authors trust, so it must fail an adapter that is wrong.

A declared submodule the model never calls is trivially exact (nothing changes) and saves nothing:
before, the kit passed an adapter whose declared attention side was dead code, since attention-offload
regions were not recorded and offload rows were not checked for moving anything. Here a tiny model
with a spare attention module and a spare FFN module that its blocks never call, declared by a plugin
as the attention side / FFN seam: every affected row of the kit must fail, naming the region.

Declarations that run but cut in the wrong place are exact too (issue 37): an "FFN seam" that is the
attention module passed all 21 rows while ``torch-ffn`` recomputed attention and kept every FFN
activation, and an attention side that misses the module calling the kernel loses kept attention while
``summary()`` says "except attention kernels". The kit watches where the kernels run and fails both,
naming the module that calls the kernel and the declared one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradseam
from gradseam import BlockClass, BlockList, Carry, Family, hookimpl
from gradseam.offload import cpu_test_mode
from gradseam.testing import Case, ConformanceSuite, check_declared_sides, check_strategy, randn


class Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(dim, 32), nn.GELU(), nn.Linear(32, dim))
        self.unused_attn = nn.Linear(dim, dim)  # declared as the attention side, never called
        self.unused_ff = nn.Linear(dim, dim)  # declared as an FFN seam, never called

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(hidden_states, hidden_states, hidden_states, need_weights=False)[0]
        return hidden_states + self.ff(hidden_states)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor]:
        for block in self.blocks:
            hidden_states = block(hidden_states)
        return (hidden_states,)


CASE = Case("dead-seams", Model, lambda g: {"hidden_states": randn(g, 1, 8, 16, grad=True)})


def _plugin(attention: tuple[str, ...], ffn: tuple[tuple[str, ...], ...]):
    family = Family(name="dead-seams", models=(Model,),
                    block_lists=(BlockList("blocks", carry=Carry({"hidden_states": None})),),
                    block_classes=(BlockClass(Block, ffn=ffn, attention=attention),))

    class Plugin:
        @hookimpl
        def register_families(self, register):
            register(family)

    return Plugin()


@pytest.fixture
def dead_attention():
    name = gradseam.register(_plugin(("unused_attn",), (("ff",),)), name="dead-attention")
    yield
    gradseam.unregister(name)


@pytest.fixture
def dead_ffn():
    name = gradseam.register(_plugin(("attn",), (("unused_ff",),)), name="dead-ffn")
    yield
    gradseam.unregister(name)


ON = {"gradient_checkpointing": True}


NEVER_RAN = r"unused_attn \(attention\) never ran"
# whole blocks a stride checkpoints keep their kernels: the kit says first that the declared side misses them
MISSES_KERNEL = r"in submodule 'attn', which is outside its declared attention side \('unused_attn',\)"


@pytest.mark.parametrize(("config", "expected"), [
    ({"gradient_checkpointing_offload_attention": True}, NEVER_RAN),
    ({**ON, "gradient_checkpointing_backend": "torch-ffn", "gradient_checkpointing_offload_attention": True}, NEVER_RAN),
    ({**ON, "gradient_checkpointing_segment_stride": 3, "gradient_checkpointing_offload_attention": True},
     MISSES_KERNEL),
], ids=["attention-offload", "ffn+attention-offload", "stride+attention-offload"])
def test_an_attention_side_the_model_never_calls_fails_the_kit(dead_attention, config, expected):
    with cpu_test_mode(), pytest.raises(AssertionError, match=expected):
        check_strategy(CASE, config)


def test_the_same_model_with_its_real_attention_side_passes(dead_ffn):
    """The control: with the called module declared, the same rows pass (the failure above is the dead seam)."""
    with cpu_test_mode():
        check_strategy(CASE, {"gradient_checkpointing_offload_attention": True})


@pytest.mark.parametrize("backend", ["torch-ffn", "unsloth-ffn"])
def test_an_ffn_seam_the_model_never_calls_fails_the_kit(dead_ffn, backend):
    with cpu_test_mode(), pytest.raises(AssertionError, match=r"unused_ff \(ffn\) never ran"):
        check_strategy(CASE, {**ON, "gradient_checkpointing_backend": backend})


# -- declarations that run, but cut in the wrong place --------------------------------------------

KEEP = {**ON, "gradient_checkpointing_backend": "torch", "gradient_checkpointing_keep_attention": True}
KERNEL = r"calls an attention kernel \(aten::_scaled_dot_product_\w+\)"


class Attention(nn.Module):
    """Self-attention through ``F.scaled_dot_product_attention``, as diffusers' processors call it (kept
    attention sees that call; ``nn.MultiheadAttention`` hides it inside its own functional)."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class TwoAttentionBlock(nn.Module):
    """Self-attention twice (say, a joint attention and a refinement), then the MLP."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.attn1 = Attention(dim)
        self.attn2 = Attention(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 32), nn.GELU(), nn.Linear(32, dim))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = hidden_states + self.attn1(hidden_states)
        h = h + self.attn2(h)
        return h + self.ff(h)


class TwoAttentionModel(Model):
    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.blocks = nn.ModuleList(TwoAttentionBlock() for _ in range(3))


def _suite(case: Case) -> ConformanceSuite:
    """The kit's suite for ``case``, to call its tests directly (a ``Test*`` class here would be collected)."""
    return type("WrongAdapterSuite", (ConformanceSuite,), {"case": case})()


@pytest.fixture
def declared():
    """Register a plugin declaring ``BlockClass(block, ffn=..., attention=...)`` for ``model``; unregistered after."""
    names: list[str] = []

    def register(model: type, block: type, *, ffn=(), attention=()) -> Case:
        family = Family(name="wrong-cut", models=(model,),
                        block_lists=(BlockList("blocks", carry=Carry({"hidden_states": None})),),
                        block_classes=(BlockClass(block, ffn=ffn, attention=attention),))

        class Plugin:
            @hookimpl
            def register_families(self, register):
                register(family)

        names.append(gradseam.register(Plugin(), name="wrong-cut"))
        return Case("wrong-cut", model, CASE.inputs)  # a fresh case: the suite resolves its family anew

    yield register
    for name in names:
        gradseam.unregister(name)


FFN_IS_ATTENTION = (
    r"FFN seam attn of Block \(blocks\[0\]\) contains attention: 'attn' " + KERNEL
    + r"\. The -ffn backends recompute a seam in backward and keep only its input, so this seam recomputes "
    r"attention and keeps every feed-forward activation"
)


@pytest.mark.parametrize("backend", ["torch-ffn", "unsloth-ffn"])
def test_an_ffn_seam_that_is_the_attention_module_fails_the_kit(declared, backend):
    case = declared(Model, Block, ffn=(("attn",),))
    with cpu_test_mode(), pytest.raises(AssertionError, match=FFN_IS_ATTENTION):
        check_strategy(case, {**ON, "gradient_checkpointing_backend": backend})


def test_an_ffn_seam_around_attention_fails_the_declaration_test(declared):
    """The suite's declaration test fails it too, once, whatever rows a plugin runs (a plugin may override
    ``configs`` and leave the ``-ffn`` rows out), and so does :func:`check_declared_sides` called directly."""
    case = declared(Model, Block, ffn=(("attn",),), attention=("attn",))
    with pytest.raises(AssertionError, match=FFN_IS_ATTENTION):
        _suite(case).test_declaration_matches_the_model()
    with pytest.raises(AssertionError, match=FFN_IS_ATTENTION):
        check_declared_sides(case)


@pytest.mark.parametrize("config", [
    KEEP,
    {**KEEP, "gradient_checkpointing_interval": 3},
    {**ON, "gradient_checkpointing_backend": "unsloth", "gradient_checkpointing_keep_attention": True},
], ids=["keep", "keep+interval3", "unsloth+keep"])
def test_an_attention_side_the_block_never_calls_names_the_module_that_calls_the_kernel(dead_attention, config):
    """Before, the kit caught the recomputed kernels ("ran 6 times in a step, unpatched 3") without a cause."""
    with cpu_test_mode(), pytest.raises(AssertionError) as info:
        check_strategy(CASE, config)
    message = str(info.value)
    assert "Block (blocks[0]) calls an attention kernel (aten::_scaled_dot_product_" in message, message
    assert ("in submodule 'attn', which is outside its declared attention side ('unused_attn',) ('unused_attn' is "
            "never called by this block)") in message, message
    assert "recomputed in backward while summary() says 'except attention kernels'" in message, message
    assert "Declare 'attn' in BlockClass(attention=...)" in message, message


def test_an_attention_side_that_misses_a_kernel_calling_module_fails_the_kit(declared):
    case = declared(TwoAttentionModel, TwoAttentionBlock, ffn=(("ff",),), attention=("attn1",))
    expected = (r"TwoAttentionBlock \(blocks\[0\]\) " + KERNEL + r" in submodule 'attn2', which is outside its "
                r"declared attention side \('attn1',\)\. Kept attention keeps kernel outputs only inside the declared "
                r"attention modules.* Declare 'attn2' in BlockClass\(attention=\.\.\.\)")
    with pytest.raises(AssertionError, match=expected):
        check_strategy(case, KEEP)
    with pytest.raises(AssertionError, match=expected):
        _suite(case).test_declaration_matches_the_model()


def test_an_attention_side_that_is_not_attention_fails_the_kit(declared):
    case = declared(Model, Block, ffn=(("ff",),), attention=("ff",))
    with pytest.raises(AssertionError, match=r"in submodule 'attn', which is outside its declared attention side "
                                             r"\('ff',\) \('ff' calls no attention kernel\)"):
        check_declared_sides(case)


def test_the_right_cuts_pass(declared):
    """The control: the same blocks with the MLP as the seam and every attention module declared pass the
    rows that failed above, and the declaration test."""
    case = declared(TwoAttentionModel, TwoAttentionBlock, ffn=(("ff",),), attention=("attn1", "attn2"))
    found = check_declared_sides(case)
    assert {(s.block, s.module) for s in found.sites} == {
        (f"blocks[{i}]", m) for i in range(3) for m in ("attn1", "attn2")
    }
    _suite(case).test_declaration_matches_the_model()
    for config in (KEEP, {**ON, "gradient_checkpointing_backend": "torch-ffn"}):
        check_strategy(case, config)


# -- inputs in lists: their gradients are compared too ------------------------------------------------


class _ListModel(nn.Module):
    """Takes its latents as a list (as Cosmos 3 takes its vision tokens) and a dict of extra tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, tokens: list[torch.Tensor], extra: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.proj(torch.cat(tokens) * extra["scale"])


def test_the_kits_step_compares_the_gradients_of_inputs_in_lists_and_dicts():
    from gradseam.testing import assert_same_step, run_step

    case = Case("list-inputs", _ListModel, lambda g: {
        "tokens": [randn(g, 2, 4, grad=True), randn(g, 3, 4, grad=True)], "extra": {"scale": randn(g, 1, 4, grad=True)}}, output=lambda out: out)
    model = case.fresh()
    expected = run_step(model, case)
    assert sorted(expected.input_grads) == ["extra['scale']", "tokens[0]", "tokens[1]"]
    assert all(g.abs().sum() > 0 for g in expected.input_grads.values())
    wrong = run_step(model, case)
    wrong.input_grads["tokens[1]"] = wrong.input_grads["tokens[1]"] * 1.5  # a patch that got one of them wrong
    with pytest.raises(AssertionError, match=r"gradient of input 'tokens\[1\]' differs"):
        assert_same_step(expected, wrong)
