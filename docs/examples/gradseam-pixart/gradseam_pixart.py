"""PixArt-α / PixArt-Σ (diffusers' ``PixArtTransformer2DModel``) for gradseam: an example plugin.

Every block of ``transformer_blocks`` is diffusers' generic ``BasicTransformerBlock``, built here
with ``norm_type="ada_norm_single"``: self-attention ``attn1``, cross-attention ``attn2`` to the T5
prompt, and a ``FeedForward`` ``ff``. Each block returns ``hidden_states`` alone, and the model's
loop passes the same mask, prompt, ``timestep`` and ``cross_attention_kwargs`` objects to every
block, so a chunk of blocks carries ``hidden_states`` and nothing else.

FFN seam: ``ff`` is called on exactly the modulated ``norm2`` output, with the gate and the
residual applied to its return value outside it, so checkpointing it alone is exact and drops its
4·d-wide GELU activations. ``norm2`` cannot join: its output is scaled and shifted first.

Attention side: ``attn1`` and ``attn2``. PixArt always builds the cross-attention, so every block
has both and nothing needs to be declared optional.
"""

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl


def make_inputs(model, device, dtype, tokens=None, *, image_tokens=4096, text_tokens=300):
    """One real-size batch for the benchmarks: latents (with grad), T5 states, size conditions."""
    import torch  # here, not at the top: listing families must not import torch

    cfg = model.config
    grid = max(1, round((tokens or image_tokens) ** 0.5))
    side = grid * cfg.patch_size
    sizes = {"resolution": None, "aspect_ratio": None}
    if model.use_additional_conditions:  # PixArt-α 1024 conditions on the image size
        pixels = float(side * 8)
        sizes = {"resolution": torch.tensor([[pixels, pixels]], device=device, dtype=dtype),
                 "aspect_ratio": torch.ones(1, 1, device=device, dtype=dtype)}
    return {
        "hidden_states": torch.randn(1, cfg.in_channels, side, side, device=device, dtype=dtype, requires_grad=True),
        "encoder_hidden_states": torch.randn(1, text_tokens, cfg.caption_channels, device=device, dtype=dtype),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "added_cond_kwargs": sizes,
    }


PIXART = Family(
    name="pixart",
    description="PixArt-α / PixArt-Σ (PixArtTransformer2DModel)",
    models=("diffusers.models.transformers.pixart_transformer_2d.PixArtTransformer2DModel",),
    block_lists=(BlockList("transformer_blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(
        BlockClass("diffusers.models.attention.BasicTransformerBlock", ffn=(("ff",),), attention=("attn1", "attn2")),
    ),
    presets={
        "sigma-xl-1024": Preset(
            "PixArt-Σ XL (28 blocks, 16 x 72 heads) at 1024x1024 (4096 image + 300 text tokens)",
            config={"num_layers": 28, "num_attention_heads": 16, "attention_head_dim": 72, "sample_size": 128,
                    "out_channels": 8, "caption_channels": 4096, "interpolation_scale": 2,
                    "use_additional_conditions": False},
            inputs={"image_tokens": 4096, "text_tokens": 300},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(PIXART)
