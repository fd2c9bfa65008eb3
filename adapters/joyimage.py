"""JoyAI-Image Edit (``JoyImageEditTransformer3DModel``) and JoyAI-Image Edit Plus
(``JoyImageEditPlusTransformer3DModel``): two families, one per model class.

Both models are one list, ``double_blocks``, of dual-stream MMDiT blocks: an image and a text stream,
each with its own Wan-style modulation table (``img_mod`` / ``txt_mod``, a learned ``(1, 6, D)`` table
plus the shared ``(B, 6, D)`` timestep projection), meeting only in the joint attention ``attn``. Every
block returns ``(hidden_states, encoder_hidden_states)``: image first, so the carry is
``{"hidden_states": 0, "encoder_hidden_states": 1}`` (the reverse of Qwen-Image's order).

Why two families and not one: the block classes differ (``JoyImageTransformerBlock`` /
``JoyImageEditPlusTransformerBlock``; the Plus block takes an ``attention_mask`` and its processor a
per-sample ``(B, S, D)`` RoPE table), and so do the model inputs (the Edit model takes a 5-D latent or
a 6-D stack of same-sized items; the Plus model takes pre-patchified, padded 6-D patches, a
``shape_list`` and a text mask). A family's presets build its first model class only, so each class
gets a family of its own, with its own input builder. The declarations are otherwise the same cut.

Carry, Edit: the loop calls ``block(hidden_states=, encoder_hidden_states=, temb=,
image_rotary_emb=(vis_freqs, txt_freqs))``. The tuple is built afresh for every call, but its items
are the same objects every time (the visual ``(cos, sin)`` pair, and the text pair or ``None``: only
``rope_type="mrope"`` gives the text tokens a RoPE), and gradseam compares tuple arguments item by
item; ``temb`` is computed once before the loop. Nothing is added between blocks, so chunks run whole.
Carry, Plus: ``block(hidden_states=, encoder_hidden_states=, temb=, image_rotary_emb=vis_freqs,
attention_mask=)``, the batched RoPE tuple and the ``(B, 1, 1, S_img + S_txt)`` boolean mask (``None``
without a text mask) each built once before the loop: the same objects for every block.

FFN seams: each stream's MLP (``img_mlp``, ``txt_mlp``: diffusers' ``FeedForward`` with a tanh-GELU,
``4·D`` wide) is called on exactly ``norm2(x) * (1 + scale) + shift``, a fresh tensor nothing else
uses, and its output only goes to ``x + out * gate``: each MLP alone is a strict chain. ``img_norm2`` /
``txt_norm2`` cannot join, since their output is scaled and shifted before the MLP sees it. The last
block's text stream feeds nothing (the model drops ``txt`` after the loop); its ``txt_mlp`` region
runs and simply gets no gradient, as unpatched.

Attention side: ``attn`` (fused QKV projections of both streams, per-head RMS QK norms, RoPE, the one
joint attention call through diffusers' dispatcher, both output projections), every kernel call inside
its processor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

_EDIT = "diffusers.models.transformers.transformer_joyimage"
_PLUS = "diffusers.models.transformers.transformer_joyimage_edit_plus"

# The image stream is returned first, the text stream second.
_CARRY = Carry({"hidden_states": 0, "encoder_hidden_states": 1})
_SEAMS = (("img_mlp",), ("txt_mlp",))

# jdopensource/JoyAI-Image-Edit-Diffusers and JoyAI-Image-Edit-Plus-Diffusers, transformer/config.json
# (the class defaults are a smaller 3072-wide, 20-block trunk that no release uses): 40 blocks,
# 32 x 128 heads, MLP 4x, Qwen3-VL-8B states 4096 wide, Wan 2.1 VAE latents (16 channels), RoPE
# axes 16 + 56 + 56 with theta 10000, about 16B parameters.
JOYAI_IMAGE = {
    "patch_size": [1, 2, 2], "in_channels": 16, "out_channels": 16, "hidden_size": 4096, "num_attention_heads": 32,
    "text_dim": 4096, "mlp_width_ratio": 4.0, "num_layers": 40, "rope_dim_list": [16, 56, 56], "rope_type": "rope",
    "theta": 10000,
}
TRUNK = "JoyAI-Image 16B (40 blocks, 32 x 128 heads, MLP 4x)"

# Qwen3-VL text states: the pipelines do not pad a prompt, so the length is the instruction's plus the
# vision tokens of every reference image the encoder sees (a 1024² image: 64 x 64 patches of 16 pixels,
# merged 2 x 2, 1024 tokens). The 128 instruction tokens are an assumption.
PROMPT_TOKENS = 128
VISION_TOKENS = 1024
SPATIAL = 8  # Wan 2.1 VAE: 8x spatial compression, 16 latent channels


def _side(tokens: int | None, image_tokens: int, height: int | None, width: int | None) -> tuple[int, int]:
    """Patch grid ``(rows, cols)`` of one image: ``tokens`` when given, else ``height x width`` pixels when
    given, else the square grid nearest ``image_tokens``."""
    if tokens is None and height is not None and width is not None:
        return height // (2 * SPATIAL), width // (2 * SPATIAL)
    side = square_side(tokens or image_tokens)
    return side, side


def make_edit_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, image_tokens: int = 4096, items: int = 2,
    text_tokens: int | None = None, height: int | None = None, width: int | None = None,
) -> dict:
    """One real-size batch as ``JoyImageEditPipeline`` feeds the transformer: ``items`` latent images of
    one size stacked as ``(1, items, 16, 1, H/8, W/8)`` (grad; the reference first, the noisy target last;
    ``items=1`` is text-to-image), the Qwen3-VL states (the instruction plus 1024 vision tokens per
    reference unless ``text_tokens`` says) and the timestep. ``tokens`` sets each item's token count."""
    import torch

    cfg = model.config
    rows, cols = _side(tokens, image_tokens, height, width)
    _, ph, pw = cfg.patch_size
    randn = tensor_maker(device, dtype)
    text = text_tokens if text_tokens is not None else PROMPT_TOKENS + VISION_TOKENS * (items - 1)
    return {
        "hidden_states": randn(1, items, cfg.in_channels, 1, rows * ph, cols * pw, grad=True),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, text, cfg.text_dim),
    }


def make_plus_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, image_tokens: int = 4096,
    references: int = 1, text_tokens: int | None = None, height: int | None = None, width: int | None = None,
) -> dict:
    """One real-size batch as ``JoyImageEditPlusPipeline`` feeds the transformer: the target and
    ``references`` reference images of one size, each patchified on its own and concatenated into
    ``(1, patches, 16, 1, 2, 2)`` (grad), their ``shape_list``, the Qwen3-VL states with their mask (the
    instruction plus 1024 vision tokens per reference unless ``text_tokens`` says) and the timestep.
    ``tokens`` sets each image's token count."""
    import torch

    cfg = model.config
    rows, cols = _side(tokens, image_tokens, height, width)
    pt, ph, pw = cfg.patch_size
    images = 1 + references
    randn = tensor_maker(device, dtype)
    text = text_tokens if text_tokens is not None else PROMPT_TOKENS + VISION_TOKENS * references
    return {
        "hidden_states": randn(1, images * rows * cols, cfg.in_channels, pt, ph, pw, grad=True),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, text, cfg.text_dim),
        # the Qwen processor's attention mask, as the pipeline passes it (int64, all valid for one prompt)
        "encoder_hidden_states_mask": torch.ones(1, text, device=device, dtype=torch.long),
        "shape_list": [[(1, rows, cols)] * images],
    }


JOYIMAGE = Family(
    name="joyimage",
    description="JoyAI-Image Edit, image editing and text-to-image (JoyImageEditTransformer3DModel)",
    models=(f"{_EDIT}.JoyImageEditTransformer3DModel",),
    block_lists=(BlockList("double_blocks", carry=_CARRY),),
    block_classes=(BlockClass(f"{_EDIT}.JoyImageTransformerBlock", ffn=_SEAMS, attention=("attn",)),),
    presets={
        "edit-1024": Preset(
            f"{TRUNK} editing at 1024x1024: reference + target (2 x 4096 image tokens), "
            f"{PROMPT_TOKENS} instruction + {VISION_TOKENS} vision tokens",
            config=JOYAI_IMAGE,
            inputs={"image_tokens": 4096, "items": 2},
            make_inputs=make_edit_inputs,
        ),
        "t2i-1024": Preset(
            f"{TRUNK} text-to-image at 1024x1024 (4096 image + {PROMPT_TOKENS} text tokens)",
            config=JOYAI_IMAGE,
            inputs={"image_tokens": 4096, "items": 1},
            make_inputs=make_edit_inputs,
        ),
    },
)

JOYIMAGE_EDIT_PLUS = Family(
    name="joyimage-edit-plus",
    description="JoyAI-Image Edit Plus, multi-image editing (JoyImageEditPlusTransformer3DModel)",
    models=(f"{_PLUS}.JoyImageEditPlusTransformer3DModel",),
    block_lists=(BlockList("double_blocks", carry=_CARRY),),
    block_classes=(BlockClass(f"{_PLUS}.JoyImageEditPlusTransformerBlock", ffn=_SEAMS, attention=("attn",)),),
    presets={
        "1024": Preset(
            f"{TRUNK} editing at 1024x1024 with one reference image (2 x 4096 image tokens), "
            f"{PROMPT_TOKENS} instruction + {VISION_TOKENS} vision tokens",
            config=JOYAI_IMAGE,
            inputs={"image_tokens": 4096, "references": 1},
            make_inputs=make_plus_inputs,
        ),
        "1024-3refs": Preset(
            f"{TRUNK} editing at 1024x1024 with three reference images (4 x 4096 image tokens), "
            f"{PROMPT_TOKENS} instruction + 3 x {VISION_TOKENS} vision tokens",
            config=JOYAI_IMAGE,
            inputs={"image_tokens": 4096, "references": 3},
            make_inputs=make_plus_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Callable[[Family], None]) -> None:
    register(JOYIMAGE)
    register(JOYIMAGE_EDIT_PLUS)
