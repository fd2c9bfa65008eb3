"""Wan-Animate-2, character animation by in-context reference (WanAnimate2Transformer3DModel).

A model of its own, not a Wan subclass: its block (``WanAnimate2TransformerBlock``) is a new class
in the Animate-2 module, not one of Wan's, so nothing is shared with the ``wan`` families but the
shape of the block. Each segment runs the model twice over one KV cache (``WanAnimate2KVCache``,
one ``WanAnimate2KVLayerCache`` per block): a reference pass (``kv_cache_mode="extract"``) over
the driving-video latents, in which every block's self-attention stores its pre-RoPE K/V in its
layer cache, then the denoising passes (``"cached"``), in which every block attends over the
generation tokens plus its own layer's cached reference K/V through a flex ``BlockMask``.

One block list, ``blocks``, called as ``block(hidden_states, kv_cache=kv_cache.get(i), **kwargs)``
and returning the new hidden states. The keyword arguments (the timestep projection, the text and
CLIP states, the RoPE tables and grids, the block mask and the packing geometry) are one dict built
before the loop, the same objects for every block. **The list declares no carry** all the same:
``kv_cache`` is a different object for every block, and it is not optional (the reference pass
writes into it, the denoising pass reads from it; the model indexes it unconditionally). A chunk
runs its later blocks ahead with its first block's arguments, so it would hand them the first
block's cache; declared as ``per_block=("kv_cache",)`` that makes every chunk compute block by
block, always, since a cache is always passed. A carry could only ever fall back, so there is none:
the list is checkpointed block by block and ``gradient_checkpointing_interval`` is ignored, with a
warning. (The unconditional branch of classifier-free guidance, ``is_uncondtion=True``, also skips
block 9 in the loop; without chunks that needs nothing either.)

The layer caches are safe under recomputation: a block recomputed in backward is handed the same
layer cache. In the reference pass it stores the same K/V again (recomputed exactly, so the cache
ends up holding equal values, whose autograd history is the recompute's); in the denoising pass it
reads the reference K/V, which are still, or again, the values it read in forward. So a training
step through both passes, the loss on the denoising pass and the gradient reaching the reference
pass through the cache, is exact. The stored K/V escape every region: a checkpointed reference pass
still keeps two tokens-by-width tensors per block in the cache, the pass's product, which the
denoising pass needs.

FFN seam: ``ffn`` (an ``nn.Sequential`` of ``Linear``, tanh-GELU, ``Linear``), called on exactly the
modulated ``norm2`` output, the gate and the residual (both in float32) outside it. ``norm2`` cannot
join: its output is scaled and shifted first. Everything before it is attention.

Attention side: ``self_attn`` and ``cross_attn``. In the reference pass the self-attention is one
SDPA call (any backend), and the cross-attention two (the text, and the CLIP image tokens through its
added K/V projections) in both passes: those kernels are what kept or offloaded attention keeps. In
the denoising pass the self-attention is one ``flex_attention`` call over the packed
``[generation | reference]`` buffer, always on the flex backend: a higher-order op, not an operator
gradseam can recognise, so it would be recomputed like any other op.

Not this declaration's to fix (docs/families.md has the details): kept or offloaded attention is refused
in the denoising pass, with what to change (flex attention compiles its call even when eager, which cannot
run under gradseam's attention gate); ``compile`` cannot train through the cache (the reach probe's eager
run of each compiled block stores K/V that cannot run backward: it raises). ``unsloth-compile`` is exact
since the offload engine keeps a saved conjugate view's bit (this family found that bug). diffusers' own checkpointing flag cannot
train this model at all (its checkpoint function takes no keyword arguments); gradseam switches it off
while patched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradseam.family import BlockClass, BlockList, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker, video_latent_size

_M = "diffusers.models.transformers.transformer_wan_animate_2"

_CLIP_TOKENS = 257  # CLIP ViT-H/14 features of the driving video's first frame (1280 wide)
_CLIP_DIM = 1280  # ``img_emb`` is built for 1280-wide CLIP states whatever the config says


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, frames: int = 81, height: int = 800,
    width: int = 640,
) -> dict:
    """The reference pass of one segment as ``WanAnimate2RefExtractStep`` runs it: the driving video's
    ``frames`` frames give ``T = (frames-1)/4+1`` latent frames; the latents ``(1, 16, T, H/8, W/8)``
    (grad) and the conditioning latents ``(1, 20, T, H/8, W/8)`` (the i2v mask and the driving latents,
    which the model stacks on the channels), umT5 states of ``text_len`` (512) tokens (the model pads
    every prompt to that length), the CLIP states of the driving video's first frame (257 tokens), a
    fresh KV cache and the reference grid. The timestep is the schedule's first, as the pipeline passes
    it; the model modulates this pass at a fixed timestep anyway. The model takes batched tensors as
    well as the pipeline's lists of one sample: it iterates over the first axis either way.

    ``tokens`` overrides the video token count by changing ``T``.
    """
    import torch
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

    cfg = model.config
    latent_frames, h, w = video_latent_size(frames, height, width, patch=tuple(cfg.patch_size), tokens=tokens)
    pt, ph, pw = cfg.patch_size
    grid = (latent_frames // pt, h // ph, w // pw)
    randn = tensor_maker(device, dtype)
    return {
        "hidden_states": randn(1, cfg.out_dim, latent_frames, h, w, grad=True),
        "condition_latents": randn(1, cfg.in_dim - cfg.out_dim, latent_frames, h, w),
        "timestep": torch.full((1,), 1000.0, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, cfg.text_len, cfg.text_dim),
        "encoder_hidden_states_image": randn(1, _CLIP_TOKENS, _CLIP_DIM),
        "kv_cache": WanAnimate2KVCache(len(model.blocks)),
        "kv_cache_mode": "extract",
        "seq_len": grid[0] * grid[1] * grid[2],
        "offset_grid_sizes": torch.tensor([grid], dtype=torch.long),
    }


# The released Wan-Animate-2 14B transformer: diffusers' class defaults, which its documentation loads
# ``Wan-AI/Wan2.2-Animate-2-14B-Diffusers`` with (assumed to be that checkpoint's config); spelled out, so a
# change of default upstream does not move the preset.
_RELEASED = {
    "patch_size": (1, 2, 2), "text_len": 512, "in_dim": 36, "dim": 5120, "ffn_dim": 13824, "freq_dim": 256,
    "text_dim": 4096, "out_dim": 16, "num_heads": 40, "num_layers": 40, "cross_attn_norm": True, "eps": 1e-6,
    "use_img_emb": True, "refer_offset_t": 1, "refer_offset_h": 0, "refer_offset_w": -1, "refer_stride": 1,
}

WAN_ANIMATE2 = Family(
    name="wan-animate2",
    description="Wan-Animate-2 character animation by in-context reference (WanAnimate2Transformer3DModel)",
    models=(f"{_M}.WanAnimate2Transformer3DModel",),
    block_lists=(BlockList("blocks"),),  # no carry: a KV layer cache of its own for every block (see above)
    block_classes=(
        BlockClass(f"{_M}.WanAnimate2TransformerBlock", ffn=(("ffn",),), attention=("self_attn", "cross_attn")),
    ),
    presets={
        "14b-800x640": Preset(
            "Wan-Animate-2 14B (40 blocks, 40 x 128 heads, FFN 13824; the class defaults) in the reference "
            "pass of one 81-frame segment at the pipeline's default 800x640: 21 x 50 x 40 = 42000 video "
            "tokens, 512 text + 257 CLIP tokens (the denoising pass, 44000 tokens attending to these, needs "
            "compiled flex attention)",
            config=_RELEASED,
            inputs={"frames": 81, "height": 800, "width": 640},
            make_inputs=make_inputs,
        ),
        "14b-480x832": Preset(
            "Wan-Animate-2 14B (as '14b-800x640') in the reference pass of one 81-frame segment at 480x832: "
            "21 x 30 x 52 = 32760 video tokens, 512 text + 257 CLIP tokens",
            config=_RELEASED,
            inputs={"frames": 81, "height": 480, "width": 832},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Callable[[Family], None]) -> None:
    register(WAN_ANIMATE2)
