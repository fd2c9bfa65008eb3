"""A tiny stand-in for diffusers' ``MageFlowTransformer2DModel``, to test the mageflow adapter before
a diffusers release ships the class (it arrives with huggingface/diffusers#14295, in
``models/transformers/transformer_mageflow.py``; diffusers 0.42.1 does not have it).

Written from scratch against the upstream class's *public* surface, so that the adapter's preset,
its input builder and every parity test run unchanged against the real class the day it ships:

* the constructor takes upstream's arguments (``in_channels``, ``out_channels``, ``context_in_dim``,
  ``hidden_size``, ``num_attention_heads``, ``num_layers``, ``axes_dim``, ``patch_size``); the head
  width is ``hidden_size // num_attention_heads``, and ``axes_dim`` splits the rotary channels
  between the frame, height and width axes;
* ``forward(hidden_states, encoder_hidden_states, timestep, img_ids, ...)`` requires ``img_ids``,
  one ``(frame, height, width)`` position per image token, shape ``(image_tokens, 3)`` (a leading
  batch axis is accepted and its first entry used, as upstream does);
* the blocks sit in ``transformer_blocks``, are ``MageFlowTransformerBlock``s and are called by
  keyword with the same ``temb``, rotary embedding and ``joint_attention_kwargs`` each; a block
  returns ``(encoder_hidden_states, hidden_states)``;
* inside a block, ``img_mod`` / ``txt_mod`` turn ``temb`` into shift, scale and gate for each half
  of each stream, ``attn`` is joint attention over ``[text; image]`` with per-stream projections,
  rotary on the image queries and keys only, computed by diffusers' ``dispatch_attention_fn`` (so
  the attention backend machinery is in the path, as upstream), and ``img_mlp`` / ``txt_mlp`` are
  ``FeedForward``s called on exactly their modulated ``norm2`` output, gate and residual outside.

The rotary embedding is complex-valued, as upstream's is, so the tensors attention saves include
complex ones. Nothing here reproduces MageFlow's numbers or weights layout beyond that; only the
structure gradseam cuts at, and the signature the adapter's preset and inputs target, matter.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.attention import FeedForward
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import AdaLayerNormContinuous
from torch import nn


class MageFlowRotaryEmbedding(nn.Module):
    """Per-axis rotary phases from (frame, height, width) ids, as unit complex numbers."""

    def __init__(self, axes_dim: tuple[int, ...], theta: float = 10000.0) -> None:
        super().__init__()
        self.axes_dim = tuple(axes_dim)
        self.theta = theta

    def forward(self, img_ids: torch.Tensor) -> torch.Tensor:
        phases = []
        for axis, width in enumerate(self.axes_dim):
            inv_freq = self.theta ** (-torch.arange(0, width, 2, device=img_ids.device, dtype=torch.float64) / width)
            phases.append(img_ids[:, axis].to(torch.float64)[:, None] * inv_freq[None, :])
        angles = torch.cat(phases, dim=-1).float()
        return torch.polar(torch.ones_like(angles), angles)  # (tokens, sum(axes_dim) // 2), complex64


def _rotate(x: torch.Tensor, phases: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (0, 1), (2, 3), ... of ``x`` (batch, tokens, heads, head_dim) by ``phases``;
    channels past the rotary width pass unchanged."""
    width = 2 * phases.shape[-1]
    head, tail = x[..., :width], x[..., width:]
    pairs = torch.view_as_complex(head.float().reshape(*head.shape[:-1], -1, 2))
    turned = torch.view_as_real(pairs * phases[None, :, None, :]).flatten(-2).to(x.dtype)
    return turned if tail.shape[-1] == 0 else torch.cat([turned, tail], dim=-1)


class MageFlowAttention(nn.Module):
    """Joint attention: each stream projects its own q/k/v and output, all tokens attend together."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, inner), nn.Linear(dim, inner), nn.Linear(dim, inner)
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (
            nn.Linear(dim, inner), nn.Linear(dim, inner), nn.Linear(dim, inner)
        )
        self.norm_q, self.norm_k = nn.RMSNorm(head_dim, eps=eps), nn.RMSNorm(head_dim, eps=eps)
        self.norm_added_q, self.norm_added_k = nn.RMSNorm(head_dim, eps=eps), nn.RMSNorm(head_dim, eps=eps)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(0.0)])
        self.to_add_out = nn.Linear(inner, dim)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, -1))

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        img_q = self.norm_q(self._split(self.to_q(hidden_states)))
        img_k = self.norm_k(self._split(self.to_k(hidden_states)))
        if image_rotary_emb is not None:  # the text stream stays unrotated
            img_q, img_k = _rotate(img_q, image_rotary_emb), _rotate(img_k, image_rotary_emb)
        txt_q = self.norm_added_q(self._split(self.add_q_proj(encoder_hidden_states)))
        txt_k = self.norm_added_k(self._split(self.add_k_proj(encoder_hidden_states)))
        query = torch.cat([txt_q, img_q], dim=1)
        key = torch.cat([txt_k, img_k], dim=1)
        value = torch.cat(
            [self._split(self.add_v_proj(encoder_hidden_states)), self._split(self.to_v(hidden_states))], dim=1
        )
        mixed = dispatch_attention_fn(query, key, value, attn_mask=attention_mask).flatten(2).to(query.dtype)
        text_tokens = encoder_hidden_states.shape[1]
        image_out = self.to_out[1](self.to_out[0](mixed[:, text_tokens:]))
        return image_out, self.to_add_out(mixed[:, :text_tokens])


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
    def _modulate(x: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shift, scale, gate = params[:, None].chunk(3, dim=-1)
        return x * (1 + scale) + shift, gate

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb: torch.Tensor | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        img_attn_params, img_mlp_params = self.img_mod(temb).chunk(2, dim=-1)
        txt_attn_params, txt_mlp_params = self.txt_mod(temb).chunk(2, dim=-1)

        img, img_gate = self._modulate(self.img_norm1(hidden_states), img_attn_params)
        txt, txt_gate = self._modulate(self.txt_norm1(encoder_hidden_states), txt_attn_params)
        img_attn, txt_attn = self.attn(
            hidden_states=img, encoder_hidden_states=txt, image_rotary_emb=image_rotary_emb,
            **(joint_attention_kwargs or {}),
        )
        hidden_states = hidden_states + img_gate * img_attn
        encoder_hidden_states = encoder_hidden_states + txt_gate * txt_attn

        img, img_gate = self._modulate(self.img_norm2(hidden_states), img_mlp_params)
        hidden_states = hidden_states + img_gate * self.img_mlp(img)
        txt, txt_gate = self._modulate(self.txt_norm2(encoder_hidden_states), txt_mlp_params)
        encoder_hidden_states = encoder_hidden_states + txt_gate * self.txt_mlp(txt)
        return encoder_hidden_states, hidden_states


class MageFlowTimestepEmbedding(nn.Module):
    """A sigma in [0, 1] to the conditioning vector (sinusoids of 1000 * sigma, then an MLP)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.time_proj = Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000)
        self.timestep_embedder = TimestepEmbedding(256, dim)

    def forward(self, timestep: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return self.timestep_embedder(self.time_proj(timestep).to(like.dtype))


class MageFlowTransformer2DModel(ModelMixin, ConfigMixin):
    """Patch-1 latent tokens and text-encoder features in, latent tokens out."""

    _supports_gradient_checkpointing = True
    _no_split_modules = ["MageFlowTransformerBlock"]

    @register_to_config
    def __init__(
        self,
        in_channels: int = 128,
        out_channels: int = 128,
        context_in_dim: int = 3584,
        hidden_size: int = 3072,
        num_attention_heads: int = 24,
        num_layers: int = 32,
        axes_dim: tuple[int, ...] = (16, 48, 48),
        patch_size: int = 1,
    ) -> None:
        super().__init__()
        head_dim, rest = divmod(hidden_size, num_attention_heads)
        if rest or len(axes_dim) != 3 or any(d % 2 for d in axes_dim) or sum(axes_dim) > head_dim:
            raise ValueError(
                f"hidden_size {hidden_size} must split into {num_attention_heads} heads, and axes_dim {axes_dim} "
                f"must be three even widths summing to at most the head width"
            )
        self.pos_embed = MageFlowRotaryEmbedding(axes_dim)
        self.x_embedder = nn.Linear(in_channels, hidden_size)
        self.context_embedder_norm = nn.RMSNorm(context_in_dim, eps=1e-6)
        self.context_embedder = nn.Linear(context_in_dim, hidden_size)
        self.time_text_embed = MageFlowTimestepEmbedding(hidden_size)
        self.transformer_blocks = nn.ModuleList(
            MageFlowTransformerBlock(hidden_size, num_attention_heads, head_dim) for _ in range(num_layers)
        )
        self.norm_out = AdaLayerNormContinuous(hidden_size, hidden_size, elementwise_affine=False, eps=1e-6)
        self.proj_out = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.gradient_checkpointing = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        joint_attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = True,
    ) -> Transformer2DModelOutput | tuple[torch.Tensor]:
        if img_ids.ndim == 3:
            img_ids = img_ids[0]
        if tuple(img_ids.shape) != (hidden_states.shape[1], 3):
            raise ValueError(
                f"img_ids must hold one (frame, height, width) row per image token: expected "
                f"({hidden_states.shape[1]}, 3), got {tuple(img_ids.shape)}"
            )
        hidden_states = self.x_embedder(hidden_states)
        encoder_hidden_states = self.context_embedder(self.context_embedder_norm(encoder_hidden_states))
        temb = self.time_text_embed(timestep.to(hidden_states.dtype), hidden_states)
        image_rotary_emb = self.pos_embed(img_ids)

        for block in self.transformer_blocks:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                encoder_hidden_states, hidden_states = self._gradient_checkpointing_func(
                    block, hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs
                )
            else:
                encoder_hidden_states, hidden_states = block(
                    hidden_states=hidden_states,
                    encoder_hidden_states=encoder_hidden_states,
                    temb=temb,
                    image_rotary_emb=image_rotary_emb,
                    joint_attention_kwargs=joint_attention_kwargs,
                )

        output = self.proj_out(self.norm_out(hidden_states, temb))
        if not return_dict:
            return (output,)
        return Transformer2DModelOutput(sample=output)
