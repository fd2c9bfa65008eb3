"""MageFlow (MageFlowTransformer2DModel), declared ahead of the diffusers release that adds it.

The class comes with an upstream pull request (huggingface/diffusers#14295) and its module path
may still move, so both the model and the block are named by bare class name: gradseam matches
them from whatever module defines them, as soon as the class is importable.

MageFlow is a Qwen-Image-style dual-stream MMDiT: every block of ``transformer_blocks`` keeps an
image and a text stream, modulated from ``temb`` by ``img_mod`` / ``txt_mod``, meeting only in the
joint attention ``attn``. The block returns ``(encoder_hidden_states, hidden_states)`` and the
model calls it by keyword, passing the same ``temb``, rotary embedding and
``joint_attention_kwargs`` to every block, so a chunk carries the two streams and nothing else.

Each stream's MLP (``img_mlp``, ``txt_mlp``) is a ``FeedForward`` called on exactly its modulated
``norm2`` output, with gate and residual applied to the return value outside it, so each is a
seam of its own; recomputing them drops the 4·d-wide activations of both streams. The joint
attention is the only place the streams meet, and it is the whole attention side.

The preset and the input builder follow the upstream class's signature (``context_in_dim``,
``hidden_size``, ``num_layers``, ``axes_dim``; ``img_ids`` required by ``forward``), so
``gradseam bench --family mageflow`` runs unchanged once a diffusers release exports the class.
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import grid_ids, square_side


def make_inputs(model, device, dtype, tokens=None, *, image_tokens=4096, text_tokens=512) -> dict:
    """One real-size batch: patch-1 latent tokens on a square grid (grad), text-encoder features, a
    sigma in [0, 1], and each image token's (frame, row, column) id, which upstream's forward requires."""
    import torch

    cfg = model.config
    side = square_side(tokens or image_tokens)
    img_ids = grid_ids(side, device)
    return {
        "hidden_states": torch.randn(
            1, side * side, cfg.in_channels, device=device, dtype=dtype, requires_grad=True
        ),
        "encoder_hidden_states": torch.randn(1, text_tokens, cfg.context_in_dim, device=device, dtype=dtype),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "img_ids": img_ids,
    }


MAGEFLOW = Family(
    name="mageflow",
    description="MageFlow dual-stream text-to-image (MageFlowTransformer2DModel, not yet in a diffusers release)",
    models=("MageFlowTransformer2DModel",),
    block_lists=(
        BlockList("transformer_blocks", carry=Carry({"encoder_hidden_states": 0, "hidden_states": 1})),
    ),
    block_classes=(
        BlockClass("MageFlowTransformerBlock", ffn=(("img_mlp",), ("txt_mlp",)), attention=("attn",)),
    ),
    presets={
        # The released checkpoint's geometry: 12 blocks of 24 x 128 heads over patch-1 latents of the
        # 128-channel, 16x-downsampling MageVAE, Qwen3-VL-4B text features (2560 wide), and rotary
        # widths 16 + 56 + 56 = 128 for frame, height and width.
        "base-1024": Preset(
            "MageFlow trunk (12 dual-stream blocks, hidden 3072 = 24 x 128 heads, 2560-wide text features) "
            "at 1024x1024 (4096 image + 512 text tokens)",
            config={
                "in_channels": 128, "out_channels": 128, "context_in_dim": 2560, "hidden_size": 3072,
                "num_attention_heads": 24, "num_layers": 12, "axes_dim": (16, 56, 56), "patch_size": 1,
            },
            inputs={"image_tokens": 4096, "text_tokens": 512},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(MAGEFLOW)
