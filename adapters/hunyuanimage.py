"""HunyuanImage 2.1 text-to-image, its distilled model and its refiner (HunyuanImageTransformer2DModel).

The HunyuanVideo architecture over an image: three block lists, in the order the model runs them.

- **Token refiner** (``context_embedder.token_refiner.refiner_blocks``,
  ``HunyuanImageIndividualTokenRefinerBlock``): plain pre-norm blocks over the Qwen2.5-VL prompt
  states inside ``context_embedder``. The loop is ``hidden_states = block(hidden_states, temb,
  self_attn_mask)`` with ``temb`` and the square prompt mask built once before it, so
  ``Carry({"hidden_states": None})``. The MLP is ``ff(norm2(hidden_states))``, gate and residual
  outside, nothing in between: ``norm2 → ff`` is a strict chain and the seam.
- **Dual-stream blocks** (``transformer_blocks``, ``HunyuanImageTransformerBlock``) and
  **single-stream blocks** (``single_transformer_blocks``, ``HunyuanImageSingleTransformerBlock``):
  both loops call ``block(hidden_states, encoder_hidden_states, temb, attention_mask=,
  image_rotary_emb=)`` and take back ``(hidden_states, encoder_hidden_states)``. The timestep (and
  guidance / MeanFlow ``timestep_r``) embedding ``temb``, the text-padding mask and the RoPE table
  are computed once before the trunk, and with ByT5 glyph states the text stream is reordered
  (valid tokens first) once, before the first block too; nothing is added between blocks, so both
  lists carry ``{"hidden_states": 0, "encoder_hidden_states": 1}``. Seams: in the dual-stream
  blocks ``ff`` and ``ff_context``, each called on exactly its modulated ``norm2`` output with gate
  and residual outside (``norm2`` cannot join: its output is scaled and shifted first); in the
  single blocks, as in Flux, the MLP branch ``proj_mlp → act_mlp`` that runs in parallel with
  attention (``proj_out`` takes both branches and stays out, or attention would be recomputed).

Attention side: ``attn`` in every block class.

The refiner checkpoint is the same class with a 3-D patch (one latent frame of a 16x VAE, the noisy
latents and the conditioning image's stacked on channels): only the embedders and the RoPE change.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

_M = "diffusers.models.transformers.transformer_hunyuanimage"


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, height: int = 2048, width: int = 2048,
    spatial: int = 32, text_tokens: int = 1000, byt5_tokens: int = 128,
) -> dict:
    """One real-size batch as ``HunyuanImagePipeline`` builds it: latents ``(1, C, H/32, W/32)`` (grad),
    the Qwen2.5-VL prompt states padded to 1000 tokens with their mask, the ByT5 glyph states (128
    tokens) where the model has a ByT5 projection, and ``guidance`` (3.25 x 1000) and ``timestep_r``
    for the guidance-distilled MeanFlow checkpoint. A model with a 3-D patch (the refiner) gets one
    latent frame, ``(1, C, 1, H/spatial, W/spatial)``.

    ``tokens`` overrides the image token count (a square latent grid of about that many tokens).
    """
    import torch

    cfg = model.config
    h, w = height // spatial, width // spatial
    if tokens:
        h = w = square_side(tokens)
    randn = tensor_maker(device, dtype)
    frame = (1,) if len(cfg.patch_size) == 3 else ()
    inputs = {
        "hidden_states": randn(1, cfg.in_channels, *frame, h, w, grad=True),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, text_tokens, cfg.text_embed_dim),
        "encoder_attention_mask": torch.ones(1, text_tokens, device=device, dtype=torch.int64),
    }
    if cfg.text_embed_2_dim is not None:
        inputs["encoder_hidden_states_2"] = randn(1, byt5_tokens, cfg.text_embed_2_dim)
        inputs["encoder_attention_mask_2"] = torch.ones(1, byt5_tokens, device=device, dtype=torch.int64)
    if cfg.guidance_embeds:
        inputs["guidance"] = torch.full((1,), 3250.0, device=device, dtype=dtype)
    if cfg.use_meanflow:
        inputs["timestep_r"] = torch.full((1,), 400.0, device=device, dtype=dtype)
    return inputs


# The released configs (the HunyuanImage-2.1 repository's model configs): the class defaults are the
# base model's trunk but leave out its ByT5 glyph projection (text_embed_2_dim=1472, byt5-small's width).
_BASE = {"text_embed_2_dim": 1472}
_DISTILLED = {"text_embed_2_dim": 1472, "guidance_embeds": True, "use_meanflow": True}
_REFINER = {
    "in_channels": 128, "out_channels": 64, "num_attention_heads": 26, "patch_size": (1, 1, 1),
    "rope_axes_dim": (16, 56, 56), "guidance_embeds": True, "use_meanflow": True,
}
_TRUNK = "17B (20 dual-stream + 40 single-stream blocks, 28 x 128 heads; 2 refiner blocks)"
_STREAMS = Carry({"hidden_states": 0, "encoder_hidden_states": 1})  # both stream lists return (image, text)

HUNYUANIMAGE = Family(
    name="hunyuanimage",
    description="HunyuanImage 2.1 text-to-image and refiner (HunyuanImageTransformer2DModel)",
    models=(f"{_M}.HunyuanImageTransformer2DModel",),
    block_lists=(
        BlockList("context_embedder.token_refiner.refiner_blocks", carry=Carry({"hidden_states": None})),
        BlockList("transformer_blocks", carry=_STREAMS),
        BlockList("single_transformer_blocks", carry=_STREAMS),
    ),
    block_classes=(
        BlockClass(f"{_M}.HunyuanImageIndividualTokenRefinerBlock", ffn=(("norm2", "ff"),), attention=("attn",)),
        BlockClass(f"{_M}.HunyuanImageTransformerBlock", ffn=(("ff",), ("ff_context",)), attention=("attn",)),
        BlockClass(f"{_M}.HunyuanImageSingleTransformerBlock", ffn=(("proj_mlp", "act_mlp"),), attention=("attn",)),
    ),
    presets={
        "2048": Preset(
            f"HunyuanImage 2.1 {_TRUNK} with the ByT5 glyph projection at 2048x2048, its native size (32x VAE: "
            "4096 image tokens; 1000 Qwen2.5-VL + 128 ByT5 text tokens, the pipeline's padded lengths)",
            config=_BASE,
            inputs={"height": 2048, "width": 2048},
            make_inputs=make_inputs,
        ),
        "1024": Preset(
            "HunyuanImage 2.1 (as '2048') at 1024x1024 (1024 image tokens; 1000 + 128 text tokens)",
            config=_BASE,
            inputs={"height": 1024, "width": 1024},
            make_inputs=make_inputs,
        ),
        "distilled-2048": Preset(
            f"HunyuanImage 2.1 distilled {_TRUNK}, guidance embedding and MeanFlow timestep_r, at 2048x2048 "
            "(4096 image tokens; 1000 + 128 text tokens)",
            config=_DISTILLED,
            inputs={"height": 2048, "width": 2048},
            make_inputs=make_inputs,
        ),
        "refiner-2048": Preset(
            "HunyuanImage 2.1 refiner (20 dual-stream + 40 single-stream blocks, 26 x 128 heads; 3-D patch, "
            "128 input channels: latents and the conditioning image) at 2048x2048 through its 16x VAE "
            "(one latent frame of 128 x 128 = 16384 tokens; 256 text tokens, the refiner pipeline's)",
            config=_REFINER,
            inputs={"height": 2048, "width": 2048, "spatial": 16, "text_tokens": 256},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(HUNYUANIMAGE)
