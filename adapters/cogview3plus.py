"""CogView3-Plus-3B: diffusers' ``CogView3PlusTransformer2DModel`` (THUDM's DiT text-to-image model).

One block list, ``transformer_blocks``, all ``CogView3PlusTransformerBlock``: an expert-adaLN block in which
the T5 text tokens and the image tokens are two streams of one sequence. ``norm1``
(``CogView3PlusAdaLayerNormZeroTextImage``) LayerNorms each stream and modulates it with its own shift and
scale from ``emb``, returning the gates and the MLP modulation too; ``attn1`` attends over
``[text, image]`` together; ``norm2`` / ``norm2_context`` norm each stream again and the block modulates
them; ``ff`` runs once over the concatenated streams. The block returns
``(hidden_states, encoder_hidden_states)`` (each clipped to the float16 range when it is float16, a new
tensor, still what the next block receives).

The model projects the latent patches and the text (``patch_embed``, which also adds the 2-D sin-cos
position table to the image tokens), computes ``emb`` (timestep plus the SDXL-style ``original_size`` /
``target_size`` / ``crop_coords`` embeddings) once, splits the sequence into the two streams, then calls
every block by keyword with that same ``emb`` object. It takes no mask, no RoPE and no
``attention_kwargs``, and adds nothing between blocks, so a chunk carries the two streams and nothing
else: ``Carry({"hidden_states": 0, "encoder_hidden_states": 1})``. (diffusers' own
``gradient_checkpointing`` flag calls the blocks positionally with the same three arguments; gradseam
switches it off while patched.)

FFN seam ``("ff",)``: the tanh-GELU ``FeedForward`` (4·d wide, 10240 at d = 2560). The block calls it
exactly once, on one fresh tensor, ``cat([norm_encoder_hidden_states, norm_hidden_states])`` (the two
modulated ``norm2`` outputs), and only slices its return value (text part, image part), gates and adds it
outside. So a region around ``ff`` sees exactly what the block hands it; recomputing it drops the wide
GELU activations of every text and image token. ``norm2`` / ``norm2_context`` cannot join: their outputs
are scaled and shifted, and then concatenated, before ``ff`` sees them. The dropout inside ``ff`` has
``p = 0.0`` (the class never passes one).

Attention side: ``attn1``, the one attention module. Its processor (``CogVideoXAttnProcessor2_0``, the
one the block builds) concatenates the streams, runs the QKV projections, the affine-free QK LayerNorms,
the SDPA call and ``to_out``, and splits the result, all inside it.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

_M = "diffusers.models.transformers.transformer_cogview3plus"


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, height: int = 1024, width: int = 1024,
    text_tokens: int = 224,
) -> dict:
    """One real-size batch as ``CogView3PlusPipeline`` passes it: the latent ``(1, 16, H/8, W/8)`` (grad),
    T5-XXL states padded to ``max_sequence_length`` (224) tokens, an integer timestep (the DDIM scheduler's),
    and ``original_size = target_size = (H, W)`` and ``crop_coords = (0, 0)`` as ``(1, 2)`` tensors in the
    text states' dtype.

    ``tokens`` overrides the image token count (rounded to a square grid of patches). The sin-cos position
    table covers ``pos_embed_max_size`` patches a side (128: 2048 pixels), and the model slices it without a
    check, so a larger grid is refused here rather than failing inside ``patch_embed``."""
    import torch

    cfg = model.config
    p, limit = cfg.patch_size, cfg.pos_embed_max_size
    if tokens:
        side = square_side(tokens)
        rows = cols = side
        height = width = side * p * 8
    else:
        rows, cols = height // 8 // p, width // 8 // p
    if max(rows, cols) > limit:
        raise ValueError(
            f"cogview3plus: a {rows}x{cols} patch grid exceeds the position table ({limit}x{limit}, "
            f"pos_embed_max_size={limit}); ask for at most {limit * limit} image tokens, or at most "
            f"{limit * p * 8} pixels a side."
        )
    randn = tensor_maker(device, dtype)
    size = torch.tensor([[height, width]], device=device, dtype=dtype)
    return {
        "hidden_states": randn(1, cfg.in_channels, rows * p, cols * p, grad=True),
        "encoder_hidden_states": randn(1, text_tokens, cfg.text_embed_dim),
        "timestep": torch.full((1,), 500, device=device, dtype=torch.int64),
        "original_size": size,
        "target_size": size.clone(),
        "crop_coords": torch.zeros(1, 2, device=device, dtype=dtype),
    }


# The published CogView3-Plus-3B transformer config (THUDM/CogView3Plus-3b): diffusers' conversion script
# builds the class with its defaults. Spelled out so the preset states what it benchmarks.
_3B = {"patch_size": 2, "in_channels": 16, "num_layers": 30, "attention_head_dim": 40, "num_attention_heads": 64,
       "out_channels": 16, "text_embed_dim": 4096, "time_embed_dim": 512, "condition_dim": 256,
       "pos_embed_max_size": 128, "sample_size": 128}

COGVIEW3PLUS = Family(
    name="cogview3plus",
    description="CogView3-Plus-3B text-to-image (CogView3PlusTransformer2DModel)",
    models=(f"{_M}.CogView3PlusTransformer2DModel",),
    block_lists=(
        BlockList("transformer_blocks", carry=Carry({"hidden_states": 0, "encoder_hidden_states": 1})),
    ),
    block_classes=(BlockClass(f"{_M}.CogView3PlusTransformerBlock", ffn=(("ff",),), attention=("attn1",)),),
    presets={
        "3b-1024": Preset(
            "CogView3-Plus-3B (30 blocks, 64 x 40 heads, FFN 10240; the published config) at 1024x1024, the "
            "pipeline's default (64 x 64 = 4096 image tokens, 224 T5-XXL text tokens)",
            config=_3B,
            inputs={"height": 1024, "width": 1024, "text_tokens": 224},
            make_inputs=make_inputs,
        ),
        "3b-2048x1024": Preset(
            "CogView3-Plus-3B at 2048x1024, the largest size the model card allows (H x W <= 2^21; "
            "128 x 64 = 8192 image tokens, 224 T5-XXL text tokens)",
            config=_3B,
            inputs={"height": 2048, "width": 1024, "text_tokens": 224},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(COGVIEW3PLUS)
