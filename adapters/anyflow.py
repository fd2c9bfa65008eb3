"""AnyFlow any-step video models: ``AnyFlowTransformer3DModel`` (bidirectional) and
``AnyFlowFARTransformer3DModel`` (causal, frame-autoregressive FAR). Two families, one per class.

Both are Wan 2.1's DiT with AnyFlow's dual-timestep embedding: a timestep ``t`` and a target
``r`` per latent frame, embedded once before the loop into one ``(B, L, 6, D)`` modulation
projection (``timestep_proj``: each frame's value repeated over its tokens). Every block is an
``AnyFlowTransformerBlock`` (self-attention ``attn1`` with a complex float64 RoPE, cross-attention
``attn2`` to the umT5 states, then ``ffn``) returning the new hidden states alone.

Why two families and not one: the FAR module defines its own copy of the block class
(``transformer_anyflow_far.AnyFlowTransformerBlock``, not the bidirectional module's), its
self-attention runs a different processor (flex attention under a FAR block mask, with a KV cache),
its loop has two more paths (KV-cache prefill and cached decoding) that hand each block its own
cache, and its inputs differ (a chunk partition, compressed context frames, a clean copy of the
noisy frames). A family's presets build its first model class only, so each class gets its own
family and input builder. The cut inside the block is the same in both.

Carry. The bidirectional loop calls ``block(hidden_states, encoder_hidden_states, timestep_proj,
rotary_emb, attention_mask)`` positionally; the text states (with the I2V CLIP tokens in front when
``image_dim`` is set), the projection, the RoPE dict ``{"query": f, "key": f}`` and the mask
(always ``None``) are built once before the loop, and nothing happens between blocks:
``Carry({"hidden_states": None})``. The FAR training path (``kv_cache=None``: the call AnyFlow's
causal training code makes, with the clean context frames, the noisy chunks and their clean copy in
one sequence) calls the blocks the same way, its ``attention_mask`` being one flex ``BlockMask``
for every block (the caller's, or one the model builds before the loop), so it carries the same. The
two KV-cache paths (prefill and decoding) pass ``kv_cache[i]`` and the shared ``kv_cache_flag`` as
well: each block gets its own layer cache, into which the prefill writes the prefix's K/V and from
which decoding reads them. A chunk runs its later blocks ahead with its first block's arguments and
would write their K/V into the first block's cache (the next decoding step then reads block 1's K/V
in block 0), so the FAR list declares ``per_block=("kv_cache",)``: while a cache is passed, every
block of a chunk is its own region (a counted fall-back), and each layer cache holds what the
unpatched model leaves there.

The KV cache and recomputation. A block recomputed in backward is handed the same layer cache
again: a prefill block stores the same K/V again (recomputed exactly, in place), a decoding block
reads the cache as it is *then*. That is exact as long as the cache is not rewritten between a
step's forward and its backward. AnyFlow's FAR pipeline rewrites it at every chunk (each chunk's
prefill recomputes the whole prefix and slides the full-resolution window), so a backward through a
decoding step taken after a later chunk's prefill would recompute against the new cache (wrong
gradients, as diffusers' own checkpointing flag gives them silently). gradseam's regions note the
tensors of their state arguments as each forward leaves them and refuse such a recompute, naming the
cache (:mod:`gradseam.run.chains`). Run each backward before the next prefill, or train through the
training path.

FFN seam: ``ffn`` (diffusers' ``FeedForward``: ``Linear`` to ``ffn_dim``, tanh-GELU, ``Linear``) is
called on exactly ``norm3(x) * (1 + scale) + shift``, a fresh tensor nothing else uses, and its
output only reaches ``x + ffn(...) * gate`` (both in float32): a strict chain. ``norm3`` cannot
join, since its output is scaled and shifted before ``ffn`` sees it.

Attention side: ``attn1`` and ``attn2`` (projections, the QK RMS norms across heads, the complex
float64 RoPE and the attention call, all inside the processors). In the bidirectional model both are
dispatched SDPA calls. In the FAR model ``attn2`` is SDPA and ``attn1`` one ``flex_attention`` call
(the only backend its processor accepts), a higher-order op gradseam does not recognise as a kernel:
whole-block regions recompute it. Attention offload works there beside the ``-ffn`` backends or
without checkpointing; kept attention, and attention offload inside whole-block regions, are refused
in forward with what to change (flex attention compiles its call even in eager mode, which cannot run
under gradseam's attention gate). Declaring no attention side would not avoid
it (kept attention would then keep kernels block-wide, through the same gate) and would refuse the
offload that works.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker, video_latent_size

_BIDI = "diffusers.models.transformers.transformer_anyflow"
_FAR = "diffusers.models.transformers.transformer_anyflow_far"

_CARRY = Carry({"hidden_states": None})
_FFN = (("ffn",),)
_ATTENTION = ("attn1", "attn2")

# The pipelines pad every umT5 prompt to 512 tokens (``max_sequence_length``), as AnyFlow's training does.
TEXT_TOKENS = 512
# Flow-map times of the preset batches (train-timestep units): a source t and an earlier target r.
_T, _R = 700.0, 300.0

# The released checkpoints (nvidia/AnyFlow-Wan2.1-T2V-14B / -1.3B and AnyFlow-FAR-Wan2.1-14B / -1.3B)
# are distilled from Wan 2.1 T2V 14B and 1.3B. The 14B transformer config.json: 40 blocks of 40 x 128
# heads, FFN 13824, umT5 width 4096, no CLIP image states, RoPE table of 1024 positions, gate 0.25,
# delta time "r": diffusers' class defaults, spelled out so a change of default upstream does not
# move the presets. The 1.3B trunk is Wan 2.1 1.3B's (30 blocks, 12 x 128 heads, FFN 8960).
_14B = {
    "patch_size": (1, 2, 2), "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
    "cross_attn_norm": True, "eps": 1e-6, "image_dim": None, "rope_max_seq_len": 1024, "gate_value": 0.25,
    "deltatime_type": "r",
}
_1_3B = {**_14B, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}
# The FAR checkpoints add the compressed context patches (1, 4, 4), three full-resolution chunks and the
# 81-frame chunk schedule 1 + 6 x 3 + 2 (21 latent frames).
_FAR_EXTRA = {"compressed_patch_size": (1, 4, 4), "full_chunk_limit": 3, "chunk_partition": (1, 3, 3, 3, 3, 3, 3, 2)}


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, frames: int = 81, height: int = 480,
    width: int = 832, text_tokens: int = TEXT_TOKENS,
) -> dict:
    """One bidirectional training batch: the latent video ``(1, (frames-1)/4+1, 16, H/8, W/8)`` (grad; the
    model takes frames before channels), a source and a target time per latent frame (``(1, F)``, as the
    pipeline and AnyFlow's training pass them) and the padded umT5 states.

    ``tokens`` overrides the video token count by changing the number of latent frames.
    """
    import torch

    cfg = model.config
    latent_frames, h, w = video_latent_size(frames, height, width, patch=tuple(cfg.patch_size), tokens=tokens)
    randn = tensor_maker(device, dtype)
    return {
        "hidden_states": randn(1, latent_frames, cfg.in_channels, h, w, grad=True),
        "timestep": torch.full((1, latent_frames), _T, device=device, dtype=dtype),
        "r_timestep": torch.full((1, latent_frames), _R, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, text_tokens, cfg.text_dim),
    }


def chunk_schedule(latent_frames: int) -> list[int]:
    """The released chunk schedule cut to ``latent_frames``: one frame, then chunks of three, the last
    one shorter if need be (21 frames: 1 + 6 x 3 + 2)."""
    chunks, left = [1], latent_frames - 1
    while left > 0:
        chunks.append(min(3, left))
        left -= chunks[-1]
    return chunks


def make_far_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, frames: int = 81, height: int = 480,
    width: int = 832, text_tokens: int = TEXT_TOKENS,
) -> dict:
    """One FAR training step as AnyFlow's causal training calls the model (``kv_cache=None``): the latent
    video ``(frames-1)/4+1`` frames long, cut into the released chunk schedule; the last
    ``full_chunk_limit`` chunks are the noisy frames, at time ``t`` (target ``r``), the chunks before them
    the clean context at time 0, which the model patchifies at the compressed size; ``clean_hidden_states``
    is the noisy frames' clean copy (time 0) that the FAR mask lets them attend to. The latents and their
    clean copy require grad; the block mask is built here once, with the model's own function, so a step
    measures the transformer and not the mask.

    ``tokens`` overrides the video token count approximately, by changing the number of latent frames (at
    the full resolution: the compressed context holds fewer tokens and the clean copy adds more).
    """
    import torch

    cfg = model.config
    latent_frames, h, w = video_latent_size(frames, height, width, patch=tuple(cfg.patch_size), tokens=tokens)
    chunks = chunk_schedule(latent_frames)
    noisy = sum(chunks[-cfg.full_chunk_limit:])
    context = latent_frames - noisy
    randn = tensor_maker(device, dtype)
    time = torch.cat([torch.zeros(1, context), torch.full((1, noisy), _T)], dim=1).to(device, dtype)
    target = torch.cat([torch.zeros(1, context), torch.full((1, noisy), _R)], dim=1).to(device, dtype)
    return {
        "hidden_states": randn(1, latent_frames, cfg.in_channels, h, w, grad=True),
        "timestep": time,
        "r_timestep": target,
        "encoder_hidden_states": randn(1, text_tokens, cfg.text_dim),
        "chunk_partition": chunks,
        "clean_hidden_states": randn(1, noisy, cfg.in_channels, h, w, grad=True),
        "clean_timestep": torch.zeros(1, noisy, device=device, dtype=dtype),
        "attention_mask": model.build_attention_mask(
            chunk_partition=chunks, height=h, width=w, has_clean_context=True, device=device
        ),
    }


ANYFLOW = Family(
    name="anyflow",
    description="AnyFlow any-step bidirectional text-to-video (AnyFlowTransformer3DModel)",
    models=(f"{_BIDI}.AnyFlowTransformer3DModel",),
    block_lists=(BlockList("blocks", carry=_CARRY),),
    block_classes=(BlockClass(f"{_BIDI}.AnyFlowTransformerBlock", ffn=_FFN, attention=_ATTENTION),),
    presets={
        "t2v-14b-480p": Preset(
            "AnyFlow-Wan2.1-T2V-14B (40 blocks, 40 x 128 heads, FFN 13824) at 480x832, 81 frames: "
            "21 x 30 x 52 = 32760 video tokens, 512 text tokens",
            config=_14B,
            inputs={"frames": 81, "height": 480, "width": 832},
            make_inputs=make_inputs,
        ),
        "t2v-1.3b-480p": Preset(
            "AnyFlow-Wan2.1-T2V-1.3B (30 blocks, 12 x 128 heads, FFN 8960) at 480x832, 81 frames: "
            "32760 video tokens, 512 text tokens",
            config=_1_3B,
            inputs={"frames": 81, "height": 480, "width": 832},
            make_inputs=make_inputs,
        ),
    },
)

ANYFLOW_FAR = Family(
    name="anyflow-far",
    description="AnyFlow any-step causal frame-autoregressive video (AnyFlowFARTransformer3DModel)",
    models=(f"{_FAR}.AnyFlowFARTransformer3DModel",),
    block_lists=(BlockList("blocks", carry=_CARRY, per_block=("kv_cache",)),),
    block_classes=(BlockClass(f"{_FAR}.AnyFlowTransformerBlock", ffn=_FFN, attention=_ATTENTION),),
    presets={
        "far-14b-480p": Preset(
            "AnyFlow-FAR-Wan2.1-14B (40 blocks, 40 x 128 heads, FFN 13824) in a training step at 480x832, "
            "81 frames (21 latent frames, chunks 1 + 6 x 3 + 2): 13 context frames compressed to 5070 "
            "tokens, 8 noisy frames (12480 tokens) and their clean copy (12480): 30030 tokens, 512 text "
            "tokens; the flex self-attention must be compiled at this length",
            config={**_14B, **_FAR_EXTRA},
            inputs={"frames": 81, "height": 480, "width": 832},
            make_inputs=make_far_inputs,
        ),
        "far-1.3b-480p": Preset(
            "AnyFlow-FAR-Wan2.1-1.3B (30 blocks, 12 x 128 heads, FFN 8960) in the same training step: "
            "30030 tokens, 512 text tokens",
            config={**_1_3B, **_FAR_EXTRA},
            inputs={"frames": 81, "height": 480, "width": 832},
            make_inputs=make_far_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Callable[[Family], None]) -> None:
    register(ANYFLOW)
    register(ANYFLOW_FAR)
