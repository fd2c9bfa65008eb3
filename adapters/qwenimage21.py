"""Qwen-Image 2.1 (QwenImage21Transformer2DModel: text-to-image and image-conditioned generation).

A single-stream model, unrelated in structure to Qwen-Image (``qwenimage``): the Qwen3-VL text
states, the condition images' latent tokens (dropped into the slots the vision-language encoder
reserved for them, one slot per 2x2 latent tokens) and the target image's tokens form one joint
sequence. One block list, ``transformer_blocks``, all ``QwenImage21TransformerBlock``, called by the
model's loop as ``block(hidden_states=, modulation=, rotary_emb=, attention_mask=,
target_token_mask=, layer_cache=, kv_cache_mode=, cache_write_slice=, segments=, key_valid=)``; a
block returns the joint sequence alone. Modulation is not learned per block: the model computes one
``modulation`` tensor and every block splits that same tensor. The rotary table, the (flex) mask,
the target-token mask, the cache mode and write slice, the prefix segment list and the key padding
mask are likewise built once before the loop and are the same objects for every block, so the list
carries ``{"hidden_states": None}``.

The one exception is ``layer_cache``: with a KV cache (the pipeline's default, ``use_kv_cache``)
the loop passes each block its own ``QwenImage21KVLayerCache`` (``kv_cache.get_layer(i)``), which
the attention fills with the prefix K/V in extract mode (the first denoising step) and reads in
cached mode (the later ones). An interval chunk runs its later blocks ahead with its first block's
arguments, so they would store their K/V in the first block's cache; the outputs would come out
right (each later block notices the other cache and computes again) but the cache would not. The
list therefore declares ``per_block=("layer_cache",)``: while a cache is passed, each block of a
chunk is its own region (a counted fall-back) and the cache is the unpatched model's. Recomputing a
block in backward hands it the same layer cache: extract mode stores the same K/V again (recomputed
exactly), cached mode reads what it read in forward. Without a cache the chunks run whole.

FFN seam: the block's only MLP, ``img_mlp`` (a SwiGLU: ``gate_layer`` and ``proj`` to ``3·d``,
SiLU, product, ``out``), is called on exactly the modulated ``img_norm2`` output, its tanh gate and
the residual outside it; it is a seam, and recomputing it drops the two ``3·d``-wide projections,
the SiLU output and the product for every token of the joint sequence (there is no separate text
MLP). ``img_norm2`` cannot join: its output is scaled before the MLP sees it.

Attention side: ``attn`` (projections, QK norms and the block-causal attention: one SDPA call per
prefix segment plus one for the target with the default processor, one ``flex_attention`` call with
the flex processor; both live inside ``attn``).
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl

_M = "diffusers.models.transformers.transformer_qwenimage21"

# The pipeline's text slots before the first condition image ("<|im_start|>user\n<image1><|vision_start|>"
# after the dropped system prompt) and between two of them (" <imageN><|vision_start|>" after a
# "<|vision_end|>"): a few tokens each; the rest of the prompt follows the last image.
_LEAD_TOKENS = 6


def make_inputs(model, device, dtype, tokens=None, *, image_tokens=4096, text_tokens=512, images=0) -> dict:
    """One real-size batch as ``QwenImage21Pipeline`` builds it: packed latents (grad) of ``images``
    condition images and the target, each a square of about ``tokens`` latent tokens; Qwen3-VL states
    of ``text_tokens`` text tokens plus one vision slot per 2x2 latent tokens of each condition image;
    and ``img_mask`` over that sequence with the target's slots appended. No text mask: at batch 1 the
    pipeline pads nothing and passes none."""
    import torch

    cfg = model.config
    side = max(2, 2 * round((tokens or image_tokens) ** 0.5 / 2))  # even: a slot is 2x2 latent tokens
    slots = side * side // 4
    lead = min(_LEAD_TOKENS, text_tokens // (images + 1)) if images else 0
    layout: list[bool] = []
    for _ in range(images):
        layout += [False] * lead + [True] * slots
    layout += [False] * (text_tokens - lead * images)
    img_mask = torch.tensor([layout + [True] * slots], device=device)
    return {
        "hidden_states": torch.randn(
            1, (images + 1) * side * side, cfg.in_channels * cfg.patch_size**2, device=device, dtype=dtype,
            requires_grad=True,
        ),
        "encoder_hidden_states": torch.randn(1, len(layout), cfg.context_in_dim, device=device, dtype=dtype),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "img_shapes": [[(1, side, side)] * (images + 1)],
        "img_mask": img_mask,
    }


QWENIMAGE21 = Family(
    name="qwenimage21",
    description="Qwen-Image 2.1 (QwenImage21Transformer2DModel)",
    models=(f"{_M}.QwenImage21Transformer2DModel",),
    block_lists=(
        BlockList("transformer_blocks", carry=Carry({"hidden_states": None}), per_block=("layer_cache",)),
    ),
    block_classes=(
        BlockClass(f"{_M}.QwenImage21TransformerBlock", ffn=(("img_mlp",),), attention=("attn",)),
    ),
    presets={
        "1024": Preset(
            "Qwen-Image 2.1 (32 single-stream blocks, 32 x 128 heads, SwiGLU 3x, ~7B; diffusers' class "
            "defaults, assumed to be the released config) at 1024x1024: one joint sequence of 512 text + "
            "4096 image tokens (the text count is assumed: a long prompt; at batch 1 the pipeline pads "
            "nothing, so most prompts are shorter)",
            config={},  # the class defaults (see the description)
            inputs={"image_tokens": 4096, "text_tokens": 512},
            make_inputs=make_inputs,
        ),
        "edit-1024": Preset(
            "Qwen-Image 2.1 (as '1024') at 1024x1024 conditioned on one image resized to 1024x1024: one "
            "joint sequence of 512 text (assumed, as in '1024') + 4096 condition + 4096 target image "
            "tokens (the condition's latents fill its 1024 Qwen3-VL vision slots, one per 2x2 tokens)",
            config={},
            inputs={"image_tokens": 4096, "text_tokens": 512, "images": 1},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(QWENIMAGE21)
