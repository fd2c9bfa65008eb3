"""Stable Audio Open 1.0 (diffusers' ``StableAudioDiTModel``: the 1.06B text-to-audio DiT that
stable-audio-tools and the diffusers pipeline share; fine-tunes of it keep the class and its config).

One block list, ``transformer_blocks``, every entry a ``StableAudioDiTBlock``: a pre-LayerNorm block
without any modulation, on a 1-D sequence of Oobleck latent frames. Before the loop the model projects
the conditioning once: the T5 prompt states (with the two duration tokens appended by the pipeline)
through ``cross_attention_proj``, the global duration vector through ``global_proj`` plus the timestep
embedding, which becomes one token prepended to the projected latents. A self-attention padding mask,
if given, gets a ``True`` column for that token once, before the loop too. Then each block is called
by keyword, ``block(hidden_states=, attention_mask=, encoder_hidden_states=, encoder_attention_mask=,
rotary_embedding=)``, and returns the new hidden states alone.

**Carry** ``Carry({"hidden_states": None})``: the four other arguments are the same objects for every
block of a call (the projected prompt, the two masks or ``None``, and the caller's RoPE ``(cos, sin)``
tuple, which the model passes through untouched), and nothing runs between two blocks, so a chunk's
later blocks are called exactly as the chunk ran them and chunks run whole. diffusers' own checkpointing
path passes the same five arguments positionally, in the order of the block's signature.

FFN seam ``("norm3", "ff")``: the block computes ``hidden_states + ff(norm3(hidden_states))``. ``norm3``
(a plain affine ``LayerNorm``) is called on the fresh residual sum alone, its output goes to ``ff`` and
nowhere else, and ``ff``'s output only meets the residual in an addition. So the two modules form a
strict chain whose one input is the residual stream, and checkpointing them as one region is exact: it
drops the LayerNorm output, the SwiGLU's ``2·4d``-wide projection (``2·6144`` at d = 1536), the SiLU
output and their product, keeping only the seam's input. ``FeedForward`` here holds two dropouts of
p = 0 (``dropout=0.0`` is hard-wired by the model) and draws no random numbers; the block's
``set_chunk_feed_forward`` settings are stored but never read by its ``forward``.

Attention side: ``attn1`` (self-attention; partial RoPE on the first half of each 64-wide head, applied
to queries and keys in float32, and the padding mask) and ``attn2`` (cross-attention to the projected
prompt, 24 query heads over 12 KV heads, no RoPE). Both run ``StableAudioAttnProcessor2_0``: the
projections, the GQA repeat, the single SDPA call and ``to_out`` all happen inside the module. The
LayerNorms ``norm1`` / ``norm2`` and the residual additions stay outside.
"""

from __future__ import annotations

import math
from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker

_M = "diffusers.models.transformers.stable_audio_transformer"

# The Oobleck VAE of Stable Audio Open: 44.1 kHz stereo, strides 2·4·4·8·8 = 2048 samples per latent
# frame (``AutoencoderOobleck.hop_length``), 64 latent channels.
SAMPLING_RATE = 44100
HOP_LENGTH = 2048
# The T5-base prompt, padded to the conditioner's 128 tokens, then the seconds_start and seconds_end
# tokens the pipeline appends (``text_audio_duration_embeds``).
PROMPT_TOKENS = 128
DURATION_TOKENS = 2


def latent_frames(seconds: float) -> int:
    """Oobleck latent frames covering ``seconds`` of 44.1 kHz audio (``ceil``, 21.53 per second)."""
    return math.ceil(round(seconds * SAMPLING_RATE) / HOP_LENGTH)


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, seconds: float | None = None,
    prompt_tokens: int = PROMPT_TOKENS,
) -> dict:
    """One real-size training batch as ``StableAudioPipeline`` feeds the DiT: the noisy latents
    ``(1, in_channels, frames)`` (grad), the prompt states with the two duration tokens appended
    ``(1, prompt_tokens + 2, cross_attention_input_dim)``, the global duration vector
    ``(1, 1, global_states_input_dim)`` (the two duration embeddings side by side), a continuous
    timestep, and the pipeline's RoPE ``(cos, sin)`` over ``frames + 1`` positions (the prepended global
    token included) on half of each head, in float32 as the pipeline makes it.

    ``frames`` is the model's ``sample_size`` (the pipeline always denoises that many, 1024 latent
    frames: 47.55 s), or ``seconds`` of audio; ``tokens`` overrides the latent frame count.
    """
    import torch
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    cfg = model.config
    if tokens:
        frames = tokens
    elif seconds is not None:
        frames = latent_frames(seconds)
    else:
        frames = int(cfg.sample_size)
    randn = tensor_maker(device, dtype)
    cos, sin = get_1d_rotary_pos_embed(
        cfg.attention_head_dim // 2, frames + 1, use_real=True, repeat_interleave_real=False
    )
    return {
        "hidden_states": randn(1, cfg.in_channels, frames, grad=True),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, prompt_tokens + DURATION_TOKENS, cfg.cross_attention_input_dim),
        "global_hidden_states": randn(1, 1, cfg.global_states_input_dim),
        "rotary_embedding": (cos.to(device), sin.to(device)),
    }


# stabilityai/stable-audio-open-1.0 transformer/config.json, which the class defaults stand for (the file
# writes sample_size as 1024.0): spelled out so a change of defaults shows.
CONFIG = {
    "sample_size": 1024, "in_channels": 64, "num_layers": 24, "attention_head_dim": 64, "num_attention_heads": 24,
    "num_key_value_attention_heads": 12, "out_channels": 64, "cross_attention_dim": 768, "time_proj_dim": 256,
    "global_states_input_dim": 1536, "cross_attention_input_dim": 768,
}

STABLE_AUDIO = Family(
    name="stable-audio",
    description="Stable Audio Open 1.0 text-to-audio DiT (StableAudioDiTModel)",
    models=(f"{_M}.StableAudioDiTModel",),
    block_lists=(BlockList("transformer_blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(
        BlockClass(f"{_M}.StableAudioDiTBlock", ffn=(("norm3", "ff"),), attention=("attn1", "attn2")),
    ),
    presets={
        # the pipeline and stable-audio-tools' fine-tuning always run the full sample_size window (shorter
        # clips are padded to it): 1024 latent frames, the model's whole context
        "open-1.0-47s": Preset(
            "Stable Audio Open 1.0 DiT (1.06B: 24 blocks, dim 1536, 24 x 64 heads, 12 KV heads in the "
            "cross-attention, SwiGLU 6144; the published config = the class defaults) on its full "
            "sample_size window: 1024 Oobleck latent frames (47.55 s of 44.1 kHz stereo) + 1 global token, "
            "cross-attending to 128 T5 prompt tokens + 2 duration tokens",
            config=CONFIG,
            inputs={"prompt_tokens": PROMPT_TOKENS},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(STABLE_AUDIO)
