"""Stable Diffusion 3 / 3.5 (diffusers' ``SD3Transformer2DModel``): SD3 medium, SD3.5 medium and large.

Every block of ``transformer_blocks`` is a ``JointTransformerBlock`` (an MMDiT block): an image
and a text stream that meet only in the joint attention ``attn``. The model calls each block by
keyword and gets ``(encoder_hidden_states, hidden_states)`` back; ``temb`` and
``joint_attention_kwargs`` are the same objects for every block (an IP-Adapter's entries are put
into that one dict before the loop), so a chunk of blocks carries the two streams and nothing
else. The last block is built with ``context_pre_only=True`` and returns ``None`` for the text
stream; nothing follows it, so no block ever receives that ``None`` and chunks ending in it stay
whole. ControlNet residuals (added to ``hidden_states`` in the model's loop between blocks) and
``skip_layers`` (a skipped block is never called) make a later block see other inputs than its
predecessor's outputs: gradseam then computes block by block, still exactly.

FFN seams: ``ff`` is called on exactly the modulated ``norm2`` output, with the gate and the
residual applied to its return value outside it, so checkpointing it alone is exact and drops its
4·d-wide GELU activations; ``norm2`` cannot join, since its output is scaled and shifted before
``ff`` sees it. ``ff_context`` is the same cut on the text stream. The last block has no
``ff_context`` (it is ``None`` there), so that seam is declared optional: that one block has one
seam fewer. With ``enable_forward_chunking`` the block calls ``ff`` once per chunk; each call is
its own region, still exact.

Attention side: ``attn`` (joint attention, both streams' projections) and ``attn2``, SD3.5's extra
image self-attention, which only the ``dual_attention_layers`` blocks have (``None`` elsewhere):
declared optional too.
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl

_M = "diffusers.models.transformers.transformer_sd3"


def make_inputs(model, device, dtype, tokens=None, *, image_tokens=4096, text_tokens=333) -> dict:
    """One real-size batch: a square VAE latent (grad), CLIP+T5 text states (77 + 256), pooled vector.

    ``tokens`` overrides the image token count (rounded to a square grid of patches).
    """
    import torch

    cfg = model.config
    side = max(1, round((tokens or image_tokens) ** 0.5)) * cfg.patch_size
    return {
        "hidden_states": torch.randn(1, cfg.in_channels, side, side, device=device, dtype=dtype, requires_grad=True),
        "encoder_hidden_states": torch.randn(1, text_tokens, cfg.joint_attention_dim, device=device, dtype=dtype),
        "pooled_projections": torch.randn(1, cfg.pooled_projection_dim, device=device, dtype=dtype),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
    }


_AT_1024 = {"image_tokens": 4096, "text_tokens": 333}

SD3 = Family(
    name="sd3",
    description="Stable Diffusion 3 / 3.5 medium and large (SD3Transformer2DModel)",
    models=(f"{_M}.SD3Transformer2DModel",),
    block_lists=(
        BlockList("transformer_blocks", carry=Carry({"encoder_hidden_states": 0, "hidden_states": 1})),
    ),
    block_classes=(
        BlockClass(
            "diffusers.models.attention.JointTransformerBlock",
            ffn=(("ff",), ("ff_context",)),
            attention=("attn", "attn2"),
            optional=("ff_context", "attn2"),
        ),
    ),
    presets={
        "3-medium-1024": Preset(
            "SD3 medium (24 blocks, 24 x 64 heads) at 1024x1024 (4096 image + 333 text tokens)",
            config={"num_layers": 24, "num_attention_heads": 24, "attention_head_dim": 64,
                    "caption_projection_dim": 1536, "pos_embed_max_size": 192, "sample_size": 128},
            inputs=_AT_1024,
            make_inputs=make_inputs,
        ),
        "3.5-medium-1024": Preset(
            "SD3.5 medium (24 blocks, 24 x 64 heads, dual attention in blocks 0-12, RMS qk-norm) "
            "at 1024x1024 (4096 image + 333 text tokens)",
            config={"num_layers": 24, "num_attention_heads": 24, "attention_head_dim": 64,
                    "caption_projection_dim": 1536, "pos_embed_max_size": 384, "sample_size": 128,
                    "dual_attention_layers": tuple(range(13)), "qk_norm": "rms_norm"},
            inputs=_AT_1024,
            make_inputs=make_inputs,
        ),
        "3.5-large-1024": Preset(
            "SD3.5 large (38 blocks, 38 x 64 heads, RMS qk-norm) at 1024x1024 (4096 image + 333 text tokens)",
            config={"num_layers": 38, "num_attention_heads": 38, "attention_head_dim": 64,
                    "caption_projection_dim": 2432, "pos_embed_max_size": 192, "sample_size": 128,
                    "qk_norm": "rms_norm"},
            inputs=_AT_1024,
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(SD3)
