"""Flux 2 (Flux2Transformer2DModel: FLUX.2 dev, and the Klein checkpoints, which share the class).

Two block lists, both called with keyword arguments by the model's loop:

- **Double blocks** (``transformer_blocks``, ``Flux2TransformerBlock``) are called as
  ``block(hidden_states=, encoder_hidden_states=, temb_mod_img=, temb_mod_txt=, image_rotary_emb=,
  joint_attention_kwargs=)`` and return ``(encoder_hidden_states, hidden_states)``. Unlike Flux 1,
  modulation is not learned per block: the model computes ``double_stream_mod_img`` /
  ``double_stream_mod_txt`` once, and every block splits the very same tensors; the rotary tuple and
  the kwargs dict are the same objects for every block too. So the list carries
  ``{"encoder_hidden_states": 0, "hidden_states": 1}``.
- **Single blocks** (``single_transformer_blocks``, ``Flux2SingleTransformerBlock``) get the
  already concatenated ``[text, image]`` sequence with ``encoder_hidden_states=None`` and the one
  shared ``single_stream_mod``, and return that one tensor (``split_hidden_states`` stays False), so
  the carry is ``{"hidden_states": None}``.

FFN seams. A double block runs each stream's ``Flux2FeedForward`` (``ff``, ``ff_context``:
``linear_in`` to ``2·3·d``, SwiGLU, ``linear_out``) on exactly its modulated ``norm2`` output, gate
and residual outside: each module is a seam, and recomputing it drops the ``6·d``-wide
``linear_in`` output, the SiLU and the gated product. ``norm2`` cannot join: its output is scaled
and shifted before ``ff`` sees it.

A single block is a *parallel* block: the MLP's input projection is fused with the QKV projection
(``attn.to_qkv_mlp_proj``, ``3·d + 2·3·d`` wide) and its output projection with the attention's
(``attn.to_out`` on ``cat([attention, mlp])``). The only module that is the MLP alone is the
parameterless SwiGLU ``attn.mlp_act_fn``, which both attention processors (plain and KV-cache) call
on exactly the MLP slice of the fused projection; that is the seam. It is honest but narrow: it drops
the SwiGLU's own ``3·d``-wide SiLU output, while the fused projection output (which the QK norms and
the attention kernel keep anyway) and ``to_out``'s ``4·d``-wide concatenated input stay, since
cutting around either would recompute attention. ``-ffn`` backends are therefore worth much less on
the single blocks than on the double blocks (measured on the CPU at ``d = 512``: 11% less kept on
single blocks, 40% on double blocks). The seam lives inside ``attn``, the attention side; the
conformance kit runs that nesting (``-ffn`` backends with attention offload) and it is exact.

Attention side: ``attn`` in both classes (in the single blocks it also holds the fused MLP
projections, which cannot be separated from it).

KV-cache mode (``kv_cache`` / ``kv_cache_mode``, the Klein KV pipeline) rewrites
``kv_attn_kwargs["kv_cache"]`` *in place* before every block, to that block's
``Flux2KVLayerCache``, which the attention processor fills (extract mode: ``store``) or reads
(cached mode). A block recomputed in backward with the live dict would read or overwrite the last
block's cache, as with diffusers' own flag; gradseam's regions recompute with the containers as
they were at the block's forward, so this is exact. An interval chunk must not run its later
blocks ahead with the first block's dict: in extract mode they would store their K/V in the first
block's cache, which no later fall-back undoes (in cached mode they would read it, wasted work,
as each then computes again). Both lists therefore declare
``per_block=("joint_attention_kwargs.kv_cache",)``: while a cache is passed, each block of a chunk
runs as its own region (counted in ``summary()`` as a fall-back), and the returned cache is the
unpatched model's, layer for layer (tests/test_family_image2.py). Without a cache the chunks run
whole as usual.
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import grid_ids, square_side

_M = "diffusers.models.transformers.transformer_flux2"
_KV_CACHE = "joint_attention_kwargs.kv_cache"  # each block's Flux2KVLayerCache, swapped into the dict per block


def position_ids(n_text: int, tokens: int, device):
    """Flux 2's 4-axis ids ``(t, h, w, l)``: a square latent grid ``[0, row, col, 0]`` for ``tokens``
    image tokens and ``[0, 0, 0, i]`` for the text tokens, as the pipeline builds them."""
    import torch

    img = grid_ids(square_side(tokens), device, channels=4)
    txt = torch.zeros(n_text, 4, device=device, dtype=img.dtype)
    txt[:, 3] = torch.arange(n_text, device=device)
    return img, txt


def make_inputs(model, device, dtype, tokens=None, *, image_tokens=4096, text_tokens=512) -> dict:
    """One real-size batch: packed latents (grad), Mistral text states, 4-axis ids, guidance if embedded."""
    import torch

    cfg = model.config
    img_ids, txt_ids = position_ids(text_tokens, tokens or image_tokens, device)
    inputs = {
        "hidden_states": torch.randn(
            1, img_ids.shape[0], cfg.in_channels, device=device, dtype=dtype, requires_grad=True
        ),
        "encoder_hidden_states": torch.randn(1, text_tokens, cfg.joint_attention_dim, device=device, dtype=dtype),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
    }
    if cfg.guidance_embeds:
        inputs["guidance"] = torch.full((1,), 4.0, device=device, dtype=dtype)
    return inputs


FLUX2 = Family(
    name="flux2",
    description="FLUX.2 dev / Klein (Flux2Transformer2DModel)",
    models=(f"{_M}.Flux2Transformer2DModel",),
    block_lists=(
        BlockList("transformer_blocks", carry=Carry({"encoder_hidden_states": 0, "hidden_states": 1}),
                  per_block=(_KV_CACHE,)),
        BlockList("single_transformer_blocks", carry=Carry({"hidden_states": None}), per_block=(_KV_CACHE,)),
    ),
    block_classes=(
        BlockClass(f"{_M}.Flux2TransformerBlock", ffn=(("ff",), ("ff_context",)), attention=("attn",)),
        BlockClass(f"{_M}.Flux2SingleTransformerBlock", ffn=(("attn.mlp_act_fn",),), attention=("attn",)),
    ),
    presets={
        "dev-1024": Preset(
            "FLUX.2 dev trunk (8 double + 48 single blocks, 48 x 128 heads, SwiGLU 3x) at 1024x1024 "
            "(4096 image + 512 text tokens)",
            config={},  # the class defaults are the flagship config
            inputs={"image_tokens": 4096, "text_tokens": 512},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(FLUX2)
