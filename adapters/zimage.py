"""Z-Image (ZImageTransformer2DModel: Z-Image / Z-Image-Turbo, and the Omni variant with SigLIP).

Four block lists, all ``ZImageTransformerBlock``: ``noise_refiner`` (image tokens, with timestep
modulation), ``context_refiner`` (caption tokens, ``modulation=False``), ``siglip_refiner`` (SigLIP
tokens, no modulation; only built when ``siglip_feat_dim`` is set, hence optional) and the main
``layers`` on the unified sequence. The model calls every block positionally as
``layer(x, attn_mask, freqs_cis[, adaln_input, noise_mask, adaln_noisy, adaln_clean])`` and gets
``x`` back; all other arguments are the same objects along a list, so interval chunks work
(ControlNet residuals added between main layers make the chain fall back to one region per
block, still exact).

FFN seam ``("feed_forward", "ffn_norm2")``: the block computes
``ffn_norm2(feed_forward(ffn_norm1(x) * scale_mlp))`` (no ``* scale_mlp`` in unmodulated blocks),
so ``feed_forward -> ffn_norm2`` is the only strict chain common to both kinds of block;
``ffn_norm1`` cannot join because of the multiply in modulated blocks (both kinds share one
class, and a seam is declared per class). Recomputing it drops the SwiGLU's four
``8/3·dim``-wide tensors (``w1`` and ``w3`` outputs, the SiLU, the gated product) and the three
``dim``-wide tensors RMSNorm keeps on the FFN output (that output, its fp32 upcast, the fp32
normalised copy); the checkpoint keeps only the FFN input, which ``w1``/``w3`` would have kept
anyway. The attention side is ``attention``.
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl

_M = "diffusers.models.transformers.transformer_z_image"
_X = Carry({"x": None})


def make_inputs(model, device, dtype, tokens=None, *, image_tokens=4096, text_tokens=512) -> dict:
    """One real-size batch: a list with one latent ``(C, 1, H, W)`` (grad, 2x2 patches) and one caption."""
    import torch

    cfg = model.config
    side = 2 * max(1, round((tokens or image_tokens) ** 0.5))
    return {
        "x": [torch.randn(cfg.in_channels, 1, side, side, device=device, dtype=dtype, requires_grad=True)],
        "t": torch.full((1,), 0.3, device=device, dtype=dtype),
        "cap_feats": [torch.randn(text_tokens, cfg.cap_feat_dim, device=device, dtype=dtype)],
    }

ZIMAGE = Family(
    name="zimage",
    description="Z-Image / Z-Image-Turbo / Z-Image Omni (ZImageTransformer2DModel)",
    models=(f"{_M}.ZImageTransformer2DModel",),
    block_lists=(
        BlockList("noise_refiner", carry=_X),
        BlockList("context_refiner", carry=_X),
        BlockList("siglip_refiner", carry=_X, optional=True),
        BlockList("layers", carry=_X),
    ),
    block_classes=(
        BlockClass(f"{_M}.ZImageTransformerBlock", ffn=(("feed_forward", "ffn_norm2"),), attention=("attention",)),
    ),
    presets={
        "turbo-1024": Preset(
            "Z-Image(-Turbo) 6B (30 layers + 2 noise + 2 context refiners, dim 3840, 30 x 128 heads, "
            "SwiGLU 10240) at 1024x1024 (4096 image + 512 caption tokens)",
            config={},  # the class defaults are the flagship config
            inputs={"image_tokens": 4096, "text_tokens": 512},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(ZIMAGE)
