"""SANA-Video (``SanaVideoTransformer3DModel``): Sana's linear-attention block design on video
latents (Wan VAE), with rotary positions and an RMS qk-norm. ``adapters/sana.py`` is the image model.

One list, ``transformer_blocks``, of ``SanaVideoTransformerBlock`` s that return ``hidden_states``
alone. The model's loop calls every block positionally with the same ``attention_mask``,
``encoder_hidden_states``, ``encoder_attention_mask``, ``timestep`` (the adaLN vector, one per
token when the image-to-video pipeline passes a per-token timestep), latent sizes (plain ints) and
``rotary_emb``, all built once before the loop; so a chunk carries ``hidden_states`` and nothing
else. ControlNet samples added to ``hidden_states`` between blocks make a later block see other
inputs than its predecessor's output: gradseam then computes block by block, still exactly.

FFN seam: ``ff`` (``GLUMBTempConv``: Sana's ``GLUMBConv`` per frame, then a temporal convolution,
all inside the module) is called on exactly the modulated ``norm2`` output, unflattened to
``(batch, frames, height, width, dim)``; the gate and the residual are applied to its flattened
return value outside it. Checkpointing it alone is exact and drops its widest activations (the
inverted 1x1 convolution's ``2·mlp_ratio·d`` channels, the SiLU, the depthwise convolution and the
gated product). ``norm2`` cannot join: its output is scaled and shifted first.

Attention side: ``attn1`` (linear self-attention with rotary; matmuls, not a scaled-dot-product
operator, so recomputed inside whole-block regions) and ``attn2`` (cross-attention to the prompt).
Both exist in every block: the block's forward reads ``attn2`` and ``norm2`` unconditionally.
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import video_latent_size

from .sana import conditioning  # one design, one prompt conditioning

_M = "diffusers.models.transformers.transformer_sana_video"


def make_inputs(model, device, dtype, tokens=None, *, frames=81, height=480, width=832, text_tokens=300) -> dict:
    """One real-size SANA-Video batch: a Wan-VAE latent ``(1, C, (frames-1)/4+1, H/8, W/8)`` (grad),
    Gemma-2 prompt states and their mask. ``tokens`` overrides the video token count by changing the
    number of latent frames."""
    import torch

    cfg = model.config
    latent_frames, h, w = video_latent_size(frames, height, width, patch=tuple(cfg.patch_size), tokens=tokens)
    latent = torch.randn(1, cfg.in_channels, latent_frames, h, w, device=device, dtype=dtype, requires_grad=True)
    return {"hidden_states": latent, **conditioning(cfg, text_tokens, device, dtype)}


SANA_VIDEO = Family(
    name="sana-video",
    description="SANA-Video (SanaVideoTransformer3DModel)",
    models=(f"{_M}.SanaVideoTransformer3DModel",),
    block_lists=(BlockList("transformer_blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(
        BlockClass(f"{_M}.SanaVideoTransformerBlock", ffn=(("ff",),), attention=("attn1", "attn2")),
    ),
    presets={
        "2b-480p": Preset(
            "SANA-Video 2B (20 blocks, 20 x 112 heads, RMS qk-norm, rotary) at 480x832, 81 frames "
            "(32760 video + 300 text tokens)",
            config={"num_layers": 20, "num_attention_heads": 20, "attention_head_dim": 112,
                    "num_cross_attention_heads": 20, "cross_attention_head_dim": 112, "cross_attention_dim": 2240,
                    "caption_channels": 2304, "mlp_ratio": 2.5, "in_channels": 16, "out_channels": 16,
                    "sample_size": 30, "patch_size": (1, 2, 2), "qk_norm": "rms_norm_across_heads"},
            inputs={"frames": 81, "height": 480, "width": 832, "text_tokens": 300},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(SANA_VIDEO)
