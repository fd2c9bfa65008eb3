"""AuraFlow v0.1 - v0.3 (diffusers' ``AuraFlowTransformer2DModel``, 6.8B; one trunk for every release).

Two lists, run in this order. ``joint_transformer_blocks`` are ``AuraFlowJointTransformerBlock``
(MMDiT): an image and a text stream that meet only in the joint attention ``attn``. The model calls
each one by keyword and gets ``(encoder_hidden_states, hidden_states)`` back. Then, between the
lists, it concatenates ``[text, image]`` once, and ``single_transformer_blocks``
(``AuraFlowSingleTransformerBlock``) run on that one sequence and return it as a single tensor. The
eight learned register tokens are prepended to the text before the first joint block, so they are
just part of the text stream. ``temb`` and ``attention_kwargs`` (copied once by the LoRA-scale
decorator, or ``None``) are the same objects for every block of both lists, and nothing happens
between two blocks of a list: so both lists chunk, carrying the two streams in the joint list and
the hidden states in the single list. The model never passes a mask (the pipeline zeroes the padded
T5 states instead), and its attention processor would ignore one.

FFN seams: ``ff`` (and ``ff_context`` on the text stream of the joint blocks) is the SwiGLU
``AuraFlowFeedForward`` (``linear_1``, ``linear_2`` -> ``out_projection``). Each is called on
exactly the modulated ``norm2`` output, ``norm2(h) * (1 + scale_mlp) + shift_mlp``, with the gate
and the residual applied to its return value outside it, so checkpointing the module alone is
exact and drops its two 8192-wide projections and their product (at d = 3072). ``norm2`` cannot
join: its output is scaled and shifted before ``ff`` sees it. Every block of both classes has its
FFNs (no ``context_pre_only`` last block, unlike SD3), so nothing is optional.

Attention side: ``attn`` in both classes (projections, the fp32 QK LayerNorms, and the text
stream's ``add_*_proj`` / ``to_add_out`` in the joint blocks); ``AuraFlowAttnProcessor2_0`` calls
``F.scaled_dot_product_attention`` from inside it. The residual/``norm2`` arithmetic on its output
stays outside.
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

_M = "diffusers.models.transformers.auraflow_transformer_2d"


def make_inputs(model, device, dtype, tokens=None, *, image_tokens=4096, text_tokens=256) -> dict:
    """One real-size batch: a square SDXL-VAE latent (grad), Pile-T5 states, a timestep in [0, 1].

    ``tokens`` overrides the image token count (rounded to a square grid of patches). The learned
    position table is a square grid of ``pos_embed_max_size`` entries that the model indexes around
    its centre, so a larger grid is refused here rather than indexed out of range.
    """
    import torch

    cfg = model.config
    grid = square_side(tokens or image_tokens)
    limit = int(cfg.pos_embed_max_size**0.5)
    if grid > limit:
        raise ValueError(
            f"auraflow: {grid}x{grid} patches exceed the learned position grid ({limit}x{limit}, "
            f"pos_embed_max_size={cfg.pos_embed_max_size}); ask for at most {limit * limit} image tokens."
        )
    side = grid * cfg.patch_size
    randn = tensor_maker(device, dtype)
    return {
        "hidden_states": randn(1, cfg.in_channels, side, side, grad=True),
        "encoder_hidden_states": randn(1, text_tokens, cfg.joint_attention_dim),
        # the pipeline passes t / 1000 (1 is noise), the model scales it back by 1000
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
    }


AURAFLOW = Family(
    name="auraflow",
    description="AuraFlow v0.1 - v0.3 (AuraFlowTransformer2DModel)",
    models=(f"{_M}.AuraFlowTransformer2DModel",),
    block_lists=(
        BlockList("joint_transformer_blocks", carry=Carry({"encoder_hidden_states": 0, "hidden_states": 1})),
        BlockList("single_transformer_blocks", carry=Carry({"hidden_states": None})),
    ),
    block_classes=(
        BlockClass(f"{_M}.AuraFlowJointTransformerBlock", ffn=(("ff",), ("ff_context",)), attention=("attn",)),
        BlockClass(f"{_M}.AuraFlowSingleTransformerBlock", ffn=(("ff",),), attention=("attn",)),
    ),
    presets={
        "6.8b-1024": Preset(
            "AuraFlow v0.1-v0.3 (4 joint + 32 single blocks, 12 x 256 heads, 96x96 position grid) at 1024x1024 "
            "(4096 image + 8 register + 256 Pile-T5 text tokens)",
            # the published AuraFlow transformer config (fal/AuraFlow releases share the trunk); the
            # class defaults differ only in pos_embed_max_size (1024: a 32x32 grid, too small for 64x64)
            config={"sample_size": 64, "patch_size": 2, "in_channels": 4, "num_mmdit_layers": 4,
                    "num_single_dit_layers": 32, "attention_head_dim": 256, "num_attention_heads": 12,
                    "joint_attention_dim": 2048, "caption_projection_dim": 3072, "out_channels": 4,
                    "pos_embed_max_size": 9216},
            inputs={"image_tokens": 4096, "text_tokens": 256},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(AURAFLOW)
