"""Lumina Image 2.0 (Lumina2Transformer2DModel; Neta Lumina and other fine-tunes share the class).

Three block lists, every block a ``Lumina2TransformerBlock``, run in this order:

- ``context_refiner``: the Gemma caption tokens alone, built with ``modulation=False``; the loop
  calls ``layer(encoder_hidden_states, encoder_attention_mask, context_rotary_emb)``.
- ``noise_refiner``: the image patch tokens alone, timestep-modulated;
  ``layer(hidden_states, None, noise_rotary_emb, temb)``.
- ``layers``: the joint sequence (each sample's valid caption tokens, then its image tokens, padded
  to the longest sample); ``layer(hidden_states, mask_or_None, rotary_emb, temb)``.

Each block returns the new hidden states alone. The masks, the three RoPE tables and ``temb`` are
built once before the loops and handed to every block of a list as the same objects; nothing is
added between blocks (the joint sequence is assembled between the lists, not inside one), so each
list carries ``{"hidden_states": None}`` and interval chunks run whole, padded batches included
(the main loop's mask is one tensor for all layers, or ``None`` for every layer when all samples
have the same caption length).

FFN seam ``("feed_forward", "ffn_norm2")``: the MLP branch is ``ffn_norm2(feed_forward(u))`` with
the tanh gate and the residual applied outside, where ``u`` is ``ffn_norm1(h) * (1 + scale_mlp)``
in modulated blocks and ``ffn_norm1(h)`` in the context refiner. ``feed_forward`` (diffusers'
``LuminaFeedForward``, a SwiGLU: ``linear_1`` and ``linear_3`` to ``4·d`` rounded up to
``multiple_of``, SiLU, product, ``linear_2``) is called on exactly ``u`` and ``ffn_norm2`` on exactly
its output, so the two are a strict chain in every block. ``ffn_norm1`` cannot join: in modulated
blocks its output is scaled before the MLP sees it, and the seam is declared per class, which both
kinds of block share. Recomputing the seam drops the SwiGLU's wide tensors (both projections, the
SiLU output, the product) and the copies RMSNorm keeps of the MLP output; only ``u`` is kept. The
FFN is dense (no mixture of experts), so a recompute is a plain deterministic replay.

Attention side: ``attn`` (GQA projections, QK RMSNorms, complex RoPE and the SDPA call all live in
the processor under ``attn``). The ``norm2`` applied to its output stays outside.
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

_M = "diffusers.models.transformers.transformer_lumina2"
_HIDDEN = Carry({"hidden_states": None})


def make_inputs(model, device, dtype, tokens=None, *, image_tokens=4096, text_tokens=256, caption_tokens=None) -> dict:
    """One real-size batch as ``Lumina2Pipeline`` builds it: a VAE latent ``(1, C, H/8, W/8)`` (grad,
    2x2 patches) and Gemma-2 caption states padded to ``text_tokens`` (the pipeline's
    ``max_sequence_length``) with their mask; ``caption_tokens`` of them are valid (all by default:
    the longest prompt, as the system prompt plus a long caption reaches). The joint sequence is the
    valid caption tokens plus the image tokens; ``tokens`` overrides the image token count."""
    import torch

    cfg = model.config
    side = square_side(tokens or image_tokens) * cfg.patch_size
    valid = text_tokens if caption_tokens is None else caption_tokens
    randn = tensor_maker(device, dtype)
    mask = torch.zeros(1, text_tokens, device=device, dtype=torch.bool)
    mask[:, :valid] = True
    return {
        "hidden_states": randn(1, cfg.in_channels, side, side, grad=True),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, text_tokens, cfg.cap_feat_dim),
        "encoder_attention_mask": mask,
    }


LUMINA2 = Family(
    name="lumina2",
    description="Lumina Image 2.0 / Neta Lumina (Lumina2Transformer2DModel)",
    models=(f"{_M}.Lumina2Transformer2DModel",),
    block_lists=(
        BlockList("context_refiner", carry=_HIDDEN),
        BlockList("noise_refiner", carry=_HIDDEN),
        BlockList("layers", carry=_HIDDEN),
    ),
    block_classes=(
        BlockClass(f"{_M}.Lumina2TransformerBlock", ffn=(("feed_forward", "ffn_norm2"),), attention=("attn",)),
    ),
    presets={
        "2b-1024": Preset(
            "Lumina Image 2.0 2B (26 layers + 2 context + 2 noise refiners, dim 2304, 24 x 96 heads with 8 KV "
            "heads, SwiGLU 9216; the class defaults with the released Gemma-2-2B caption width 2304, the class "
            "default being 1024) at 1024x1024 (4096 image + 256 caption tokens)",
            config={"cap_feat_dim": 2304},
            inputs={"image_tokens": 4096, "text_tokens": 256},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(LUMINA2)
