"""A tiny MageFlow-style dual-stream MMDiT, for testing the mageflow adapter before diffusers ships the class.

``MageFlowTransformer2DModel`` is not in the installed diffusers (an upstream pull request adds
it), so the adapter names it and its block by bare class name. This module builds a model of the
same shape from scratch: the classes carry the upstream names, so gradseam's bare-name matching
finds them here exactly as it will find the real ones, and the block has the published structure
that the adapter's declarations rely on:

* ``img_mod`` / ``txt_mod`` turn ``temb`` into shift, scale and gate for the attention and the
  MLP half of each stream;
* ``attn`` is joint attention: each stream has its own q/k/v and output projections, and the
  text and image tokens attend as one concatenated sequence;
* ``img_mlp`` / ``txt_mlp`` are ``FeedForward`` MLPs, each called on exactly its modulated norm
  output, the gate and residual applied outside;
* a block returns ``(encoder_hidden_states, hidden_states)``, and the model calls its blocks by
  keyword.

Nothing here is meant to reproduce MageFlow's numbers; only the structure gradseam cuts at matters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.attention import FeedForward
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import AdaLayerNormContinuous, RMSNorm
from torch import nn

Rotary = tuple[torch.Tensor, torch.Tensor]


def _rotate(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    # x: (B, S, H, D); rotary: cos and sin of shape (S, D // 2), applied to channel pairs (even, odd).
    cos, sin = (t[None, :, None, :] for t in rotary)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class MageFlowAttention(nn.Module):
    """Joint attention over ``[text; image]`` with separate projections per stream."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.heads = heads
        inner = heads * head_dim
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, inner) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, inner) for _ in range(3))
        self.norm_q, self.norm_k = RMSNorm(head_dim, eps=eps), RMSNorm(head_dim, eps=eps)
        self.norm_added_q, self.norm_added_k = RMSNorm(head_dim, eps=eps), RMSNorm(head_dim, eps=eps)
        self.to_out = nn.Linear(inner, dim)
        self.to_add_out = nn.Linear(inner, dim)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, -1))

    def forward(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, image_rotary_emb: Rotary | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        text_len = encoder_hidden_states.shape[1]
        q = torch.cat([self.norm_added_q(self._heads(self.add_q_proj(encoder_hidden_states))),
                       self.norm_q(self._heads(self.to_q(hidden_states)))], dim=1)
        k = torch.cat([self.norm_added_k(self._heads(self.add_k_proj(encoder_hidden_states))),
                       self.norm_k(self._heads(self.to_k(hidden_states)))], dim=1)
        v = torch.cat([self._heads(self.add_v_proj(encoder_hidden_states)), self._heads(self.to_v(hidden_states))],
                      dim=1)
        if image_rotary_emb is not None:
            q, k = _rotate(q, image_rotary_emb), _rotate(k, image_rotary_emb)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = out.transpose(1, 2).flatten(2)
        return self.to_out(out[:, text_len:]), self.to_add_out(out[:, :text_len])


class MageFlowTransformerBlock(nn.Module):
    """One dual-stream block: modulated joint attention, then a modulated MLP per stream."""

    def __init__(self, dim: int, num_attention_heads: int, attention_head_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.img_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.txt_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.attn = MageFlowAttention(dim, num_attention_heads, attention_head_dim, eps=eps)
        self.img_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.txt_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.img_mlp = FeedForward(dim, dim_out=dim, activation_fn="gelu-approximate")
        self.txt_mlp = FeedForward(dim, dim_out=dim, activation_fn="gelu-approximate")

    @staticmethod
    def _modulated(x: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shift, scale, gate = params.unsqueeze(1).chunk(3, dim=-1)
        return x * (1 + scale) + shift, gate

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb: Rotary | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        img_attn_params, img_mlp_params = self.img_mod(temb).chunk(2, dim=-1)
        txt_attn_params, txt_mlp_params = self.txt_mod(temb).chunk(2, dim=-1)

        img, img_gate = self._modulated(self.img_norm1(hidden_states), img_attn_params)
        txt, txt_gate = self._modulated(self.txt_norm1(encoder_hidden_states), txt_attn_params)
        img_attn, txt_attn = self.attn(img, txt, image_rotary_emb=image_rotary_emb)
        hidden_states = hidden_states + img_gate * img_attn
        encoder_hidden_states = encoder_hidden_states + txt_gate * txt_attn

        img, img_gate = self._modulated(self.img_norm2(hidden_states), img_mlp_params)
        hidden_states = hidden_states + img_gate * self.img_mlp(img)
        txt, txt_gate = self._modulated(self.txt_norm2(encoder_hidden_states), txt_mlp_params)
        encoder_hidden_states = encoder_hidden_states + txt_gate * self.txt_mlp(txt)
        return encoder_hidden_states, hidden_states


class MageFlowTransformer2DModel(ModelMixin, ConfigMixin):
    """Packed image tokens and text features in, packed image tokens out."""

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(
        self,
        in_channels: int = 64,
        out_channels: int | None = None,
        num_layers: int = 12,
        attention_head_dim: int = 128,
        num_attention_heads: int = 24,
        joint_attention_dim: int = 3584,
        rope_theta: float = 10000.0,
    ) -> None:
        super().__init__()
        dim = num_attention_heads * attention_head_dim
        self.img_in = nn.Linear(in_channels, dim)
        self.txt_norm = RMSNorm(joint_attention_dim, eps=1e-6)
        self.txt_in = nn.Linear(joint_attention_dim, dim)
        self.time_proj = Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embed = TimestepEmbedding(256, dim)
        self.transformer_blocks = nn.ModuleList(
            MageFlowTransformerBlock(dim, num_attention_heads, attention_head_dim) for _ in range(num_layers)
        )
        self.norm_out = AdaLayerNormContinuous(dim, dim, elementwise_affine=False, eps=1e-6)
        self.proj_out = nn.Linear(dim, out_channels or in_channels)
        self.gradient_checkpointing = False

    def _rotary(self, length: int, device: torch.device) -> Rotary:
        # One position per token of [text; image]; enough to make attention position-dependent.
        half = self.config.attention_head_dim // 2
        inv_freq = self.config.rope_theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
        angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv_freq[None]
        return angles.cos(), angles.sin()

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        return_dict: bool = True,
    ) -> Transformer2DModelOutput | tuple[torch.Tensor]:
        hidden_states = self.img_in(hidden_states)
        encoder_hidden_states = self.txt_in(self.txt_norm(encoder_hidden_states))
        temb = self.time_embed(self.time_proj(timestep * 1000).to(hidden_states.dtype))
        rotary = self._rotary(encoder_hidden_states.shape[1] + hidden_states.shape[1], hidden_states.device)

        for block in self.transformer_blocks:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                encoder_hidden_states, hidden_states = self._gradient_checkpointing_func(
                    block, hidden_states, encoder_hidden_states, temb, rotary
                )
            else:
                encoder_hidden_states, hidden_states = block(
                    hidden_states=hidden_states,
                    encoder_hidden_states=encoder_hidden_states,
                    temb=temb,
                    image_rotary_emb=rotary,
                )

        output = self.proj_out(self.norm_out(hidden_states, temb))
        if not return_dict:
            return (output,)
        return Transformer2DModelOutput(sample=output)
