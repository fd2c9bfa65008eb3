"""Stable Diffusion 3 / 3.5 (diffusers' ``SD3Transformer2DModel``) for gradseam: an example plugin.

Every block of ``transformer_blocks`` is a ``JointTransformerBlock`` (an MMDiT block): an image
and a text stream that meet only in the joint attention ``attn``. The model calls each block by
keyword and gets ``(encoder_hidden_states, hidden_states)`` back, passing the same ``temb`` and
``joint_attention_kwargs`` to every block, so a chunk of blocks carries the two streams and
nothing else. The last block is built with ``context_pre_only=True`` and returns ``None`` for the
text stream; nothing follows it, so no block ever receives that ``None`` and chunks ending in it
stay whole. ControlNet residuals (added in the model's loop between blocks) and ``skip_layers``
make a chunk see other inputs than its predecessor's outputs: gradseam then computes block by
block, still exactly.

FFN seam: ``ff`` is called on exactly the modulated ``norm2`` output, with the gate and the
residual applied to its return value outside it, so checkpointing it alone is exact and drops
its 4·d-wide GELU activations. ``ff_context`` would be the text stream's seam, but the last
block has none and a seam is declared per class, so it is left out (the text stream is ~333
tokens against 4096 image tokens at 1024², a few per cent of the FFN activations).

Attention side: ``attn``. SD3.5's extra image self-attention ``attn2`` exists only in the
``dual_attention_layers`` blocks, so it is not declared (its activations stay on the GPU).
"""

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl


def make_inputs(model, device, dtype, tokens=None, *, image_tokens=4096, text_tokens=333):
    """One real-size batch for the benchmarks: latents (with grad), T5+CLIP text states, pooled vector."""
    import torch  # here, not at the top: listing families must not import torch

    cfg = model.config
    side = max(1, round((tokens or image_tokens) ** 0.5)) * cfg.patch_size
    return {
        "hidden_states": torch.randn(1, cfg.in_channels, side, side, device=device, dtype=dtype, requires_grad=True),
        "encoder_hidden_states": torch.randn(1, text_tokens, cfg.joint_attention_dim, device=device, dtype=dtype),
        "pooled_projections": torch.randn(1, cfg.pooled_projection_dim, device=device, dtype=dtype),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
    }


SD3 = Family(
    name="sd3",
    description="Stable Diffusion 3 / 3.5 (SD3Transformer2DModel)",
    models=("diffusers.models.transformers.transformer_sd3.SD3Transformer2DModel",),
    block_lists=(
        BlockList("transformer_blocks", carry=Carry({"encoder_hidden_states": 0, "hidden_states": 1})),
    ),
    block_classes=(
        BlockClass("diffusers.models.attention.JointTransformerBlock", ffn=(("ff",),), attention=("attn",)),
    ),
    presets={
        "3-medium-1024": Preset(
            "SD3 medium (24 blocks, 24 x 64 heads) at 1024x1024 (4096 image + 333 text tokens)",
            config={"num_layers": 24, "num_attention_heads": 24, "caption_projection_dim": 1536,
                    "pos_embed_max_size": 192},
            inputs={"image_tokens": 4096, "text_tokens": 333},
            make_inputs=make_inputs,
        ),
        "3.5-large-1024": Preset(
            "SD3.5 large (38 blocks, 38 x 64 heads, RMS qk-norm) at 1024x1024 (4096 image + 333 text tokens)",
            config={"num_layers": 38, "num_attention_heads": 38, "caption_projection_dim": 2432,
                    "pos_embed_max_size": 192, "qk_norm": "rms_norm"},
            inputs={"image_tokens": 4096, "text_tokens": 333},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(SD3)
