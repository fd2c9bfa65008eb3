"""Hunyuan-DiT text-to-image (diffusers' ``HunyuanDiT2DModel``; v1.0 to v1.2 and the distilled v1.2).

One list, ``blocks``, of ``HunyuanDiTBlock`` s (40 in the released DiT-g/2), each returning the new
``hidden_states`` alone. The model calls every block by keyword with ``hidden_states``, ``temb``,
``encoder_hidden_states`` and ``image_rotary_emb``; the last three are built once before the loop
(``temb`` from timestep, pooled T5 states and, up to v1.1, the size and style conditions; the CLIP and
projected T5 states joined with their padding replaced by the learned ``text_embedding_padding``; the
pipeline's 2-D RoPE tuple) and are the same objects for every block.

**Long skips (U-ViT), and why no carry.** With ``N = num_layers`` the loop pushes the outputs of
blocks ``0 .. N/2 - 2`` onto a stack; blocks ``N/2 - 1`` and ``N/2`` (19 and 20) take no skip; every
block past ``N/2`` (21 .. 39, built with ``skip_norm`` / ``skip_linear``) is called with ``skip=``
the stack's top (plus the ControlNet's sample for that block, when given), a tensor of its own, and
merges it first thing. A chunk runs its later blocks ahead with the first block's arguments, so a
chunk starting at or before block 20 and reaching block 21 would hand block 21 no skip at all, and
``torch.cat([hidden_states, None])`` fails in the forward (at interval 2, chunk ``[20, 21]``), while
in the second half every chunk would fall back (``skip`` differs per block). Nor would chunks save
anything where they could run: every first-half output is a ``skip`` tensor that stays alive on the
stack and is then an input of a checkpointed second-half block, so it is kept until backward either
way. The one first-half output not on the stack is block 19's, the input of block 20: one hidden
state of forty is all chunks could save. So ``blocks`` declares no carry, and
``gradient_checkpointing_interval`` checkpoints block by block, with a warning.

FFN seam: ``norm3 → ff``. ``norm3`` (an ``FP32LayerNorm``, no modulation) is called on the residual
stream, ``ff`` (tanh-GELU ``FeedForward``, 1408 → 6144 → 1408; every dropout ``p = 0``) on exactly
``norm3``'s return value, which nothing else reads, and ``ff``'s return value is only added to the
residual: a strict chain, and recomputing it as one region is exact. It drops the 6144-wide
pre-activation and GELU output and ``norm3``'s normalised copy (float32 inside the norm in bf16); the
seam keeps only its input, the residual stream. (``enable_forward_chunking`` sets ``_chunk_size`` on
the blocks, which their forward never reads: ``ff`` always runs whole.)

Attention side: ``attn1`` (self-attention with QK LayerNorms and the 2-D RoPE) and ``attn2``
(cross-attention to the 77 CLIP + 256 T5 tokens; QK norms, RoPE on the query only), each through
``HunyuanAttnProcessor2_0`` and one SDPA call inside it. The text masks never reach the blocks (the
padding is replaced before the loop), so no mask goes to the kernels. The T5 pooler in
``time_extra_emb`` runs ``F.multi_head_attention_forward`` before the loop, outside every block.

diffusers gives this class no ``_supports_gradient_checkpointing``: its own
``enable_gradient_checkpointing()`` raises, and gradseam is the only checkpointing path.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

_M = "diffusers.models.transformers.hunyuan_transformer_2d"

# Tencent-Hunyuan/HunyuanDiT-v1.2-Diffusers' transformer config (DiT-g/2: 40 blocks, 16 heads of 88,
# MLP ratio 4.3637 -> 6144), every constructor argument spelled out. v1.0 / v1.1 are the same network
# with the size and style conditions (use_style_cond_and_image_meta_size=True).
V12 = {
    "num_attention_heads": 16,
    "attention_head_dim": 88,
    "in_channels": 4,
    "patch_size": 2,
    "activation_fn": "gelu-approximate",
    "sample_size": 128,
    "hidden_size": 1408,
    "num_layers": 40,
    "mlp_ratio": 4.3637,
    "learn_sigma": True,
    "cross_attention_dim": 1024,
    "norm_type": "layer_norm",
    "cross_attention_dim_t5": 2048,
    "pooled_projection_dim": 1024,
    "text_len": 77,
    "text_len_t5": 256,
    "use_style_cond_and_image_meta_size": False,
}
V11 = {**V12, "use_style_cond_and_image_meta_size": True}

# The pipeline's RoPE grid is fitted into a 512-pixel base square (512 / 8 / patch_size patches a side).
_BASE_PIXELS = 512


def crop_region(grid_height: int, grid_width: int, base: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Where a ``grid_height x grid_width`` patch grid sits, resized (longer side to ``base``) and centred,
    inside a ``base x base`` square: the RoPE coordinates HunyuanDiTPipeline gives the model."""
    if grid_height > grid_width:
        height, width = base, int(round(base / grid_height * grid_width))
    else:
        height, width = int(round(base / grid_width * grid_height)), base
    top, left = int(round((base - height) / 2.0)), int(round((base - width) / 2.0))
    return (top, left), (top + height, left + width)


def rotary_embedding(head_dim: int, patch_size: int, grid_height: int, grid_width: int,
                     device: Any = None) -> tuple[Any, Any]:
    """The ``(cos, sin)`` 2-D RoPE tables (float32, ``(tokens, head_dim)``) the pipeline computes once for a
    ``grid_height x grid_width`` patch grid."""
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    base = _BASE_PIXELS // 8 // patch_size
    return get_2d_rotary_pos_embed(head_dim, crop_region(grid_height, grid_width, base),
                                   (grid_height, grid_width), device=device, output_type="pt")


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, height: int = 1024, width: int = 1024,
) -> dict:
    """One real-size batch as HunyuanDiTPipeline feeds the model: the SD VAE latent ``(1, 4, H/8, W/8)``
    (grad), the timestep in the model's dtype (it sets ``temb``'s dtype), the CLIP states and the mT5
    states at the config's fixed lengths (77 and 256: the pooler and the learned padding take exactly
    those) with all-ones masks, the RoPE tuple and, for v1.0 / v1.1, the size condition
    ``[H, W, H, W, 0, 0]`` and style 0.

    ``tokens`` overrides the image token count (rounded to a square grid of patches).
    """
    import torch

    cfg = model.config
    if tokens:
        height = width = square_side(tokens) * cfg.patch_size * 8
    grid_height, grid_width = height // 8 // cfg.patch_size, width // 8 // cfg.patch_size
    rope = rotary_embedding(cfg.attention_head_dim, cfg.patch_size, grid_height, grid_width, device)
    randn = tensor_maker(device, dtype)
    inputs = {
        "hidden_states": randn(1, cfg.in_channels, grid_height * cfg.patch_size, grid_width * cfg.patch_size,
                               grad=True),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, cfg.text_len, cfg.cross_attention_dim),
        "text_embedding_mask": torch.ones(1, cfg.text_len, device=device, dtype=torch.int64),
        "encoder_hidden_states_t5": randn(1, cfg.text_len_t5, cfg.cross_attention_dim_t5),
        "text_embedding_mask_t5": torch.ones(1, cfg.text_len_t5, device=device, dtype=torch.int64),
        "image_rotary_emb": rope,
    }
    if cfg.use_style_cond_and_image_meta_size:
        size = [[height, width, height, width, 0, 0]]  # original size, target size, crop top-left
        inputs["image_meta_size"] = torch.tensor(size, device=device, dtype=dtype)
        inputs["style"] = torch.zeros(1, device=device, dtype=torch.int64)
    return inputs


_TRUNK = "1.5B DiT-g/2 (40 blocks with U-ViT long skips, 16 x 88 heads)"
_TEXT = "77 CLIP + 256 mT5 text tokens"

HUNYUANDIT = Family(
    name="hunyuandit",
    description="Hunyuan-DiT text-to-image (HunyuanDiT2DModel)",
    models=(f"{_M}.HunyuanDiT2DModel",),
    block_lists=(BlockList("blocks"),),
    block_classes=(
        BlockClass(f"{_M}.HunyuanDiTBlock", ffn=(("norm3", "ff"),), attention=("attn1", "attn2")),
    ),
    presets={
        "v1.2-1024": Preset(
            f"Hunyuan-DiT v1.2 {_TRUNK} at 1024x1024 (64 x 64 = 4096 image tokens; {_TEXT})",
            config=V12,
            inputs={"height": 1024, "width": 1024},
            make_inputs=make_inputs,
        ),
        "v1.2-1280": Preset(
            f"Hunyuan-DiT v1.2 {_TRUNK} at 1280x1280, its largest supported shape (80 x 80 = 6400 image "
            f"tokens; {_TEXT})",
            config=V12,
            inputs={"height": 1280, "width": 1280},
            make_inputs=make_inputs,
        ),
        "v1.1-1024": Preset(
            f"Hunyuan-DiT v1.1 (and v1.0) {_TRUNK} with the size and style conditions, at 1024x1024 "
            f"(4096 image tokens; {_TEXT})",
            config=V11,
            inputs={"height": 1024, "width": 1024},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(HUNYUANDIT)
