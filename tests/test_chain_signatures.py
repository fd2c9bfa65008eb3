"""Interval chunks call their later blocks from the signature read once per class: every parameter kind.

A chunk runs its later blocks itself, with the head's arguments and the carried output, so it has to
rebuild each call from what it bound: ``*args`` and positional-only parameters go back in by position,
``**kwargs`` by name. Each test compares against the unpatched model bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradseam
from gradseam import BlockClass, BlockList, Carry, Family, hookimpl
from gradseam.testing import Case, assert_same_step, run_step


class VarArgsBlock(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, hidden_states: torch.Tensor, /, *shifts: torch.Tensor, scale: float = 1.0,
                **extra: torch.Tensor) -> torch.Tensor:
        for shift in shifts:
            hidden_states = hidden_states + shift
        gate = extra.get("gate")
        out = hidden_states + scale * self.ff(hidden_states)
        return out * gate if gate is not None else out


class VarArgsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(VarArgsBlock() for _ in range(4))

    def forward(self, hidden_states: torch.Tensor, shift: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor]:
        double = shift * 2  # one object for every block: a fresh one per call would differ from the head's
        for block in self.blocks:
            hidden_states = block(hidden_states, shift, double, scale=0.5, gate=gate)
        return (hidden_states,)


def _inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(2, 5, 8, generator=g).requires_grad_(True),
            "shift": torch.randn(2, 5, 8, generator=g), "gate": torch.rand(2, 5, 8, generator=g)}


CASE = Case("var-args", VarArgsModel, _inputs)
FAMILY = Family(name="var-args", models=(VarArgsModel,),
                block_lists=(BlockList("blocks", carry=Carry({"hidden_states": None})),),
                block_classes=(BlockClass(VarArgsBlock, ffn=(("ff",),)),))


class Plugin:
    @hookimpl
    def register_families(self, register):
        register(FAMILY)


@pytest.fixture
def family():
    name = gradseam.register(Plugin(), name="var-args-family")
    yield
    gradseam.unregister(name)


@pytest.mark.parametrize("interval", [2, 4])
def test_a_chunk_hands_later_blocks_their_star_args_by_position(family, interval):
    torch.manual_seed(0)
    model = VarArgsModel()
    reference = run_step(model, CASE)
    config = {"gradient_checkpointing": True, "gradient_checkpointing_interval": interval}
    with gradseam.patch(model, config) as handle:
        assert_same_step(reference, run_step(model, CASE))
        chunks = [r for r in handle.regions() if len(r.blocks) == interval]
    assert len(chunks) == 4 // interval
    for chunk in chunks:  # served from the chunk, not computed alone
        assert chunk.fallbacks == {} and chunk.served == interval - 1, chunk
