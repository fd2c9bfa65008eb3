"""Kandinsky 6.0: joint video and audio generation (``Kandinsky6Transformer3DModel``, family ``kandinsky6``)
and its video super-resolution model (``Kandinsky6SRTransformer3DModel``, family ``kandinsky6-sr``).

**kandinsky6** (Video Lite 3B and Video Pro 30B, text- and image-to-video-and-audio). Three block lists, in
the order the model runs them:

- ``video_text_transformer_blocks`` and ``audio_text_transformer_blocks``
  (``Kandinsky6TransformerEncoderBlock``): each modality refines its own projection of the Qwen2.5-VL
  prompt with timestep-modulated self-attention. The loops call ``block(x, time_embed, rope, attn_mask)``
  positionally with that branch's ``temb``, its text RoPE table and the model's ``encoder_attention_mask``
  (a ``(B, S)`` key-padding mask, or None): the same objects for every block of a list, and each block
  returns the refined tokens alone. The first parameter is ``x``, so both lists carry ``{"x": None}``.
- ``visual_transformer_blocks`` (``Kandinsky6FusedTransformerDecoderBlock``), one fused block per layer:
  video self-attention, video-to-text cross-attention, audio self-attention, audio-to-text
  cross-attention, the two cross-modal attentions, then one MLP per stream. Called as
  ``block(vis, aud, text_v, text_a, time_embed, vis_rope, aud_rope, attn_mask)`` and returning
  ``(vis, aud)``, so the list carries ``{"vis": 0, "aud": 1}``. The refined prompts are the text lists'
  final outputs, fixed before this loop, and the RoPE tables and the mask are built once. ``time_embed``
  is a tuple ``(video_temb, audio_temb)`` built afresh in every iteration: a new tuple, but of the same
  two tensors, and a chunk compares tuple arguments item by item (identity and version of each tensor),
  so it sees no change. Nothing is added between blocks, so all three lists chunk.

Without ``audio_hidden_states`` (the pipeline's ``sample_audio=False``) the model denoises video alone:
``aud`` is None in and out of every fused block, so the carry hands None on (only the tensors it carries
are version-checked), and the fused blocks skip their audio and cross-modal parts. The audio text list
still runs (upstream computes the audio prompt and then leaves it unused); its regions cost a forward and
keep nothing. The image-to-video mode (a reference latent appended as a tail frame, with per-frame token
type embeddings and the pipeline's own RoPE positions) and ``encoder_attention_mask`` only change what the
model builds before the loops.

FFN seams. Every MLP is diffusers' ``FeedForward`` (``Linear`` to ``ff_dim``, GELU, dropout
``p = 0``, ``Linear``), called as ``gate_sum(x, feed_forward(scale_shift(norm(x.float()), x, scale, shift)),
gate)``: on exactly the modulated norm output, a fresh tensor nothing else reads, its return value only
gated into the residual (in float32). So each MLP is a seam of its own: ``("feed_forward",)`` in the encoder
blocks, ``("video_dec_block.feed_forward",)`` and ``("audio_dec_block.feed_forward",)`` in the fused ones.
The norms cannot join: their output is scaled and shifted before the MLP sees it. Recomputing drops the
``ff_dim``-wide projection and its GELU for every token (16384 wide for Pro's video, 7168 for its audio).
``Kandinsky6TransformerDecoderBlock`` (``video_dec_block``, ``audio_dec_block``) is only a container of
submodules: the fused block calls its members directly and never its ``forward``, so it is not a block
class here, and the seams are named through it.

Attention side: ``attn`` in the encoder blocks; in the fused blocks all six attention modules,
``video_dec_block.self_attention``, ``video_dec_block.cross_attention``, ``audio_dec_block.self_attention``,
``audio_dec_block.cross_attention``, ``va_cross_attention`` and ``av_cross_attention`` (each a
``Kandinsky6Attention``: projections, QK RMSNorms, RoPE and one dispatched SDPA call in its processor). In
video-only mode the four audio and cross-modal ones are not called: their regions stay idle, exactly.

diffusers' own checkpointing flag passes each block the same arguments positionally and is exact; gradseam
switches it off while patched.

**kandinsky6-sr** (the 1.4B video super-resolution DiT, text-free). One list, ``visual_transformer_blocks``
(``Kandinsky6SRTransformerBlock``), called as ``block(hidden_states, temb, rotary_emb, sparse_params)`` and
returning the new hidden states: ``Carry({"hidden_states": None})``. ``temb`` (timestep plus a learnt bias),
the RoPE table (reordered once into 8x8 token groups) and ``sparse_params`` (one dict holding the sliding-tile
prior and the threshold, built once) are the same objects for every block, so the list chunks. The NABLA block
mask is rebuilt inside every attention call from that block's own queries and keys with deterministic
operations (pooling, softmax, sort, cumsum, argsort), so a recompute, which recomputes the same queries and
keys, rebuilds the same mask. The seam is ``feed_forward``, called as in the fused blocks above; the attention
side is ``self_attention``.

That attention always runs PyTorch's flex attention with the NABLA ``BlockMask``, which is not an operator
gradseam recognises as an attention kernel. Eagerly, flex attention compiles its own call and materialises
the float32 score matrix (28 heads x 47616² x 4 bytes = 254 GB for one 512x768 tile of 121 frames; upstream
tells users to compile the blocks), so the compiled backends (``compile``, ``unsloth-compile``), which compile
it inside each block, are the ones to train this model at size with (exact to the compiled tolerance on the
CPU; not run on a GPU here). Attention offload alone, and beside the ``-ffn`` backends, is exact. Kept or
offloaded attention inside whole-block regions is refused in forward by the core, saying what to change (the
gate that keeps kernel outputs cannot run flex attention's own compile). diffusers' own checkpointing flag is
exact here too.
"""

from __future__ import annotations

import math
from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker, video_latent_size

_M = "diffusers.models.transformers.transformer_kandinsky6"
_SR = "diffusers.models.transformers.transformer_kandinsky6_sr"

AUDIO_SAMPLE_RATE = 44_100  # the MMAudio VAE's waveform rate (the pipeline's `audio_sample_rate`)
AUDIO_HOP = 1024  # waveform samples per audio latent: the VAE's mel hop (512), downsampled once by 2


def audio_latents(latent_frames: int, fps: float = 24.0) -> int:
    """How many audio latents ``Kandinsky6TI2VAPipeline`` makes for ``latent_frames`` video latents: the
    clip's ``(T - 1) * 4 + 1`` frames at ``fps``, in hops of 1024 samples at 44.1 kHz, rounded up (218 for
    121 frames at 24 fps)."""
    return math.ceil(((latent_frames - 1) * 4 + 1) / fps * AUDIO_SAMPLE_RATE / AUDIO_HOP)


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, frames: int = 121, height: int = 480,
    width: int = 864, fps: float = 24.0, text_tokens: int = 1024, prompt_tokens: int | None = None,
    audio: bool = True, image: bool = False,
) -> dict:
    """One real-size batch as ``Kandinsky6TI2VAPipeline`` feeds the transformer: the video latents
    ``(1, T, H/8, W/8, 2C+1)`` (grad; the noisy latents, the always-zero conditioning latents and the mask,
    as the pipeline stacks them on the channels of a ``visual_cond`` model), ``T = (frames-1)/4+1``; the
    audio latents ``(1, A, 40)`` (grad) for the same clip (``audio=False`` leaves them out: video only);
    Qwen2.5-VL prompt states of ``text_tokens`` tokens (the pipeline pads every prompt to 1024) and the
    pooled CLIP vector; a timestep on the 0-1000 scale. ``prompt_tokens`` marks only that many prompt
    tokens valid with a key-padding ``encoder_attention_mask`` (default: all, and no mask, as the pipeline
    passes for an unpadded batch). ``image=True`` is the image-to-video mode: the reference latent appended
    as an extra tail frame with token type 1, reusing frame 0's RoPE position. ``tokens`` overrides the
    video token count by changing ``T`` (the audio follows the clip's length)."""
    import torch

    cfg = model.config
    pt, ph, pw = cfg.patch_size
    t, h, w = video_latent_size(frames, height, width, patch=(pt, ph, pw), tokens=tokens)
    channels = 2 * cfg.in_visual_dim + 1 if cfg.visual_cond else cfg.in_visual_dim
    randn = tensor_maker(device, dtype)
    x = {
        "hidden_states": randn(1, t + int(image), h, w, channels, grad=True),
        "encoder_hidden_states": randn(1, text_tokens, cfg.in_text_dim),
        "pooled_projections": randn(1, cfg.in_text_dim2),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
    }
    if audio:
        x["audio_hidden_states"] = randn(1, audio_latents(t, fps), cfg.in_audio_dim, grad=True)
    if prompt_tokens is not None and prompt_tokens < text_tokens:
        mask = torch.zeros(1, text_tokens, dtype=torch.bool, device=device)
        mask[:, :prompt_tokens] = True
        x["encoder_attention_mask"] = mask
    if image:
        types = torch.zeros(1, t + 1, dtype=torch.long, device=device)
        types[:, -1] = 1
        x["visual_token_type_ids"] = types
        x["visual_rope_pos"] = (
            torch.cat([torch.arange(t // pt, device=device), torch.zeros(1, dtype=torch.long, device=device)]),
            torch.arange(h // ph, device=device),
            torch.arange(w // pw, device=device),
        )
    return x


def make_sr_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, frames: int = 121, height: int = 512,
    width: int = 768, batch: int = 1,
) -> dict:
    """One tile batch as ``Kandinsky6SRPipeline`` feeds the transformer: ``batch`` latent tiles
    ``(B, T, H/16, W/16, 2C+1)`` of the K-VAE (16x spatial, 4x temporal; grad), the noisy latents, the
    low-resolution anchor latents and the anchor mask stacked on the channels, for a tile of ``height`` x
    ``width`` pixels (one of the model's trained tile sizes) over ``frames`` frames; a timestep on the
    0-1000 scale. ``tokens`` overrides the token count by changing ``T``."""
    import torch

    cfg = model.config
    t, h, w = video_latent_size(frames, height, width, patch=tuple(cfg.patch_size), tokens=tokens, spatial=16)
    randn = tensor_maker(device, dtype)
    return {
        "hidden_states": randn(batch, t, h, w, 2 * cfg.in_visual_dim + 1, grad=True),
        "timestep": torch.full((batch,), 500.0, device=device, dtype=dtype),
    }


# Kandinsky 6.0 Video Pro as released (kandinskylab/kandinsky-6's release contract for the
# Kandinsky-6.0-Pro-*-Diffusers checkpoints): 60 fused blocks, video 32 x 128 heads (MLP 16384), audio
# 16 x 128 heads (MLP 7168), 40 audio latent channels, the cross-modal RoPE, gates and modulation fix, and
# the two token types of image-to-video. The class defaults leave the audio at the video's width and every
# released flag off. `out_*_dim` are the undistilled heads; the distilled checkpoints widen both tenfold.
PRO = {
    "in_visual_dim": 16, "out_visual_dim": 16, "in_text_dim": 3584, "in_text_dim2": 768, "time_dim": 1024,
    "patch_size": (1, 2, 2), "model_dim": 4096, "ff_dim": 16384, "num_text_blocks": 4, "num_visual_blocks": 60,
    "axes_dims": (32, 48, 48), "visual_cond": True, "in_audio_dim": 40, "out_audio_dim": 40, "model_dim_a": 2048,
    "time_dim_a": 1024, "ff_dim_a": 7168, "axes_dims_a": (32, 48, 48), "audio_freqs_scaling": 0.144,
    "scale_factor": (1.0, 2.0, 2.0), "text_token_padding": True, "ca_rope": True, "cross_gates": True,
    "fix_modulation": True, "visual_token_type_num_embeddings": 2,
}
# Video Lite: the same architecture at Kandinsky 5 Lite's trunk (32 fused blocks, 28 x 64 heads, MLP 7168;
# audio 896 wide, 14 x 64 heads, MLP 3584; 2 text blocks per branch).
LITE = {
    **PRO, "time_dim": 512, "model_dim": 1792, "ff_dim": 7168, "num_text_blocks": 2, "num_visual_blocks": 32,
    "axes_dims": (16, 24, 24), "model_dim_a": 896, "time_dim_a": 512, "ff_dim_a": 3584, "axes_dims_a": (16, 24, 24),
}
# The released SR DiT (Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers): diffusers' class defaults, spelled
# out (32 blocks, 28 x 64 heads, MLP 7168, 64 K-VAE channels, the distilled 10-grid head of 640).
VSR = {
    "in_visual_dim": 64, "out_visual_dim": 640, "time_dim": 512, "patch_size": (1, 1, 1), "model_dim": 1792,
    "ff_dim": 7168, "num_visual_blocks": 32, "axes_dims": (16, 24, 24), "scale_factor": (1.0, 2.0, 2.0),
    "nabla_threshold": 0.8, "nabla_window": (11, 7, 7),
}
_SD_5S = {"frames": 121, "height": 480, "width": 864, "fps": 24.0, "text_tokens": 1024}

_ENCODER = f"{_M}.Kandinsky6TransformerEncoderBlock"
_FUSED = f"{_M}.Kandinsky6FusedTransformerDecoderBlock"
_TEXT = Carry({"x": None})

KANDINSKY6 = Family(
    name="kandinsky6",
    description="Kandinsky 6.0 Video Lite / Pro, joint video and audio (Kandinsky6Transformer3DModel)",
    models=(f"{_M}.Kandinsky6Transformer3DModel",),
    block_lists=(
        BlockList("video_text_transformer_blocks", carry=_TEXT),
        BlockList("audio_text_transformer_blocks", carry=_TEXT),
        BlockList("visual_transformer_blocks", carry=Carry({"vis": 0, "aud": 1})),
    ),
    block_classes=(
        BlockClass(_ENCODER, ffn=(("feed_forward",),), attention=("attn",)),
        BlockClass(
            _FUSED,
            ffn=(("video_dec_block.feed_forward",), ("audio_dec_block.feed_forward",)),
            attention=(
                "video_dec_block.self_attention", "video_dec_block.cross_attention",
                "audio_dec_block.self_attention", "audio_dec_block.cross_attention",
                "va_cross_attention", "av_cross_attention",
            ),
        ),
    ),
    presets={
        "pro-480p-5s": Preset(
            "Kandinsky 6.0 Video Pro (4 + 4 text blocks, 60 fused blocks; video dim 4096, 32 x 128 heads, MLP "
            "16384; audio dim 2048, MLP 7168; 30.1B parameters; the released config, not the class defaults) "
            "at the pipeline's 480x864, 121 frames at 24 fps: 31 x 30 x 54 = 50220 video tokens, 218 audio "
            "latents and 1024 Qwen2.5-VL tokens",
            config=PRO,
            inputs=_SD_5S,
            make_inputs=make_inputs,
        ),
        "lite-480p-5s": Preset(
            "Kandinsky 6.0 Video Lite (2 + 2 text blocks, 32 fused blocks; video dim 1792, 28 x 64 heads, MLP "
            "7168; audio dim 896, MLP 3584; 3.2B parameters; the released config) at 480x864, 121 frames at "
            "24 fps: 50220 video tokens, 218 audio latents, 1024 Qwen2.5-VL tokens",
            config=LITE,
            inputs=_SD_5S,
            make_inputs=make_inputs,
        ),
    },
)

KANDINSKY6_SR = Family(
    name="kandinsky6-sr",
    description="Kandinsky 6.0 video super-resolution (Kandinsky6SRTransformer3DModel)",
    models=(f"{_SR}.Kandinsky6SRTransformer3DModel",),
    block_lists=(BlockList("visual_transformer_blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(
        BlockClass(f"{_SR}.Kandinsky6SRTransformerBlock", ffn=(("feed_forward",),), attention=("self_attention",)),
    ),
    presets={
        "vsr-1.4b-512x768": Preset(
            "Kandinsky 6.0 VSR DiT (32 blocks, dim 1792, 28 x 64 heads, MLP 7168; 1.4B parameters; the released "
            "distilled checkpoint, diffusers' class defaults) on one 512x768 tile of a 121-frame clip: "
            "31 x 32 x 48 = 47616 tokens. NABLA flex attention: eager, it materialises the whole score "
            "matrix, so at this size only the compiled backends run",
            config=VSR,
            inputs={"frames": 121, "height": 512, "width": 768},
            make_inputs=make_sr_inputs,
        ),
        "vsr-1.4b-512x512": Preset(
            "Kandinsky 6.0 VSR DiT (as 'vsr-1.4b-512x768') on one 512x512 tile of a 121-frame clip: "
            "31 x 32 x 32 = 31744 tokens (only the compiled backends run at this size)",
            config=VSR,
            inputs={"frames": 121, "height": 512, "width": 512},
            make_inputs=make_sr_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(KANDINSKY6)
    register(KANDINSKY6_SR)
