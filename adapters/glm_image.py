"""GLM-Image's diffusion decoder: diffusers' ``GlmImageTransformer2DModel`` (the 7B single-stream DiT
that turns the 9B autoregressive generator's prior tokens into a 1K-2K image; text-to-image and
image-to-image share it).

One block list, ``transformer_blocks``, all ``GlmImageTransformerBlock``: a CogView4-style expert-adaLN
block in which the glyph tokens (ByT5 states of the prompt's quoted text, through ``glyph_projector``)
and the image tokens (patch-embedded latents plus the embedded prior tokens) are two streams of one
sequence. ``norm1`` LayerNorms and modulates each stream from ``temb``; ``attn1`` concatenates
``[glyph, image]`` and attends over both (the 2-D RoPE only touches the image queries and keys); each
stream is then ``norm2`` / ``norm2_context``-normed, modulated, run through the one shared ``ff``, gated
and added. The block returns ``(hidden_states, encoder_hidden_states)``.

The model computes ``temb`` (timestep plus the ``target_size`` / ``crop_coords`` embeddings, through a
SiLU) and, unless the caller gives one, the RoPE tuple ``(cos, sin)`` once before the loop, and calls
every block positionally with those same objects, the caller's ``attention_mask`` (a ``(batch,
glyph_tokens)`` mask, expanded inside ``attn1``) and ``attention_kwargs``, plus
``kv_cache=kv_caches[idx]``. Nothing is added between blocks, so a chunk carries the two streams:
``Carry({"hidden_states": 0, "encoder_hidden_states": 1})``.

``kv_cache`` is the one argument that differs per block: with a ``GlmImageKVCache`` (image-to-image)
each block gets its own ``GlmImageLayerKVCache``, which ``attn1`` writes into (mode ``"write"``: the
condition images' passes), reads from (``"read"``: the cached condition K/V go in front of the block's
own) or ignores (``"skip"``). An interval chunk runs its later blocks ahead with the first block's
arguments, so they would read or append to the first block's cache. The list therefore declares
``per_block=("kv_cache",)``: while a cache is passed, each block of a chunk is its own region (a counted
fall-back); without one (text-to-image) the chunks run whole.

**Recomputing a block repeats what it does to its cache, in the cache's mode at backward time**, which is
a field of the cache, not an argument. So what a checkpointed step can do depends on how the caller runs
the condition pass:

- condition pass under ``no_grad`` (the pipeline's way; image-editing fine-tuning on top of it): gradseam
  runs no region there, so the cache is written once; a read (or skip) pass with gradients recomputes
  each block in the mode it ran in (the cache keeps it until backward), over the same K/V. Exact, every
  backend;
- condition pass with gradients, then the mode switched to ``"read"`` (training through the cache): a recompute
  in read mode would attend over more keys than the condition pass did (diffusers' own flag raises
  ``CheckpointError`` there); gradseam recomputes each block with the plain values its cache layer held when
  its forward began (mode ``"write"``, the sample index) and puts back what it stored. Exact, every backend;
- mode still ``"write"`` at backward: the recomputed block stores its K/V again (appended with
  ``torch.cat``); gradseam puts back what a recompute does to a state object (``gradseam.run.chains``), so
  the cache afterwards holds the condition once, as unpatched. Exact.

FFN seam ``("ff",)``: the tanh-GELU ``FeedForward`` (4·d wide), which the block calls twice, once per
stream, each time on one fresh tensor (its stream's ``norm2`` output, scaled and shifted), the gate and
the residual outside it. Each call is its own region; the two share weights, whose gradients autograd sums
over both as it does unpatched. ``norm2`` / ``norm2_context`` cannot join: their output is modulated
before ``ff`` sees it. The dropout inside ``ff`` has ``p = 0``. A condition pass has no glyph tokens (the
pipeline passes an empty text stream), so the text call runs on zero tokens.

Attention side: ``attn1``, the one attention module; its processor runs the QKV projections, the QK
LayerNorms, the RoPE, the cache, the mask and the dispatched SDPA call.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

_M = "diffusers.models.transformers.transformer_glm_image"

# The released decoder's transformer config (GLM-Image's transformer/config.json, read from a public mirror of
# zai-org/GLM-Image): 30 blocks, 32 x 128 heads (d = 4096, FFN 16384), ByT5 glyph states 1472 wide, the AR
# model's 16384-entry prior codebook; about 7B parameters. The class defaults (64 x 40 heads) are not a released model.
_RELEASED = {
    "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 30, "attention_head_dim": 128,
    "num_attention_heads": 32, "text_embed_dim": 1472, "time_embed_dim": 512, "condition_dim": 256,
    "prior_vq_quantizer_codebook_size": 16384,
}


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, height: int = 1024, width: int = 1024,
    glyph_tokens: int = 256, condition_images: int = 0,
) -> dict:
    """One real-size batch as ``GlmImagePipeline`` runs the denoising pass: the latent ``(1, in_channels,
    H/8, W/8)`` (grad), ``glyph_tokens`` ByT5 states of the prompt's quoted text, one prior token id per
    image token (the AR model's tokens, upsampled 2x to the patch grid) with none dropped, the timestep
    on the 0-1000 scale and ``target_size = (H, W)``, ``crop_coords = (0, 0)``; the model builds the RoPE.

    With ``condition_images`` (image-to-image) the batch is the read pass: a ``GlmImageKVCache`` with one
    layer per block of the model as built (fewer when ``bench`` truncates it), each holding the K/V of
    that many condition images the size of the target, in read mode. The pipeline writes them in a
    condition pass under ``no_grad`` first; here they are random, which costs the same.

    ``tokens`` overrides the image token count (rounded to a square grid of 2x2 patches)."""
    import torch

    cfg = model.config
    p = cfg.patch_size
    if tokens:
        side = square_side(tokens) * p
        h = w = side
        height = width = side * 8
    else:
        h, w = height // 8 // p * p, width // 8 // p * p
    image_tokens = (h // p) * (w // p)
    randn = tensor_maker(device, dtype)
    inputs: dict = {
        "hidden_states": randn(1, cfg.in_channels, h, w, grad=True),
        "encoder_hidden_states": randn(1, glyph_tokens, cfg.text_embed_dim),
        "prior_token_id": torch.randint(0, cfg.prior_vq_quantizer_codebook_size, (1, image_tokens), device=device),
        "prior_token_drop": torch.zeros(1, image_tokens, dtype=torch.bool, device=device),
        "timestep": torch.full((1,), 999.0, device=device, dtype=dtype),
        "target_size": torch.tensor([[height, width]], device=device, dtype=dtype),
        "crop_coords": torch.zeros(1, 2, device=device, dtype=dtype),
    }
    if condition_images:
        from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache

        heads, head_dim = cfg.num_attention_heads, cfg.attention_head_dim
        cache = GlmImageKVCache(len(model.transformer_blocks))
        for layer in cache.caches:
            for _ in range(condition_images):
                layer.store(randn(1, image_tokens, heads, head_dim), randn(1, image_tokens, heads, head_dim))
        cache.set_mode("read")
        inputs["kv_caches"] = cache
    return inputs


_1024 = {"height": 1024, "width": 1024, "glyph_tokens": 256}

GLM_IMAGE = Family(
    name="glm-image",
    description="GLM-Image diffusion decoder (GlmImageTransformer2DModel)",
    models=(f"{_M}.GlmImageTransformer2DModel",),
    block_lists=(
        BlockList(
            "transformer_blocks",
            carry=Carry({"hidden_states": 0, "encoder_hidden_states": 1}),
            per_block=("kv_cache",),
        ),
    ),
    block_classes=(BlockClass(f"{_M}.GlmImageTransformerBlock", ffn=(("ff",),), attention=("attn1",)),),
    presets={
        "t2i-1024": Preset(
            "GLM-Image decoder (30 blocks, 32 x 128 heads, FFN 16384, ~7B; the released config) at 1024x1024: "
            "4096 image tokens + 256 glyph tokens (assumed: the quoted text of a text-heavy prompt, one ByT5 "
            "token per byte)",
            config=_RELEASED,
            inputs=_1024,
            make_inputs=make_inputs,
        ),
        "t2i-2048": Preset(
            "GLM-Image decoder (as t2i-1024) at 2048x2048, its largest output size: 16384 image tokens + 256 "
            "glyph tokens",
            config=_RELEASED,
            inputs={**_1024, "height": 2048, "width": 2048},
            make_inputs=make_inputs,
        ),
        "edit-1024": Preset(
            "GLM-Image decoder (as t2i-1024) editing at 1024x1024: the read pass, 4096 image + 256 glyph tokens "
            "attending to one 1024x1024 condition image's 4096 cached K/V per block (written beforehand "
            "without gradients, as the pipeline does)",
            config=_RELEASED,
            inputs={**_1024, "condition_images": 1},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(GLM_IMAGE)
