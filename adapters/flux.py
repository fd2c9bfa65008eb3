"""Flux (FLUX.1 dev/schnell and the Flux Krea dev checkpoints, which share the class).

Double blocks: image and text streams, each with its own ``FeedForward`` (``ff``, ``ff_context``),
joint attention in ``attn``. A double block returns ``(encoder_hidden_states, hidden_states)``.

Single blocks have no FFN module: the MLP branch is ``proj_mlp`` -> ``act_mlp`` running in
parallel with attention, and both branches meet in ``proj_out``. The honest FFN seam is therefore
``proj_mlp -> act_mlp``: recomputing it drops the 4·d-wide MLP pre-activation each single block
would keep, while ``proj_out``'s input (the concatenation of both branches) is still kept, because
cutting there would also recompute attention.
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import flux_ids

_M = "diffusers.models.transformers.transformer_flux"


def make_inputs(model, device, dtype, tokens=None, *, image_tokens=4096, text_tokens=512, pooled=True) -> dict:
    """One real-size batch: packed latents (grad), T5 states, CLIP pooled vector, ids (image ``tokens``)."""
    import torch

    cfg = model.config
    img_ids, txt_ids = flux_ids(text_tokens, tokens or image_tokens, device)
    n = img_ids.shape[0]
    inputs = {
        "hidden_states": torch.randn(1, n, cfg.in_channels, device=device, dtype=dtype, requires_grad=True),
        "encoder_hidden_states": torch.randn(1, text_tokens, cfg.joint_attention_dim, device=device, dtype=dtype),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "img_ids": img_ids.to(dtype),
        "txt_ids": txt_ids.to(dtype),
    }
    if pooled:
        inputs["pooled_projections"] = torch.randn(1, cfg.pooled_projection_dim, device=device, dtype=dtype)
    if getattr(cfg, "guidance_embeds", False):
        inputs["guidance"] = torch.full((1,), 3.5, device=device, dtype=dtype)
    return inputs

FLUX = Family(
    name="flux",
    description="FLUX.1 dev / schnell / Krea dev (FluxTransformer2DModel)",
    models=(f"{_M}.FluxTransformer2DModel",),
    block_lists=(
        BlockList("transformer_blocks", carry=Carry({"encoder_hidden_states": 0, "hidden_states": 1})),
        BlockList("single_transformer_blocks", carry=Carry({"encoder_hidden_states": 0, "hidden_states": 1})),
    ),
    block_classes=(
        BlockClass(f"{_M}.FluxTransformerBlock", ffn=(("ff",), ("ff_context",)), attention=("attn",)),
        BlockClass(f"{_M}.FluxSingleTransformerBlock", ffn=(("proj_mlp", "act_mlp"),), attention=("attn",)),
    ),
    presets={
        "dev-1024": Preset(
            "Flux dev trunk (19 double + 38 single blocks, 24 x 128 heads) at 1024x1024 (4096 image + 512 text tokens)",
            config={},  # the class defaults are the flagship config
            inputs={"image_tokens": 4096, "text_tokens": 512},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(FLUX)
