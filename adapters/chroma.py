"""Chroma (Chroma1-HD and relatives: ChromaTransformer2DModel), Flux's trunk without per-block modulation MLPs.

Double blocks (``transformer_blocks``) are Flux's: image and text streams with their own
``FeedForward`` (``ff``, ``ff_context``) and joint attention in ``attn``; they return
``(encoder_hidden_states, hidden_states)``. Single blocks (``single_transformer_blocks``) take the
already concatenated ``[text, image]`` sequence plus an ``attention_mask`` and return one tensor.
Their MLP has no module of its own: ``act_mlp(proj_mlp(norm))`` runs in parallel with attention
and both branches meet in ``proj_out``, so the honest seam is ``proj_mlp -> act_mlp`` (a strict
chain: ``act_mlp`` is called on exactly ``proj_mlp``'s output). It drops the 4·d-wide MLP
pre-activation; ``proj_out``'s concatenated input is still kept, since cutting there would
recompute attention too. ``distilled_guidance_layer.layers`` is the modulation approximator, a
stack of small MLPs on ``(B, n_mod, 64)`` vectors, not a transformer block list, and is left alone.

Why no interval chunks: unlike Flux, every Chroma block gets its *own* ``temb`` (the model loop
slices or concatenates a fresh piece of ``pooled_temb`` right before each call). A chunk would
have to run block ``i+1`` before the model has built its ``temb``, which is impossible without
copying the loop, so both lists declare no ``Carry`` and ``gradient_checkpointing_interval`` falls
back to one region per block (gradseam warns).

Why gradseam instead of the built-in flag: diffusers' ``enable_gradient_checkpointing()`` path
calls single blocks as ``(hidden_states, temb, image_rotary_emb)`` and so silently drops
``attention_mask`` (and ``joint_attention_kwargs`` everywhere); gradseam wraps the blocks the
model calls, so every argument reaches them unchanged. It also turns the flag off while patched.
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import flux_ids

_M = "diffusers.models.transformers.transformer_chroma"


def make_inputs(model, device, dtype, tokens=None, *, image_tokens=4096, text_tokens=512) -> dict:
    """One real-size batch: Flux's inputs without the pooled CLIP vector and guidance."""
    import torch


    cfg = model.config
    img_ids, txt_ids = flux_ids(text_tokens, tokens or image_tokens, device)
    return {
        "hidden_states": torch.randn(
            1, img_ids.shape[0], cfg.in_channels, device=device, dtype=dtype, requires_grad=True
        ),
        "encoder_hidden_states": torch.randn(1, text_tokens, cfg.joint_attention_dim, device=device, dtype=dtype),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "img_ids": img_ids.to(dtype),
        "txt_ids": txt_ids.to(dtype),
    }

CHROMA = Family(
    name="chroma",
    description="Chroma1 (ChromaTransformer2DModel), Flux trunk with pruned modulation",
    models=(f"{_M}.ChromaTransformer2DModel",),
    block_lists=(
        BlockList("transformer_blocks"),
        BlockList("single_transformer_blocks"),
    ),
    block_classes=(
        BlockClass(f"{_M}.ChromaTransformerBlock", ffn=(("ff",), ("ff_context",)), attention=("attn",)),
        BlockClass(f"{_M}.ChromaSingleTransformerBlock", ffn=(("proj_mlp", "act_mlp"),), attention=("attn",)),
    ),
    presets={
        "hd-1024": Preset(
            "Chroma1-HD (19 double + 38 single blocks, 24 x 128 heads, Flux trunk) at 1024x1024 "
            "(4096 image + 512 text tokens)",
            config={},  # the class defaults are the flagship config
            inputs={"image_tokens": 4096, "text_tokens": 512},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(CHROMA)
