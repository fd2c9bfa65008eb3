"""LongCat-Image and LongCat-Image-Edit (LongCatImageTransformer2DModel), a Flux-style MMDiT.

Two block lists, in the order the model runs them, both carrying
``{"encoder_hidden_states": 0, "hidden_states": 1}``:

- ``transformer_blocks`` (``LongCatImageTransformerBlock``): image and text streams, each with its own
  adaLN-zero modulation and ``FeedForward`` (``ff``, ``ff_context``), meeting in one joint attention
  ``attn``. The block returns ``(encoder_hidden_states, hidden_states)``.
- ``single_transformer_blocks`` (``LongCatImageSingleTransformerBlock``): the two streams concatenated
  inside the block, attention and MLP in parallel, split again on return, so the block also returns
  ``(encoder_hidden_states, hidden_states)``.

The loop calls every block as ``block(hidden_states=, encoder_hidden_states=, temb=,
image_rotary_emb=)``; ``temb`` and the ``(cos, sin)`` RoPE of the text and image ids are computed once
before the loops and are the same objects for every block, and nothing happens between blocks, so
interval chunks run whole in both lists. Edit conditioning (the source image's latents appended to the
noisy ones, with their own position ids) only lengthens the image stream.

FFN seams: in the double blocks ``ff`` and ``ff_context``, each called on exactly the modulated
``norm2`` / ``norm2_context`` output with gate and residual outside (the norms cannot join: their output
is scaled and shifted first). In the single blocks the MLP has no module of its own: ``proj_mlp`` then
``act_mlp`` run beside attention on the modulated norm and meet it in ``proj_out``, so the strict chain
is ``proj_mlp -> act_mlp``; recomputing it drops the ``4·d``-wide pre-activation, while ``proj_out``'s
concatenated input stays kept (cutting there would recompute attention too).

Attention side: ``attn`` in both classes (QKV projections, QK RMSNorms, RoPE, the joint attention).

The forward takes a ``guidance`` argument that it never reads (the released pipelines pass ``None``).
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import grid_ids, square_side, tensor_maker

_M = "diffusers.models.transformers.transformer_longcat_image"
_STREAMS = Carry({"encoder_hidden_states": 0, "hidden_states": 1})


def position_ids(text_tokens, side, device, *, images=0, start=None):
    """The pipelines' ``(txt_ids, img_ids)``: ``[0, i, i]`` for text token ``i``, then ``[m, start + row,
    start + col]`` on the ``side x side`` grid of the target (modality 1) and of each edit source image
    (modality 2), ``start`` being the text length by default (the edit pipeline's; the text-to-image one
    starts at its 512-token prompt length, the same number for a full prompt)."""
    import torch

    start = text_tokens if start is None else start
    steps = torch.arange(text_tokens, device=device, dtype=torch.float32)
    txt = torch.stack([torch.zeros_like(steps), steps, steps], dim=-1)
    grid = grid_ids(side, device).float()
    grid[:, 1:] += start
    parts = []
    for modality in [1] + [2] * images:
        part = grid.clone()
        part[:, 0] = modality
        parts.append(part)
    return txt, torch.cat(parts)


def make_inputs(model, device, dtype, tokens=None, *, image_tokens=4096, text_tokens=512, images=0) -> dict:
    """One real-size batch as the LongCat-Image pipelines build it: packed latents ``(1, N, 64)`` (grad) of
    the target and, for edits, ``images`` source images of the same size (``N`` = their tokens together),
    Qwen2.5-VL states of ``text_tokens`` tokens, the timestep in ``[0, 1]`` and the position ids. ``tokens``
    overrides each image's token count (the square grid nearest it)."""
    import torch

    cfg = model.config
    side = square_side(tokens or image_tokens)
    txt_ids, img_ids = position_ids(text_tokens, side, device, images=images)
    randn = tensor_maker(device, dtype)
    return {
        "hidden_states": randn(1, img_ids.shape[0], cfg.in_channels * cfg.patch_size**2, grad=True),
        "encoder_hidden_states": randn(1, text_tokens, cfg.joint_attention_dim),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
    }


LONGCAT_IMAGE = Family(
    name="longcat-image",
    description="LongCat-Image / LongCat-Image-Edit (LongCatImageTransformer2DModel)",
    models=(f"{_M}.LongCatImageTransformer2DModel",),
    block_lists=(
        BlockList("transformer_blocks", carry=_STREAMS),
        BlockList("single_transformer_blocks", carry=_STREAMS),
    ),
    block_classes=(
        BlockClass(f"{_M}.LongCatImageTransformerBlock", ffn=(("ff",), ("ff_context",)), attention=("attn",)),
        BlockClass(f"{_M}.LongCatImageSingleTransformerBlock", ffn=(("proj_mlp", "act_mlp"),), attention=("attn",)),
    ),
    presets={
        "6b-1024": Preset(
            "LongCat-Image 6B (10 double + 20 single blocks, 24 x 128 heads; the released config, not the class "
            "defaults of 19 + 38, which are Flux's depth) at 1024x1024: 4096 image + 512 Qwen2.5-VL tokens "
            "(the pipeline pads every prompt to 512)",
            config={"num_layers": 10, "num_single_layers": 20},
            inputs={"image_tokens": 4096, "text_tokens": 512},
            make_inputs=make_inputs,
        ),
        "6b-edit-1024": Preset(
            "LongCat-Image-Edit (as '6b-1024') editing a 1024x1024 image: 4096 target + 4096 source image "
            "tokens and 838 Qwen2.5-VL tokens (the 324 vision tokens of the half-size source image with their "
            "2 delimiters, then the 512-token padded prompt)",
            config={"num_layers": 10, "num_single_layers": 20},
            inputs={"image_tokens": 4096, "text_tokens": 838, "images": 1},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(LONGCAT_IMAGE)
