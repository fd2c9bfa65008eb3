"""Helios: autoregressive long video in chunks with a compressed history (HeliosTransformer3DModel).

Helios (the released Helios-Base, Helios-Mid and Helios-Distilled checkpoints, all one 14B
architecture fine-tuned from Wan 2.1 T2V 14B) generates a video chunk by chunk. Each call denoises one
chunk of latent frames with the frames already made in front of it as context: a short history at full
resolution (the start frame and the last frame), a mid one patchified 2x coarser and a long one 4x
coarser, each by its own ``Conv3d``. All of that happens before the trunk: the model patchifies the
four inputs, builds the RoPE table of each (the coarse ones averaged down to their grid), concatenates
tokens and tables as ``[long | mid | short | chunk]``, and builds the modulation once, the chunk's
timestep projection for its tokens and (``zero_history_timestep``) the projection of time 0 for the
history tokens, one ``(B, tokens, 6, D)`` tensor. The trunk only sees one longer sequence.

Why each declaration is exact:

- **One list**, ``blocks``, all ``HeliosTransformerBlock``, called positionally as
  ``block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb, original_context_length)``
  (diffusers' own checkpointing flag passes the same five) and returning the new hidden states. The
  text states, the per-token projection and the RoPE table are made once and made contiguous before
  the loop, the same objects for every block; ``original_context_length`` (the chunk's token count,
  which the blocks use to split the history off) is one int; nothing is added between blocks. So
  ``Carry({"hidden_states": None})``.
- **FFN seam** ``ffn`` (diffusers' ``FeedForward``, tanh-GELU), called on exactly the per-token
  modulated ``norm3`` output, a tensor made for it; its output only feeds the gated residual (in
  float32), outside it. ``norm3`` cannot join: its output is scaled and shifted before ``ffn`` sees it.
- **Attention side** ``attn1`` and ``attn2``: the only modules that call a kernel. ``attn1`` is the
  self-attention over history and chunk (RoPE, RMS QK norms across heads and, with
  ``is_amplify_history``, its learned history-key scale); ``attn2`` attends to the text, over the
  chunk's tokens only when ``guidance_cross_attn`` is set (the released config), the history split off
  and put back around it inside the block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker, video_latent_size

_M = "diffusers.models.transformers.transformer_helios"

# The pipelines pad every umT5 prompt to 512 tokens (``max_sequence_length``).
TEXT_TOKENS = 512
# HeliosPipeline's history (``history_sizes=[16, 2, 1]`` with ``keep_first_frame``): 16 latent frames at 4x
# coarser patches, 2 at 2x, and the start frame with one latest frame at full resolution.
_LONG, _MID, _SHORT = 16, 2, 1

# The released transformer (BestWishYsh/Helios-Base, -Mid, -Distilled): Wan 2.1 T2V 14B's trunk (40 blocks,
# 40 x 128 heads, FFN 13824, umT5 width 4096) with the history embedders, the time-0 history modulation and
# the chunk-only cross-attention: diffusers' class defaults, spelled out so a change of default upstream
# does not move the preset. Helios' own training configs set the same flags (is_amplify_history off).
_14B = {
    "patch_size": (1, 2, 2), "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "added_kv_proj_dim": None,
    "rope_dim": (44, 42, 42), "rope_theta": 10000.0, "guidance_cross_attn": True, "zero_history_timestep": True,
    "has_multi_term_memory_patch": True, "is_amplify_history": False, "history_scale_mode": "per_head",
}


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, window: int = 9, height: int = 384,
    width: int = 640, text_tokens: int = TEXT_TOKENS,
) -> dict:
    """One training step as ``HeliosPipeline`` calls the model for a chunk (and Helios' stage-1 training
    does): ``window`` noisy latent frames ``(1, 16, window, H/8, W/8)`` (grad) at one timestep, behind the
    history the released checkpoints take (16 long, 2 mid and 1 + 1 short latent frames, at the chunk's
    picture size) with the frame indices the pipeline lays out, ``[start | long | mid | latest | chunk]``,
    and the padded umT5 states.

    ``tokens`` overrides the chunk's token count by changing ``window``; the history stays.
    """
    import torch

    cfg = model.config
    frames = (window - 1) * 4 + 1
    window, h, w = video_latent_size(frames, height, width, patch=tuple(cfg.patch_size), tokens=tokens)
    randn = tensor_maker(device, dtype)
    indices = torch.arange(1 + _LONG + _MID + _SHORT + window, device=device)
    start, long, mid, latest, chunk = indices.split([1, _LONG, _MID, _SHORT, window])
    return {
        "hidden_states": randn(1, cfg.in_channels, window, h, w, grad=True),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, text_tokens, cfg.text_dim),
        "indices_hidden_states": chunk[None],
        "indices_latents_history_short": torch.cat([start, latest])[None],
        "indices_latents_history_mid": mid[None],
        "indices_latents_history_long": long[None],
        "latents_history_short": randn(1, cfg.in_channels, 1 + _SHORT, h, w),
        "latents_history_mid": randn(1, cfg.in_channels, _MID, h, w),
        "latents_history_long": randn(1, cfg.in_channels, _LONG, h, w),
    }


HELIOS = Family(
    name="helios",
    description="Helios autoregressive long video with a compressed history (HeliosTransformer3DModel)",
    models=(f"{_M}.HeliosTransformer3DModel",),
    block_lists=(BlockList("blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(BlockClass(f"{_M}.HeliosTransformerBlock", ffn=(("ffn",),), attention=("attn1", "attn2")),),
    presets={
        "14b-384x640": Preset(
            "Helios 14B (Helios-Base / -Mid / -Distilled: 40 blocks, 40 x 128 heads, FFN 13824), one chunk of "
            "9 latent frames (33 video frames) at 384x640, the size Helios trains at, behind its history: "
            "8640 chunk + 1920 short + 240 mid + 240 long history tokens; 512 text tokens",
            config=_14B,
            inputs={"window": 9, "height": 384, "width": 640},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Callable[[Family], None]) -> None:
    register(HELIOS)
