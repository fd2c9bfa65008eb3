"""The synthetic pre-norm block stack used by the benchmarks (the reference stack of the anchors).

It is patched through a family registered at runtime with :func:`gradseam.register`, exactly as a
third-party plugin would, so the benchmark exercises the same path as a real model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..family import BlockClass, BlockList, Carry, Family
from ..hookspecs import hookimpl

HEAD_DIM = 128


class SyntheticAttention(nn.Module):
    """LayerNorm (no affine) -> Linear(d, 3d) -> q, k, v heads -> SDPA -> Linear(d, d)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.heads = max(dim // HEAD_DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class SyntheticFFN(nn.Module):
    """LayerNorm (no affine) -> Linear(d, 4d) -> GELU(tanh) -> Linear(4d, d)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(x)), approximate="tanh"))


class SyntheticBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = SyntheticAttention(dim)
        self.ffn = SyntheticFFN(dim)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(hidden_states)
        return hidden_states + self.ffn(hidden_states)


class SyntheticStack(nn.Module):
    def __init__(self, blocks: int, dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SyntheticBlock(dim) for _ in range(blocks))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            hidden_states = block(hidden_states)
        return hidden_states


SYNTHETIC = Family(
    name="synthetic",
    description="The benchmark's synthetic pre-norm block stack",
    models=(SyntheticStack,),
    block_lists=(BlockList("blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(BlockClass(SyntheticBlock, ffn=(("ffn",),), attention=("attn",)),),
)


class SyntheticPlugin:
    @hookimpl
    def register_families(self, register):  # noqa: ANN001 - pluggy passes the callback
        register(SYNTHETIC)


def ensure_registered() -> None:
    import gradseam

    if "synthetic" not in {f.name for f in gradseam.families()}:
        gradseam.register(SyntheticPlugin(), name="gradseam-synthetic")
