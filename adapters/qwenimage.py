"""Qwen-Image (QwenImageTransformer2DModel: Qwen-Image, Qwen-Image-Edit / Edit-2509 / Edit-2511, Layered).

One block list, ``transformer_blocks``, all ``QwenImageTransformerBlock``: a dual-stream MMDiT
block keeping an image and a text stream, each modulated from ``temb`` by its own ``img_mod`` /
``txt_mod``, meeting only in the joint attention ``attn``. The model's loop calls every block as
``block(hidden_states=, encoder_hidden_states=, encoder_hidden_states_mask=, temb=,
image_rotary_emb=, joint_attention_kwargs=, modulate_index=)`` and gets
``(encoder_hidden_states, hidden_states)`` back. The mask, ``temb``, the rotary tuple, the kwargs
dict and ``modulate_index`` (the per-token 0/1 selector the Edit-2511 ``zero_cond_t`` variant uses
to modulate its reference-image tokens with timestep 0) are built once before the loop and are the
same objects for every block, so the list carries ``{"encoder_hidden_states": 0,
"hidden_states": 1}``. ControlNet residuals (``controlnet_block_samples``) are added to
``hidden_states`` between blocks: a chunk sees a tensor its predecessor did not return and falls
back to one region per block, exactly.

FFN seams: each stream's MLP (``img_mlp``, ``txt_mlp``, diffusers' ``FeedForward`` with a
tanh-GELU, ``4·d`` wide) is called on exactly its modulated ``norm2`` output, gate and residual
outside it; each is a seam. ``img_norm2`` / ``txt_norm2`` cannot join: their output is scaled and
shifted before the MLP sees it. The joint attention ``attn`` is the whole attention side.

Edit variants feed the reference image(s) as extra image tokens (``img_shapes`` lists one shape per
image), the Layered variant adds ``additional_t_cond`` and a layer-aware RoPE: all of that happens
before the loop, so the same declaration covers them. Qwen-Image 2.1
(``QwenImage21Transformer2DModel``) is a different, single-stream architecture: the
``qwenimage21`` family covers it.
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl

_M = "diffusers.models.transformers.transformer_qwenimage"


def make_inputs(model, device, dtype, tokens=None, *, image_tokens=4096, text_tokens=512, images=1) -> dict:
    """One real-size batch: packed latents (grad) for ``images`` square images of ``tokens`` tokens each
    (the first the target, the rest Edit reference images), Qwen2.5-VL text states and their mask."""
    import torch

    cfg = model.config
    side = max(1, round((tokens or image_tokens) ** 0.5))
    shapes = [(1, side, side)] * images
    return {
        "hidden_states": torch.randn(
            1, images * side * side, cfg.in_channels, device=device, dtype=dtype, requires_grad=True
        ),
        "encoder_hidden_states": torch.randn(1, text_tokens, cfg.joint_attention_dim, device=device, dtype=dtype),
        "encoder_hidden_states_mask": torch.ones(1, text_tokens, device=device, dtype=torch.bool),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "img_shapes": [shapes],
    }


QWENIMAGE = Family(
    name="qwenimage",
    description="Qwen-Image / Qwen-Image-Edit (2509, 2511) / Layered (QwenImageTransformer2DModel)",
    models=(f"{_M}.QwenImageTransformer2DModel",),
    block_lists=(
        BlockList("transformer_blocks", carry=Carry({"encoder_hidden_states": 0, "hidden_states": 1})),
    ),
    block_classes=(
        BlockClass(f"{_M}.QwenImageTransformerBlock", ffn=(("img_mlp",), ("txt_mlp",)), attention=("attn",)),
    ),
    presets={
        "1024": Preset(
            "Qwen-Image 20B (60 blocks, 24 x 128 heads, MLP 4x) at 1024x1024 (4096 image + 512 text tokens)",
            config={},  # the class defaults are the flagship config
            inputs={"image_tokens": 4096, "text_tokens": 512},
            make_inputs=make_inputs,
        ),
        "edit-2511-1024": Preset(
            "Qwen-Image-Edit-2511 (60 blocks, zero_cond_t) at 1024x1024 with one reference image "
            "(2 x 4096 image + 512 text tokens)",
            config={"zero_cond_t": True},
            inputs={"image_tokens": 4096, "text_tokens": 512, "images": 2},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(QWENIMAGE)
