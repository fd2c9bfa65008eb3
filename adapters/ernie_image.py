"""ERNIE-Image and ERNIE-Image-Turbo (ErnieImageTransformer2DModel).

A single-stream DiT: the patch-embedded image tokens and the projected text states are concatenated
into one sequence, laid out sequence-first (``[S, B, H]``), before the blocks. One block list,
``layers``, all ``ErnieImageSharedAdaLNBlock``, called positionally as
``layer(x, rotary_pos_emb, temb, attention_mask)``; the block returns the new ``x`` alone.

Modulation is shared, not per block: the model computes the six AdaLN tensors once from the timestep
embedding, before the loop. The loop does build a *new list* ``temb = [shift_msa, ..., gate_mlp]``
for every block, but of the very same six tensor objects; gradseam compares list arguments item by
item (type, length, each tensor by identity and version), so that list counts as unchanged. The RoPE
table and the boolean mask (image tokens plus each prompt's valid text tokens) are built once as
well, and nothing is added between blocks: the list carries ``{"x": None}``.

FFN seam ``("mlp",)``: the block computes ``x + gate * mlp(adaLN_mlp_ln(x) * (1 + scale) + shift)``
(the modulation in fp32, cast back), so ``mlp`` (``ErnieImageFeedForward``: ``gate_proj`` and
``up_proj`` to ``ffn_hidden_size``, GELU, product, ``linear_fc2``) is called on exactly that value,
with gate and residual outside; ``adaLN_mlp_ln`` cannot join (modulated first). Recomputing it drops
both ``ffn_hidden_size``-wide projections, the GELU and the product for every token.

Attention side: ``self_attention`` (projections, QK RMSNorms, RoPE and the masked kernel).
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

_M = "diffusers.models.transformers.transformer_ernie_image"

# The released transformer (baidu/ERNIE-Image and baidu/ERNIE-Image-Turbo, transformer/config.json):
# wider and deeper than the class defaults (3072 wide, 24 layers, 2560-wide text).
RELEASED = {
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_layers": 36,
    "ffn_hidden_size": 12288,
    "in_channels": 128,
    "out_channels": 128,
    "patch_size": 1,
    "text_in_dim": 3072,
    "rope_theta": 256,
    "rope_axes_dim": (32, 48, 48),
    "eps": 1e-6,
    "qk_layernorm": True,
}


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, image_tokens: int = 4096,
    text_tokens: int = 512,
) -> dict:
    """One real-size batch as ``ErnieImagePipeline`` builds it: the 2x2-patchified latent
    ``(1, 128, H/16, W/16)`` (grad) of a square image of about ``tokens`` tokens, the text encoder's
    second-to-last hidden states of ``text_tokens`` tokens and their length (at batch 1 the pipeline
    pads nothing)."""
    import torch

    cfg = model.config
    randn = tensor_maker(device, dtype)
    side = square_side(tokens or image_tokens) * cfg.patch_size
    return {
        "hidden_states": randn(1, cfg.in_channels, side, side, grad=True),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "text_bth": randn(1, text_tokens, cfg.text_in_dim),
        "text_lens": torch.full((1,), text_tokens, device=device, dtype=torch.long),
    }


ERNIE_IMAGE = Family(
    name="ernie-image",
    description="ERNIE-Image / ERNIE-Image-Turbo (ErnieImageTransformer2DModel)",
    models=(f"{_M}.ErnieImageTransformer2DModel",),
    block_lists=(BlockList("layers", carry=Carry({"x": None})),),
    block_classes=(
        BlockClass(f"{_M}.ErnieImageSharedAdaLNBlock", ffn=(("mlp",),), attention=("self_attention",)),
    ),
    presets={
        "1024": Preset(
            "ERNIE-Image 8B (36 single-stream blocks, hidden 4096, 32 x 128 heads, GELU-gated FFN 12288; the "
            "released config, not the class defaults) at 1024x1024: 4096 image + 512 text tokens (the text "
            "count assumed: a long prompt)",
            config=RELEASED,
            inputs={"image_tokens": 4096, "text_tokens": 512},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(ERNIE_IMAGE)
