"""ACE-Step 1.5 music generation (diffusers' ``AceStepTransformer1DModel``: the DiT that SimpleTuner,
ai-toolkit and DiffSynth fine-tune; turbo, base and SFT checkpoints share the class).

One block list, ``layers``, every entry an ``AceStepTransformerBlock``, on a 1-D sequence of audio
latent patches (``context_latents`` and the noisy latents concatenated on the channel axis, padded to
a multiple of ``patch_size`` and patchified by a ``Conv1d``). The condition encoder that packs the
lyric, timbre and text conditioning (``AceStepConditionEncoder``, with its own lyric and timbre
transformer stacks) is a separate model of the pipeline, not part of this class: the transformer
only projects its output once (``condition_embedder``) before the loop. Each block is called by
keyword, ``layer(hidden_states=, position_embeddings=, temb=, attention_mask=,
encoder_hidden_states=, encoder_attention_mask=None)``, and returns the new hidden states alone.

**No carry** (``gradient_checkpointing_interval`` is ignored with a warning; every block is its own
region): the RoPE ``(cos, sin)`` tuple, the timestep projection and the projected condition are the
same objects for every block, but ``attention_mask`` is not. Self-attention alternates between a
sliding window (``layer_types``; by default layers 0, 2, 4, ...) and full attention, and with
every attention backend except diffusers' flash ones the loop hands the sliding layers a banded
``(1, 1, S, S)`` mask and the full layers ``None``. Any two consecutive blocks therefore differ in
that argument, so every chunk's later blocks would be called with another mask than the chunk ran
them with and compute again: exact, but the chunk's forward twice for nothing. With the flash
backends every block gets ``None`` (the window is the module's own ``sliding_window``, passed to
flash-attn), and chunks would run whole; a declaration cannot depend on the backend, so the family
takes the one that is right for both. The model has no audio or text padding mask: the pipeline
drops the condition encoder's mask, and ``encoder_attention_mask`` is always ``None``.

FFN seam ``("mlp",)``: ``AceStepMLP``, a SwiGLU (``gate_proj`` and ``up_proj`` to
``intermediate_size``, SiLU, product, ``down_proj``), called on exactly
``mlp_norm(h) * (1 + c_scale) + c_shift`` with the gate ``c_gate_msa`` and the residual applied to
its return value outside it, so checkpointing the module alone is exact and drops both 6144-wide
projections, the SiLU output and their product (at d = 2048). ``mlp_norm`` cannot join: its output
is scaled and shifted before ``mlp`` sees it. The MLP is dense and holds no dropout.

Attention side: ``self_attn`` and ``cross_attn`` (``AceStepAttention``: GQA projections, the Q/K
RMSNorms, RoPE on the self-attention only, the dispatched attention call and ``to_out`` all run in
its processor). Every block is built with ``use_cross_attention=True`` and the model always passes
the condition, so both exist and run in every block. The AdaLN arithmetic, ``cross_attn_norm`` and
the residuals stay outside.
"""

from __future__ import annotations

import math

from gradseam.family import BlockClass, BlockList, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker

_M = "diffusers.models.transformers.ace_step_transformer"

# The pipeline's latent frame rate: the 48 kHz audio VAE downsamples by 1920 (``AceStepPipeline``
# reads ``sampling_rate`` / prod(``downsampling_ratios``) from the VAE config, 48000 / 1920 = 25 Hz).
LATENTS_PER_SECOND = 25


def latent_frames(seconds: float) -> int:
    """Latent frames of ``seconds`` of audio, as ``AceStepPipeline`` computes them (``ceil``)."""
    return math.ceil(seconds * LATENTS_PER_SECOND)


def make_inputs(
    model, device, dtype, tokens=None, *, seconds=60.0, text_tokens=256, lyric_tokens=512
) -> dict:
    """One real-size training batch as ``AceStepPipeline`` feeds the DiT: noisy latents
    ``(1, frames, audio_acoustic_hidden_dim)`` (grad) at 25 latent frames per second, the context
    latents beside them (``in_channels`` minus that: source latents and chunk mask), the packed
    condition (``lyric_tokens`` lyric tokens, one timbre token, ``text_tokens`` caption tokens, at the
    condition encoder's width) and ``timestep_r`` equal to ``timestep``, as the pipeline passes them.

    ``tokens`` overrides the patch count the blocks see (``tokens * patch_size`` latent frames).
    """
    import torch

    cfg = model.config
    frames = tokens * cfg.patch_size if tokens else latent_frames(seconds)
    width = cfg.encoder_hidden_size or cfg.hidden_size
    randn = tensor_maker(device, dtype)
    return {
        "hidden_states": randn(1, frames, cfg.audio_acoustic_hidden_dim, grad=True),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "timestep_r": torch.full((1,), 0.5, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, lyric_tokens + 1 + text_tokens, width),
        "context_latents": randn(1, frames, cfg.in_channels - cfg.audio_acoustic_hidden_dim),
    }


# The published ACE-Step 1.5 DiT config (ACE-Step/Ace-Step1.5, acestep-v15-turbo; base and SFT share
# the architecture), which the class defaults stand for: spelled out so a change of defaults shows.
CONFIG = {
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "in_channels": 192, "audio_acoustic_hidden_dim": 64,
    "patch_size": 2, "rope_theta": 1000000.0, "attention_bias": False, "attention_dropout": 0.0,
    "rms_norm_eps": 1e-6, "sliding_window": 128, "layer_types": None, "encoder_hidden_size": None,
    "is_turbo": True, "model_version": "turbo",
}
_DESCRIPTION = (
    "ACE-Step 1.5 DiT (1.6B: 24 layers alternating 128-token sliding-window and full self-attention, "
    "dim 2048, 16 x 128 heads with 8 KV heads, SwiGLU 6144; the published turbo config = the class "
    "defaults) at {seconds} s of 48 kHz audio ({frames} latent frames at 25 Hz: {tokens} patches) with "
    "512 lyric + 1 timbre + 256 caption condition tokens"
)


def _preset(seconds: int) -> Preset:
    frames = latent_frames(seconds)
    return Preset(
        _DESCRIPTION.format(seconds=seconds, frames=frames, tokens=frames // 2),
        config=CONFIG,
        inputs={"seconds": seconds, "text_tokens": 256, "lyric_tokens": 512},
        make_inputs=make_inputs,
    )


ACE_STEP = Family(
    name="ace-step",
    description="ACE-Step 1.5 music DiT (AceStepTransformer1DModel)",
    models=(f"{_M}.AceStepTransformer1DModel",),
    block_lists=(BlockList("layers"),),  # no carry: the self-attention mask alternates (see above)
    block_classes=(
        BlockClass(f"{_M}.AceStepTransformerBlock", ffn=(("mlp",),), attention=("self_attn", "cross_attn")),
    ),
    presets={
        # 60 s: the pipeline's default duration; 240 s: a four-minute song, trained whole
        "1.5-60s": _preset(60),
        "1.5-240s": _preset(240),
    },
)


@hookimpl
def register_families(register):
    register(ACE_STEP)
