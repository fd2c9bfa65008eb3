"""CogView4-6B and CogView4-6B-Control: diffusers' ``CogView4Transformer2DModel``.

One block list, ``transformer_blocks``, all ``CogView4TransformerBlock``: an expert-adaLN block in which
the GLM text tokens and the image tokens are two streams of one sequence. ``norm1``
(``CogView4AdaLayerNormZero``) LayerNorms both streams and modulates each with its own shift and scale
from ``temb`` (it also returns the gates and the MLP modulation); ``attn1`` concatenates ``[text, image]``
and attends over both (the 2-D RoPE only touches the image queries and keys); then each stream is
``norm2`` / ``norm2_context``-normed and modulated, run through the one shared ``ff``, gated and added.
The block returns ``(hidden_states, encoder_hidden_states)``.

The model patch-embeds both streams and computes ``temb`` (timestep plus the SDXL-style
``original_size`` / ``target_size`` / ``crop_coords`` embeddings, through a SiLU) and, unless the caller
gives one, the RoPE tuple ``(cos, sin)`` once before the loop. It then calls every block positionally
with those same objects, the caller's ``attention_mask`` (a ``(batch, text_tokens)`` text mask, passed
untouched; the processor builds the square mask inside ``attn1``) and the caller's
``attention_kwargs`` (copied once by the LoRA-scale decorator, or ``None``). Nothing is added between
blocks, so a chunk carries the two streams and nothing else:
``Carry({"hidden_states": 0, "encoder_hidden_states": 1})`` (gradseam binds positional calls to the
parameter names).

FFN seam ``("ff",)``: the tanh-GELU ``FeedForward`` (4·d wide). The block calls it twice, once per
stream: ``ff(norm_hidden_states)`` and ``ff(norm_encoder_hidden_states)``, each on one fresh tensor (its
stream's ``norm2`` output, scaled and shifted), and only gates and adds each return value outside it.
Each call is its own region, seeing exactly what the block hands that call; the two calls share
weights, whose gradients autograd sums over both regions as it does unpatched. Recomputing drops the
4·d-wide activations of every image and text token. ``norm2`` / ``norm2_context`` cannot join: their
output is scaled and shifted before ``ff`` sees it. The dropout inside ``ff`` has ``p = 0.0``.

Attention side: ``attn1``, the one attention module. Both of diffusers' processors for it
(``CogView4AttnProcessor``, the default, and ``CogView4TrainingAttnProcessor``, which takes text and
latent masks and packing flags through ``attention_kwargs``) run the QKV projections, the QK
LayerNorms, the RoPE, the mask and the SDPA call inside it.
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

_M = "diffusers.models.transformers.transformer_cogview4"


def make_inputs(model, device, dtype, tokens=None, *, height=1024, width=1024, text_tokens=224) -> dict:
    """One real-size batch as ``CogView4Pipeline`` (and diffusers' CogView4 Control training script)
    passes it: the latent ``(1, in_channels, H/8, W/8)`` (grad; the Control model's 32 channels are the
    noisy and the control latents together), GLM-4 states (``hidden_states[-2]``, ``text_embed_dim``
    wide; the pipeline left-pads the prompt to a multiple of 16 tokens), a float timestep, and
    ``original_size = target_size = (H, W)`` and ``crop_coords = (0, 0)`` as ``(1, 2)`` tensors in the
    text states' dtype. The model builds the RoPE itself, as in the pipeline.

    ``tokens`` overrides the image token count (rounded to a square grid of patches). The RoPE table
    spreads ``rope_axes_dim`` positions over any grid, so no size is refused."""
    import torch

    cfg = model.config
    p = cfg.patch_size
    if tokens:
        side = square_side(tokens) * p
        h = w = side
        height = width = side * 8
    else:
        h, w = height // 8 // p * p, width // 8 // p * p
    randn = tensor_maker(device, dtype)
    size = torch.tensor([[height, width]], device=device, dtype=dtype)
    return {
        "hidden_states": randn(1, cfg.in_channels, h, w, grad=True),
        "encoder_hidden_states": randn(1, text_tokens, cfg.text_embed_dim),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "original_size": size,
        "target_size": size.clone(),
        "crop_coords": torch.zeros(1, 2, device=device, dtype=dtype),
    }


# The published CogView4-6B transformer config (THUDM/CogView4-6B; diffusers' conversion script builds the
# same): 28 blocks, 32 x 128 heads (d = 4096), GLM-4 width 4096. The class defaults (30 blocks, 64 x 40)
# are not a released model.
_6B = {"patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 28, "attention_head_dim": 128,
       "num_attention_heads": 32, "text_embed_dim": 4096, "time_embed_dim": 512, "condition_dim": 256,
       "pos_embed_max_size": 128, "sample_size": 128, "rope_axes_dim": (256, 256)}
# 224 text tokens: a long caption, as CogView4 is trained on, left-padded to a multiple of 16 (the pipeline's
# docstring gives 224 as its max_sequence_length; the code allows up to 1024, padding to the longest prompt)
_1024 = {"height": 1024, "width": 1024, "text_tokens": 224}

COGVIEW4 = Family(
    name="cogview4",
    description="CogView4-6B and CogView4-6B-Control text-to-image (CogView4Transformer2DModel)",
    models=(f"{_M}.CogView4Transformer2DModel",),
    block_lists=(
        BlockList("transformer_blocks", carry=Carry({"hidden_states": 0, "encoder_hidden_states": 1})),
    ),
    block_classes=(BlockClass(f"{_M}.CogView4TransformerBlock", ffn=(("ff",),), attention=("attn1",)),),
    presets={
        "6b-1024": Preset(
            "CogView4-6B (28 blocks, 32 x 128 heads, FFN 16384; the published config) at 1024x1024 "
            "(64 x 64 = 4096 image tokens, 224 GLM-4 text tokens)",
            config=_6B,
            inputs=_1024,
            make_inputs=make_inputs,
        ),
        "6b-control-1024": Preset(
            "CogView4-6B-Control (as 6b-1024, plus the control image latents as 16 more input channels; "
            "the published config) at 1024x1024 (4096 image tokens, 224 GLM-4 text tokens)",
            config={**_6B, "in_channels": 32},
            inputs=_1024,
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(COGVIEW4)
