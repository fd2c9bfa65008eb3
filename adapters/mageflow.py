"""MageFlow (MageFlowTransformer2DModel), declared ahead of the diffusers release that adds it.

The class comes with an upstream pull request and its module path may still move, so both the
model and the block are named by bare class name: gradseam matches them from whatever module
defines them, as soon as the class is importable.

MageFlow is a Qwen-Image-style dual-stream MMDiT: every block of ``transformer_blocks`` keeps an
image and a text stream, modulated from ``temb`` by ``img_mod`` / ``txt_mod``, meeting only in the
joint attention ``attn``. The block returns ``(encoder_hidden_states, hidden_states)`` and the
model calls it by keyword, passing the same ``temb`` and rotary embedding to every block, so a
chunk carries the two streams and nothing else.

Each stream's MLP (``img_mlp``, ``txt_mlp``) is a ``FeedForward`` called on exactly its modulated
``norm2`` output, with gate and residual applied to the return value outside it, so each is a
seam of its own; recomputing them drops the 4·d-wide activations of both streams. The joint
attention is the only place the streams meet, and it is the whole attention side.
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl


def make_inputs(model, device, dtype, tokens=None, *, image_tokens=4096, text_tokens=512) -> dict:
    """One real-size batch: packed latents (grad), text features, a timestep in [0, 1]."""
    import torch

    cfg = model.config
    n = max(1, round((tokens or image_tokens) ** 0.5)) ** 2
    return {
        "hidden_states": torch.randn(1, n, cfg.in_channels, device=device, dtype=dtype, requires_grad=True),
        "encoder_hidden_states": torch.randn(1, text_tokens, cfg.joint_attention_dim, device=device, dtype=dtype),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
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
        "base-1024": Preset(
            "MageFlow trunk (12 dual-stream blocks, hidden 3072 = 24 x 128 heads) at 1024x1024 "
            "(4096 image + 512 text tokens)",
            config={"num_layers": 12, "num_attention_heads": 24, "attention_head_dim": 128},
            inputs={"image_tokens": 4096, "text_tokens": 512},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(MAGEFLOW)
