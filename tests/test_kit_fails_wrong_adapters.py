"""The conformance kit is what plugin authors trust, so it must fail an adapter that is wrong.

A declared submodule the model never calls is trivially exact (nothing changes) and saves nothing:
before, the kit passed an adapter whose declared attention side was dead code, since attention-offload
regions were not recorded and offload rows were not checked for moving anything. Here a tiny model
with a spare attention module and a spare FFN module that its blocks never call, declared by a plugin
as the attention side / FFN seam: every affected row of the kit must fail, naming the region.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradseam
from gradseam import BlockClass, BlockList, Carry, Family, hookimpl
from gradseam.offload import cpu_test_mode
from gradseam.testing import Case, check_strategy, randn


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


@pytest.mark.parametrize("config", [
    {"gradient_checkpointing_offload_attention": True},
    {**ON, "gradient_checkpointing_backend": "torch-ffn", "gradient_checkpointing_offload_attention": True},
    {**ON, "gradient_checkpointing_segment_stride": 3, "gradient_checkpointing_offload_attention": True},
], ids=["attention-offload", "ffn+attention-offload", "stride+attention-offload"])
def test_an_attention_side_the_model_never_calls_fails_the_kit(dead_attention, config):
    with cpu_test_mode(), pytest.raises(AssertionError, match=r"unused_attn \(attention-offload\) never ran"):
        check_strategy(CASE, config)


def test_the_same_model_with_its_real_attention_side_passes(dead_ffn):
    """The control: with the called module declared, the same rows pass (the failure above is the dead seam)."""
    with cpu_test_mode():
        check_strategy(CASE, {"gradient_checkpointing_offload_attention": True})


@pytest.mark.parametrize("backend", ["torch-ffn", "unsloth-ffn"])
def test_an_ffn_seam_the_model_never_calls_fails_the_kit(dead_ffn, backend):
    with cpu_test_mode(), pytest.raises(AssertionError, match=r"unused_ff \(ffn\) never ran"):
        check_strategy(CASE, {**ON, "gradient_checkpointing_backend": backend})
