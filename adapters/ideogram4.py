"""Ideogram 4 (Ideogram4Transformer2DModel; the pipeline's ``unconditional_transformer`` is a second
instance of the same class).

A single-stream DiT over one packed sequence per sample, ``[left padding][text][image]``: the
Qwen3-VL features of the text slots and the patchified latents of the image slots are projected and
summed into one sequence before the blocks, and per-token ``indicator``s say which slot is which.
One block list, ``layers``, all ``Ideogram4TransformerBlock``, called positionally as
``block(hidden_states, attention_mask, image_rotary_emb, adaln_input)``. The block-diagonal mask
(built from ``segment_ids``), the MRoPE ``(cos, sin)`` tuple and the timestep conditioning
``adaln_input`` are computed once before the loop and are the same objects for every block (each
block projects ``adaln_input`` with its own ``adaln_modulation``); the block returns the new
sequence alone and nothing is added between blocks. So the list carries ``{"hidden_states": None}``.
A timestep per token (``(B, L)``) only changes the shape of ``adaln_input``.

FFN seam ``("feed_forward", "ffn_norm2")``: the block computes
``x + tanh(gate) * ffn_norm2(feed_forward(ffn_norm1(x) * scale))``, so ``feed_forward`` (a SwiGLU:
``w1`` and ``w3`` to the intermediate size, SiLU, product, ``w2``) is called on exactly the scaled
norm output and ``ffn_norm2`` on exactly its return value, with gate and residual outside. That
chain is strict; ``ffn_norm1`` cannot join (its output is scaled first). Recomputing it drops the
SwiGLU's intermediate-wide tensors (``w1`` and ``w3`` outputs, the SiLU, the product) and what the
RMSNorm keeps on the FFN output.

Attention side: ``attention`` (projections, QK RMSNorms, MRoPE and the masked kernel). Its output
passes through ``attention_norm2`` before the gate; that norm is outside the attention side and
stays in the block's region.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

_M = "diffusers.models.transformers.transformer_ideogram4"

# The pipeline's constants (diffusers.models.transformers.transformer_ideogram4, pipeline_ideogram4):
# role indicators, the offset keeping image positions apart from text positions, the padded text window.
_TEXT, _IMAGE, _PAD = 3, 2, -1
_IMAGE_POSITION_OFFSET = 65536
_MAX_TEXT_TOKENS = 2048


def packed_layout(text_lengths: list[int], side: int, max_text: int, device: Any) -> tuple[Any, Any, Any]:
    """``(position_ids, segment_ids, indicator)`` of the pipeline's packed ``[left pad][text][image]``
    rows: text positions ``(i, i, i)``, image positions ``(0, row, col)`` past the offset, padding in
    its own segment (-1) so that it attends only to itself."""
    import torch

    grid = torch.arange(side, device=device)
    rows, cols = torch.meshgrid(grid, grid, indexing="ij")
    image = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3) + _IMAGE_POSITION_OFFSET
    shape = (len(text_lengths), max_text + side * side)
    position_ids = torch.zeros(*shape, 3, dtype=torch.long, device=device)
    segment_ids = torch.full(shape, _PAD, dtype=torch.long, device=device)
    indicator = torch.zeros(shape, dtype=torch.long, device=device)
    for b, n in enumerate(text_lengths):
        start = max_text - n
        position_ids[b, start:max_text] = torch.arange(n, device=device)[:, None]
        position_ids[b, max_text:] = image
        indicator[b, start:max_text] = _TEXT
        indicator[b, max_text:] = _IMAGE
        segment_ids[b, start:] = 1
    return position_ids, segment_ids, indicator


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, image_tokens: int = 4096,
    text_tokens: int = _MAX_TEXT_TOKENS, prompt_tokens: int = 512,
) -> dict:
    """One real-size conditional batch as ``Ideogram4Pipeline`` builds it: the packed latents (grad)
    with the text window zeroed, a square image of about ``tokens`` tokens (2x2 patches of the 8x VAE),
    the text window of ``text_tokens`` slots (the pipeline's ``max_sequence_length``, 2048) holding a
    left-padded prompt of ``prompt_tokens``, and its positions, segments and indicators. Every slot
    runs through the blocks, padding included."""
    import torch

    cfg = model.config
    randn = tensor_maker(device, dtype)
    side = square_side(tokens or image_tokens)
    position_ids, segment_ids, indicator = packed_layout([prompt_tokens], side, text_tokens, device)
    latents = torch.cat([torch.zeros(1, text_tokens, cfg.in_channels, device=device, dtype=dtype),
                         randn(1, side * side, cfg.in_channels)], dim=1).requires_grad_()
    features = torch.cat([randn(1, text_tokens, cfg.llm_features_dim),
                          torch.zeros(1, side * side, cfg.llm_features_dim, device=device, dtype=dtype)], dim=1)
    return {
        "hidden_states": latents,
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "encoder_hidden_states": features,
        "position_ids": position_ids,
        "segment_ids": segment_ids,
        "indicator": indicator,
    }


IDEOGRAM4 = Family(
    name="ideogram4",
    description="Ideogram 4 (Ideogram4Transformer2DModel)",
    models=(f"{_M}.Ideogram4Transformer2DModel",),
    block_lists=(BlockList("layers", carry=Carry({"hidden_states": None})),),
    block_classes=(
        BlockClass(f"{_M}.Ideogram4TransformerBlock", ffn=(("feed_forward", "ffn_norm2"),), attention=("attention",)),
    ),
    presets={
        "1024": Preset(
            "Ideogram 4 9.3B (34 single-stream blocks, 18 x 256 heads, SwiGLU 12288; the class defaults are "
            "the published spec) at 1024x1024: one packed sequence of 2048 text slots (a 512-token prompt, "
            "left-padded) + 4096 image tokens",
            config={},  # the class defaults are the released model
            inputs={"image_tokens": 4096},
            make_inputs=make_inputs,
        ),
        "2048": Preset(
            "Ideogram 4 9.3B (as '1024') at the pipeline's default 2048x2048: 2048 text slots + 16384 image tokens",
            config={},
            inputs={"image_tokens": 16384},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(IDEOGRAM4)
