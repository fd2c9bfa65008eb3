"""Bria FIBO 2 (diffusers' ``BriaFibo2Transformer2DModel``: Fibo 2.0 text-to-image and editing, Qwen3-VL
prompts, Flux 2 VAE latents).

A Z-Image-style single-stream DiT with a Perceiver in front of it. Three block lists, in the order the
model runs them:

- ``noise_refiner`` (2 ``BriaFibo2TransformerBlock``, no cross-attention) on the image tokens (and the
  tokens of the images to edit, when ``context_latents`` are given);
- ``perceiver.layers`` (2 ``BriaFibo2PerceiverLayer``): learned gist queries read the first text bundle
  (cross-attention), then each other (self-attention), then an FFN; the result becomes the gist tokens;
- ``layers`` (44 ``BriaFibo2TransformerBlock``) on ``[gist, image, context]``; the blocks at
  ``injection_layer_ids`` (6, 14, 22, 30, 38) are built with a gated cross-attention to a text bundle of
  their own.

**Carries.** The noise refiner calls every block as ``block(x, None, image_freqs, adaln_input=...,
noise_mask=..., adaln_noisy=..., adaln_clean=...)`` and gets ``x`` back; the RoPE, the timestep
embeddings and the noise mask are made once before the loop and are the same objects for every block,
so the list carries ``{"x": None}``. The Perceiver calls ``layer(latents, text, text_mask, gist_mask)``
positionally with the same objects every time (``text`` is the one ``encoder_hidden_states[:, 0]`` view
made before its loop) and gets ``latents`` back: ``{"latents": None}``.

``layers`` declares **no carry**. Its loop hands each block ``encoder_hidden_states=text`` where ``text``
is ``encoder_hidden_states[:, k]`` (a fresh view, the block's own bundle) for an injection block and
``None`` for every other block. An interval chunk runs its later blocks ahead with the *first* block's
arguments, so a chunk headed by an ordinary block that reaches an injection block would run that block's
cross-attention with ``encoder_hidden_states=None``: the attention then falls back to its own input,
whose width (``dim``, 3584) is not what ``to_k`` takes (``cap_feat_dim``, 7680), and the step dies with a
shape error inside the checkpoint (at equal widths and without a text mask it would compute values that
the follower checks then throw away). ``per_block=("encoder_hidden_states",)`` would only guard chunks
whose *head* holds a bundle, and no declaration can keep an injection block from being a follower: the
planner cuts chunks by position (``interval``, ``stride``), not by block. So ``layers`` is checkpointed
block by block whatever the interval (``summary()`` says "recompute each block" for it; the other two
lists still chunk). Only an interval that puts every injection block at the head of its chunk (2 for the
released ids, all even) would be safe, and no declaration can tie the carry to that.

FFN seams. Transformer blocks: ``("feed_forward", "ffn_norm2")``, as in Z-Image: the block computes
``x + gate_mlp * ffn_norm2(feed_forward(ffn_norm1(x) * scale_mlp))``, so the SwiGLU is called on exactly
the scaled norm output (a fresh tensor) and ``ffn_norm2`` on exactly the SwiGLU's return, with gate and
residual outside; ``ffn_norm1`` cannot join because of the multiply. Recomputing drops the SwiGLU's four
hidden-wide tensors (``w1``/``w3`` outputs, SiLU, product; 9536 wide at full size) and what RMSNorm keeps
on the FFN output. Perceiver layers: ``("ffn_norm", "ffn")``: ``latents + ffn(ffn_norm(latents))``, the
norm called on the residual stream alone (the seam's kept input, which the norm would keep anyway) and
the FFN on exactly the norm's output, returned straight into the residual add; it drops the normalised
copy and the SwiGLU's hidden tensors. No module holds state, and nothing in either seam draws random
numbers.

Attention side. Transformer blocks: ``attention`` and ``cross_attention``; the latter is ``None`` in
every block but the injection ones, hence declared optional (as SD3's ``attn2``). Perceiver layers:
``cross_attention`` and ``self_attention``. Each is a ``BriaFibo2Attention`` whose processor does the
projections, the QK RMSNorms, the RoPE (self-attention only) and the dispatched SDPA call, so every
kernel a block calls runs inside its attention side. The norms around them stay in the block's region.

diffusers' own checkpointing path passes the same arguments positionally, in the blocks' parameter
order (``adaln_input`` included), and does not touch the Perceiver; gradseam turns it off while patched.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

_M = "diffusers.models.transformers.transformer_bria_fibo2"


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, image_tokens: int = 4096,
    text_tokens: int = 1176, context_images: int = 0,
) -> dict:
    """One real-size batch as ``BriaFibo2Pipeline`` feeds the transformer: the Flux 2 VAE latent
    ``(1, 32, H/8, W/8)`` (grad; a square image of about ``tokens`` 2x2 patches, 4096 at 1024x1024), the
    timestep on the model's 0-1 noise scale, and the text features ``(1, 1 + len(injection_layer_ids),
    L, cap_feat_dim)``: one bundle for the Perceiver and one per injection block, each three Qwen3-VL
    layers side by side. ``L = text_tokens`` defaults to 1176, the median structured-caption length the
    FIBO paper reports (the gist count the model derives from it is 448). The prompt is unpadded, so there
    is no mask (the pipeline passes one only when a batch pads). ``context_images``: that many images to
    edit, each the size of the output, as ``context_latents``."""
    import torch

    cfg = model.config
    randn = tensor_maker(device, dtype)
    side = cfg.patch_size * square_side(tokens or image_tokens)
    bundles = 1 + len(cfg.injection_layer_ids)
    batch: dict[str, Any] = {
        "hidden_states": randn(1, cfg.in_channels, side, side, grad=True),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, bundles, text_tokens, cfg.cap_feat_dim),
    }
    if context_images:
        batch["context_latents"] = [randn(1, cfg.in_channels, side, side) for _ in range(context_images)]
    return batch


_TEXT_TO_IMAGE = {"image_tokens": 4096, "text_tokens": 1176}

BRIA_FIBO2 = Family(
    name="bria-fibo2",
    description="Bria FIBO 2 / Fibo 2.0 (BriaFibo2Transformer2DModel)",
    models=(f"{_M}.BriaFibo2Transformer2DModel",),
    block_lists=(
        BlockList("noise_refiner", carry=Carry({"x": None})),
        BlockList("perceiver.layers", carry=Carry({"latents": None})),
        BlockList("layers"),  # no carry: injection blocks get their own text bundle, the others None
    ),
    block_classes=(
        BlockClass(
            f"{_M}.BriaFibo2TransformerBlock",
            ffn=(("feed_forward", "ffn_norm2"),),
            attention=("attention", "cross_attention"),
            optional=("cross_attention",),
        ),
        BlockClass(
            f"{_M}.BriaFibo2PerceiverLayer",
            ffn=(("ffn_norm", "ffn"),),
            attention=("cross_attention", "self_attention"),
        ),
    ),
    presets={
        "2.0-1024": Preset(
            "Fibo 2.0 (44 blocks, 5 of them with text cross-attention, + 2 noise-refiner blocks + a 2-layer "
            "Perceiver; 8.1B; dim 3584, 28 x 128 heads, SwiGLU 9536; the class defaults) at 1024x1024: 4096 image "
            "tokens + 448 gist tokens from 1176 Qwen3-VL tokens (the median structured caption)",
            config={},  # the class defaults are the released architecture
            inputs=_TEXT_TO_IMAGE,
            make_inputs=make_inputs,
        ),
        "2.0-edit-1024": Preset(
            "Fibo 2.0 (as '2.0-1024') editing one 1024x1024 image: 4096 image + 4096 context tokens + 448 gist "
            "tokens",
            config={},
            inputs={**_TEXT_TO_IMAGE, "context_images": 1},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(BRIA_FIBO2)
