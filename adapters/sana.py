"""Sana (``SanaTransformer2DModel``: Sana, Sana 1.5, Sana Sprint): a linear-attention DiT with a
convolutional FFN. SANA-Video, the same block design on video, is ``adapters/sana_video.py``.

One list, ``transformer_blocks``, of ``SanaTransformerBlock`` s that return ``hidden_states``
alone. The model's loop calls every block positionally with the same ``attention_mask``,
``encoder_hidden_states``, ``encoder_attention_mask``, ``timestep`` (the adaLN vector) and
post-patch sizes (plain ints), all built once before the loop; so a chunk carries
``hidden_states`` and nothing else. ControlNet samples are added to ``hidden_states`` in the loop
between blocks: a later block then sees other inputs than its predecessor's output, and gradseam
computes block by block, still exactly. (``attention_mask`` reaches the blocks but diffusers 0.42.1 does not use it in
them; the prompt mask ``encoder_attention_mask`` goes to the cross-attention.)

FFN seam: ``ff`` (``GLUMBConv``) is called on exactly the modulated ``norm2`` output, reshaped to a
feature map, and the gate and the residual are applied to its flattened return value outside it; checkpointing it alone is exact and
drops its widest activations: the inverted 1x1 convolution's ``2·mlp_ratio·d`` channels (5·d in
Sana), the SiLU over them, the depthwise convolution's output and the gated product. ``norm2``
cannot join, since its output is scaled and shifted before ``ff`` sees it.

Attention side: ``attn1`` (linear self-attention; its kernel is matmuls, not a scaled-dot-product
operator, so inside whole-block regions it is recomputed like any other op) and ``attn2``
(softmax cross-attention to the prompt). Both exist in every block: diffusers' block cannot run
without ``attn2`` (its forward reads ``attn2`` and ``norm2`` unconditionally).
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side

_IMAGE = "diffusers.models.transformers.sana_transformer"


def make_inputs(model, device, dtype, tokens=None, *, image_tokens=1024, text_tokens=300) -> dict:
    """One real-size Sana batch: a square DC-AE latent (grad), Gemma-2 prompt states and their mask.

    ``tokens`` overrides the image token count (rounded to a square grid of patches).
    """
    import torch

    cfg = model.config
    side = square_side(tokens or image_tokens) * cfg.patch_size
    latent = torch.randn(1, cfg.in_channels, side, side, device=device, dtype=dtype, requires_grad=True)
    return {"hidden_states": latent, **conditioning(cfg, text_tokens, device, dtype)}


def conditioning(cfg, text_tokens, device, dtype) -> dict:
    """What every Sana-design model is conditioned on (SANA-Video too): Gemma-2 prompt states and their
    mask, the timestep, and the guidance scale where the model embeds one (Sana Sprint)."""
    import torch

    inputs = {
        "encoder_hidden_states": torch.randn(1, text_tokens, cfg.caption_channels, device=device, dtype=dtype),
        "encoder_attention_mask": torch.ones(1, text_tokens, device=device, dtype=dtype),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
    }
    if cfg.guidance_embeds:
        inputs["guidance"] = torch.full((1,), 4.5, device=device, dtype=dtype)
    return inputs


SANA = Family(
    name="sana",
    description="Sana / Sana 1.5 / Sana Sprint (SanaTransformer2DModel)",
    models=(f"{_IMAGE}.SanaTransformer2DModel",),
    block_lists=(BlockList("transformer_blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(
        BlockClass(f"{_IMAGE}.SanaTransformerBlock", ffn=(("ff",),), attention=("attn1", "attn2")),
    ),
    presets={
        "1600m-1024": Preset(
            "Sana 1600M (20 blocks, 2240 wide: 70 x 32 linear heads, 20 x 112 cross heads) at 1024x1024 "
            "(1024 image + 300 text tokens)",
            config={"num_layers": 20, "num_attention_heads": 70, "attention_head_dim": 32,
                    "num_cross_attention_heads": 20, "cross_attention_head_dim": 112, "cross_attention_dim": 2240,
                    "caption_channels": 2304, "mlp_ratio": 2.5, "in_channels": 32, "out_channels": 32,
                    "sample_size": 32, "patch_size": 1},
            inputs={"image_tokens": 1024, "text_tokens": 300},
            make_inputs=make_inputs,
        ),
    },
)

@hookimpl
def register_families(register):
    register(SANA)
