"""Latte-1 text-to-video (diffusers' ``LatteTransformer3DModel``: maxin-cn/Latte-1).

Two lists of diffusers' generic ``BasicTransformerBlock``, built with ``norm_type="ada_norm_single"``
(PixArt-α's block: each block's ``scale_shift_table`` plus the timestep embedding the model computes once
in ``adaln_single``):

- ``transformer_blocks``, spatial: self-attention ``attn1`` over the patches of one frame, then
  cross-attention ``attn2`` to the projected T5 prompt;
- ``temporal_transformer_blocks``, temporal: self-attention ``attn1`` over the frames of one patch, and no
  cross-attention (built without a cross-attention dimension: ``attn2`` is ``None``; for this norm type
  the block still builds ``norm2``, the LayerNorm in front of its feed-forward).

Each block is called positionally and returns the new hidden states alone.

**No carry, in either list.** The loop interleaves the lists: spatial block ``i`` on ``(B·F, N, D)`` (each
frame a sequence of N patches); the tokens reshaped and permuted to ``(B·N, F, D)`` (each patch a sequence
of F frames), plus ``temp_pos_embed`` before the first temporal block; temporal block ``i``; the tokens
back to ``(B·F, N, D)`` for spatial block ``i + 1``. Two blocks of one list never run one after the other,
and the next block of a list gets a tensor the model builds from the other list's output, so a chunk of
either list would always fall back (exact, but its later blocks computed twice in forward). Neither list
declares a carry: ``gradient_checkpointing_interval`` is ignored with a warning and every selected block
is its own region, as in ``hidream``. (With ``enable_temporal_attentions=False`` the spatial blocks do run
back to back with shared arguments, and the temporal blocks not at all; training uses temporal attention,
and a carry on the spatial list would only make every chunk fall back there. In that mode the temporal
blocks' regions simply never run.) Within a list the other arguments are the same objects for every block:
the prompt states, the timestep embedding repeated per frame and the caller's ``encoder_attention_mask``
for the spatial blocks, the timestep embedding repeated per patch for the temporal ones.

FFN seam: ``ff`` (a tanh-GELU ``FeedForward``, 4·d wide). For this norm type the block computes
``gate_mlp * ff(norm2(hidden_states) * (1 + scale_mlp) + shift_mlp)`` with the residual added outside:
``ff`` is called on a tensor made for it alone, and its return value only goes to the gate, so
checkpointing it alone is exact and drops its wide activations. ``norm2`` cannot join: its output is scaled
and shifted first. Attention side: ``attn1``, and ``attn2`` where the block has one (spatial blocks), hence
optional. Both lists hold one class and this is the ``dit`` family's declaration of it, imported from there.

The text mask reaches the spatial blocks' ``attn2`` as the caller gave it, on the ``B·F`` batch: only an
additive bias of shape ``(B·F, 1, L)`` works (the 2-D keep-mask that the model's docstring describes is never
converted, and fails in the attention processor's reshape for more than one frame). ``LattePipeline`` passes
none: it cuts a single prompt to its valid tokens, and zeroes the padded tokens of a batch of prompts.

gradseam orders blocks list by list (every spatial block, then every temporal one), while the model runs
them alternately. Nothing exact depends on that order here (no chunks). Weight streaming prefetches in the
order the blocks ran in the last forward, which it learns as they run: from the second step on, every copy
is issued a block ahead (on the tiny test model, 16 loads per step and none waited for, against 21 loads,
5 waited for and 4 blocks on the GPU at once when it prefetched in list order).

Frames: ``temp_pos_embed`` is built for ``video_length`` frames (16) and added whenever there is more than
one frame, so the model takes 16 frames, or 1 (text-to-image). The presets' ``tokens`` therefore scale the
picture, not the frame count.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockList, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

from .dit import BASIC_BLOCK  # the same BasicTransformerBlock declaration: ff; attn1, attn2 (optional)

_M = "diffusers.models.transformers.latte_transformer_3d"

# LattePipeline tokenizes prompts to 120 T5 tokens (PixArt-α's length).
TEXT_TOKENS = 120


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, frames: int = 16, height: int = 512,
    width: int = 512, text_tokens: int = TEXT_TOKENS,
) -> dict:
    """One real-size batch as ``LattePipeline`` feeds the transformer: the SD-VAE latent video
    ``(1, 4, frames, H/8, W/8)`` (grad; the VAE encodes every frame, no temporal compression), the T5 prompt
    states ``(1, text_tokens, 4096)`` and the timestep (int64, as the pipeline passes it).

    ``frames`` must be the model's ``video_length`` or 1; ``tokens`` overrides the video token count by
    changing the picture (a square grid of 2x2 patches per frame), keeping the frames."""
    import torch

    cfg = model.config
    if frames not in (1, cfg.video_length):
        raise ValueError(
            f"Latte takes {cfg.video_length} frames (its video_length, the length of temp_pos_embed) or 1, "
            f"got frames={frames}; scale a workload with tokens=, which changes the picture size."
        )
    if tokens:
        height = width = square_side(max(1, tokens // frames)) * cfg.patch_size * 8
    randn = tensor_maker(device, dtype)
    return {
        "hidden_states": randn(1, cfg.in_channels, frames, height // 8, width // 8, grad=True),
        "encoder_hidden_states": randn(1, text_tokens, cfg.caption_channels),
        "timestep": torch.full((1,), 500, device=device, dtype=torch.long),
    }


# maxin-cn/Latte-1 transformer/config.json: PixArt-α XL/2's spatial trunk (28 blocks, 16 x 72 heads, 1152
# wide, T5-XXL captions) plus 28 temporal blocks, for 16 frames of 512x512.
LATTE_1 = {
    "num_attention_heads": 16, "attention_head_dim": 72, "in_channels": 4, "out_channels": 8,
    "num_layers": 28, "dropout": 0.0, "cross_attention_dim": 1152, "attention_bias": True, "sample_size": 64,
    "patch_size": 2, "activation_fn": "gelu-approximate", "num_embeds_ada_norm": 1000,
    "norm_type": "ada_norm_single", "norm_elementwise_affine": False, "norm_eps": 1e-6,
    "caption_channels": 4096, "video_length": 16,
}

LATTE = Family(
    name="latte",
    description="Latte-1 text-to-video (LatteTransformer3DModel)",
    models=(f"{_M}.LatteTransformer3DModel",),
    block_lists=(
        BlockList("transformer_blocks"),  # no carry: the loop interleaves the lists (see above)
        BlockList("temporal_transformer_blocks"),  # no carry: likewise
    ),
    block_classes=(BASIC_BLOCK,),
    presets={
        "1-512": Preset(
            "Latte-1 (28 spatial + 28 temporal blocks, 16 x 72 heads) at 512x512, 16 frames "
            "(16 x 32 x 32 = 16384 video tokens, 120 text tokens)",
            config=LATTE_1,
            inputs={"frames": 16, "height": 512, "width": 512},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(LATTE)
