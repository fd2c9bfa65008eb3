"""Stable Audio 3 (diffusers' ``StableAudio3DiTModel``: the rectified-flow DiT of the released SA3 Medium
checkpoint and its base model; text-to-audio, audio-to-audio and inpainting pipelines share it).

One block list, ``transformer_blocks``, every entry a ``StableAudio3DiTBlock``, on a 1-D sequence of SAME
latent frames with ``num_memory_tokens`` learned memory tokens prepended. Everything the blocks share is
made once before the loop: the T5Gemma context (padded prompt positions are replaced by the learned
``prompt_padding_embedding`` and the mask is then dropped, so every block gets ``context_mask=None``),
projected by ``to_cond_embed``; the ``(B, 6·d)`` AdaLN signal ``global_modulation`` from the duration
vector plus the timestep embedding; the RoPE angle table ``(tokens, rot_dim)``; and, for inpainting, the
transposed ``local_add_cond``. Each block is then called as ``block(x, context=, global_modulation=,
rope=, context_mask=, local_seq=, num_memory_tokens=)`` and returns the new hidden states alone.

**Carry** ``Carry({"hidden_states": None})``: the context, the modulation signal, the RoPE table and
``local_seq`` are the same objects for every block of a call, ``context_mask`` is always ``None`` and
``num_memory_tokens`` is the config's int; each block adds its own ``to_scale_shift_gate`` parameter to
the shared signal inside its ``forward``, and nothing runs between two blocks. So a chunk's later blocks
are called exactly as the chunk ran them, and chunks run whole, inpainting included. diffusers' own
checkpointing path passes the same seven arguments positionally, in the block's order.

FFN seam ``("ff",)``: ``StableAudio3FeedForward``, a SwiGLU (``proj_in`` to ``2·4d``, chunk, SiLU,
product, ``proj_out``), called on ``ff_norm(h) * (1 + scale_ff) + shift_ff``, a fresh tensor nothing
else uses; its return value is only multiplied by ``sigmoid(1 - gate_ff)`` and added to the residual,
both outside it. Checkpointing the module alone is exact and drops the ``2·6144``-wide projection, the
SiLU output and the ``6144``-wide product (at d = 1536). ``ff_norm`` cannot join: its output is scaled
and shifted before ``ff`` sees it. The inpainting projection ``to_local_embed`` runs before ``ff_norm``,
on the residual stream, and stays outside.

Attention side: ``self_attn`` and ``cross_attn`` (``StableAudio3SelfAttention`` /
``StableAudio3CrossAttention``: the fused projections, the per-head RMS QK norms, the partial RoPE on the
self-attention, and, with the released differential attention, two dispatched attention calls whose
difference is taken before ``to_out``, all inside each module's processor). Every block has both. The
``pre_norm`` / ``cross_attend_norm`` RMS norms, the AdaLN arithmetic and the gated residuals stay outside.
"""

from __future__ import annotations

import math
from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker

_M = "diffusers.models.transformers.transformer_stable_audio3"

# The SAME autoencoder (SAME-L for Medium, SAME-S for the small models): 44.1 kHz stereo, 256-sample
# patches then a 16x transformer resampler, 4096 samples per 256-channel latent frame (10.77 per second).
SAMPLING_RATE = 44100
DOWNSAMPLING_RATIO = 4096
# The pipeline pads T5Gemma prompts to 256 tokens and appends the duration embedding as one more token.
PROMPT_TOKENS = 256


def latent_frames(seconds: float) -> int:
    """SAME latent frames of ``seconds`` of audio, as ``StableAudio3Pipeline`` computes them (``ceil``)."""
    return math.ceil(seconds * SAMPLING_RATE / DOWNSAMPLING_RATIO)


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, seconds: float = 120.0,
    prompt_tokens: int = PROMPT_TOKENS, prompt_valid: int | None = None, inpaint: bool = False,
) -> dict:
    """One real-size training batch as ``StableAudio3Pipeline`` feeds the DiT: the noisy SAME latents
    ``(1, io_channels, frames)`` (grad) of ``seconds`` of audio, a flow time in ``[0, 1]``, the context
    ``(1, prompt_tokens + 1, cond_token_dim)`` (the T5Gemma prompt, then the duration token) with its
    boolean mask (``prompt_valid`` valid prompt tokens, right-padded; all by default; the duration token
    always valid), and the global duration vector ``(1, global_cond_dim)``. ``inpaint`` adds the
    inpainting pipeline's ``local_add_cond`` ``(1, local_add_cond_dim, frames)`` (the mask channel,
    then the masked latents). The blocks see ``frames // patch_size + num_memory_tokens`` tokens.

    ``tokens`` overrides the latent frame count.
    """
    import torch

    cfg = model.config
    frames = tokens if tokens else latent_frames(seconds)
    frames = max(1, frames // cfg.patch_size) * cfg.patch_size
    randn = tensor_maker(device, dtype)
    mask = torch.ones(1, prompt_tokens + 1, device=device, dtype=torch.bool)
    if prompt_valid is not None:
        mask[:, prompt_valid:prompt_tokens] = False
    inputs = {
        "hidden_states": randn(1, cfg.io_channels, frames, grad=True),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, prompt_tokens + 1, cfg.cond_token_dim),
        "global_hidden_states": randn(1, cfg.global_cond_dim),
        "encoder_attention_mask": mask,
    }
    if inpaint:
        inputs["local_add_cond"] = randn(1, cfg.local_add_cond_dim, frames)
    return inputs


# stabilityai/stable-audio-3-medium's DiT (model_config.json; diffusers' structural test checks the class
# against that checkpoint), which the class defaults stand for: spelled out so a change of defaults shows.
MEDIUM = {
    "io_channels": 256, "patch_size": 1, "embed_dim": 1536, "depth": 24, "num_heads": 24, "cond_token_dim": 768,
    "global_cond_dim": 768, "local_add_cond_dim": 257, "timestep_features_dim": 256, "ff_mult": 4.0,
    "num_memory_tokens": 64, "use_differential_attention": True,
}
_DESCRIPTION = (
    "Stable Audio 3 Medium DiT (1.45B: 24 blocks, dim 1536, 24 x 64 heads, differential self- and "
    "cross-attention, SwiGLU 6144, 64 memory tokens; the published config = the class defaults) on {seconds} s "
    "of 44.1 kHz stereo ({frames} SAME latent frames + 64 memory tokens), cross-attending to 256 T5Gemma "
    "prompt tokens + 1 duration token"
)


def _preset(seconds: int) -> Preset:
    return Preset(
        _DESCRIPTION.format(seconds=seconds, frames=latent_frames(seconds)),
        config=MEDIUM,
        inputs={"seconds": seconds},
        make_inputs=make_inputs,
    )


STABLE_AUDIO3 = Family(
    name="stable-audio3",
    description="Stable Audio 3 rectified-flow audio DiT (StableAudio3DiTModel)",
    models=(f"{_M}.StableAudio3DiTModel",),
    block_lists=(BlockList("transformer_blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(
        BlockClass(f"{_M}.StableAudio3DiTBlock", ffn=(("ff",),), attention=("self_attn", "cross_attn")),
    ),
    presets={
        # 10 s: the pipeline's default duration (sound effects); 120 s: the music length the release
        # reports its speed and quality at; 380 s: the longest the model generates (6 min 20 s)
        "medium-10s": _preset(10),
        "medium-120s": _preset(120),
        "medium-380s": _preset(380),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(STABLE_AUDIO3)
