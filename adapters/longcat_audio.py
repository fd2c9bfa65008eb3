"""LongCat-AudioDiT (diffusers' ``LongCatAudioDiTTransformer``; the 1B and 3.5B text-to-speech DiTs).

One list, ``blocks``, of ``AudioDiTBlock`` s (24 in the 1B, 32 in the 3.5B) over the Wav-VAE latent
frames, a 1-D sequence. Before the loop the model embeds the timestep, runs the UMT5 caption states
through ``text_embed`` and the ConvNeXt ``text_conv_layer`` (masked back to zero on padding), embeds the
noisy latents and fuses the latent condition (the voice prompt's clean latents, zeros where the model
infills) into them, clones that for the long skip, builds the two RoPE ``(cos, sin)`` tuples (audio and
text positions) and, with ``adaln_type="global"``, one ``adaln_global_out`` modulation for all blocks. It
then calls every block by keyword with ``hidden_states``, ``timestep_embed``, ``cond``, ``mask``,
``cond_mask``, ``rope``, ``cond_rope`` and (global only) ``adaln_global_out``: apart from
``hidden_states`` the same objects for every block, with nothing happening between blocks (the long skip
adds the clone after the loop). Each block returns the new ``hidden_states`` alone, so the list carries
``{"hidden_states": None}`` and interval chunks run whole, padded batches, the ``None`` mask the model
accepts, and ``adaln_type="local"`` (each block derives its own modulation from ``timestep_embed`` and
the caption inside its forward) included.

FFN seam ``("ffn",)``: the MLP branch is ``h + gate_ffn * ffn(modulate(F.layer_norm(h)))``. The norm is
the functional ``F.layer_norm`` (no module) followed by the block's own scale and shift, so ``ffn``
(``AudioDiTFeedForward``: ``Linear`` to ``ff_mult·d``, tanh-GELU, ``Dropout``, ``Linear`` back) is called on
one fresh tensor and its return value only goes to the gated residual: recomputing it as one region is
exact, and drops the ``ff_mult·d``-wide pre-activation and GELU output (6144 wide in the 1B, 9216 in the
3.5B). Nothing can join it: the norm is not a module, and the gate multiplies outside. The published
configs have no dropout; with ``dropout > 0`` the recompute replays the same mask (checkpointing restores
the RNG state), so the seam stays exact.

Attention side: ``self_attn`` and ``cross_attn`` (``AudioDiTAttention``: Q/K/V projections, Q/K RMSNorms,
the 1-D RoPE, one ``dispatch_attention_fn`` call, the mask applied to the output, ``to_out``; all inside
the processors). ``cross_attn`` exists only with ``cross_attn=True`` (the published configs): built with
``cross_attn=False`` the block has no such attribute, so it is declared optional and those blocks offload
``self_attn`` alone. Its ``cross_attn_norm`` / ``cross_attn_norm_c`` (``Identity`` unless
``cross_attn_norm=True``) stay outside.

diffusers sets ``_supports_gradient_checkpointing = False``: its own ``enable_gradient_checkpointing()``
raises, and gradseam is the only checkpointing path.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker

_M = "diffusers.models.transformers.transformer_longcat_audio_dit"

# The Wav-VAE: 24 kHz audio, 2048 samples per latent frame (11.72 frames a second); the pipeline computes
# a duration's frames as int(seconds * 24000 // 2048).
SAMPLE_RATE = 24000
LATENT_HOP = 2048
# The pipeline's own reading rate for Chinese (0.21 s a character, the slower of its two), one UMT5
# token a character, plus the end-of-sequence token: the longest caption a clip of a given length has.
SECONDS_PER_CHARACTER = 0.21

# meituan-longcat/LongCat-AudioDiT-1B (the class defaults) and -3.5B, as diffusers' conversion script maps
# their config.json: every constructor argument spelled out. Both read UMT5-base captions (768 wide).
CONFIG_1B = {
    "dit_dim": 1536, "dit_depth": 24, "dit_heads": 24, "dit_text_dim": 768, "latent_dim": 64, "dropout": 0.0,
    "bias": True, "cross_attn": True, "adaln_type": "global", "adaln_use_text_cond": True, "long_skip": True,
    "text_conv": True, "qk_norm": True, "cross_attn_norm": False, "eps": 1e-6, "use_latent_condition": True,
    "ff_mult": 4.0,
}
CONFIG_3_5B = {**CONFIG_1B, "dit_dim": 2560, "dit_depth": 32, "dit_heads": 32, "ff_mult": 3.6}


def latent_frames(seconds: float) -> int:
    """Latent frames of ``seconds`` of audio, as ``LongCatAudioDiTPipeline`` computes them."""
    return int(seconds * SAMPLE_RATE // LATENT_HOP)


def caption_tokens(seconds: float) -> int:
    """UMT5 tokens of the longest caption a clip of ``seconds`` carries (see ``SECONDS_PER_CHARACTER``)."""
    return int(seconds / SECONDS_PER_CHARACTER) + 1


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, seconds: float = 30.0,
    text_tokens: int | None = None, prompt_fraction: float = 0.3,
) -> dict:
    """One real-size training batch as ``LongCatAudioDiTPipeline`` feeds the DiT: the noisy Wav-VAE latents
    ``(1, frames, latent_dim)`` (grad) with their all-valid frame mask, the UMT5 caption states
    ``(1, text_tokens, dit_text_dim)`` (default: as many as the clip's length allows, see
    ``caption_tokens``) with their mask, the flow time in ``[0, 1]``, and the latent condition: the voice
    prompt's clean latents over the first ``prompt_fraction`` of the frames and zeros where the model
    infills.

    ``tokens`` overrides the number of latent frames (the blocks' sequence length).
    """
    import torch

    cfg = model.config
    frames = tokens or latent_frames(seconds)
    text = text_tokens or caption_tokens(seconds)
    randn = tensor_maker(device, dtype)
    latent_cond = randn(1, frames, cfg.latent_dim)
    latent_cond[:, int(frames * prompt_fraction):] = 0
    return {
        "hidden_states": randn(1, frames, cfg.latent_dim, grad=True),
        "encoder_hidden_states": randn(1, text, cfg.dit_text_dim),
        "encoder_attention_mask": torch.ones(1, text, device=device, dtype=torch.bool),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "attention_mask": torch.ones(1, frames, device=device, dtype=torch.bool),
        "latent_cond": latent_cond,
    }


def _preset(size: str, config: dict, seconds: int) -> Preset:
    frames, text = latent_frames(seconds), caption_tokens(seconds)
    width, depth, heads = config["dit_dim"], config["dit_depth"], config["dit_heads"]
    return Preset(
        f"LongCat-AudioDiT-{size} ({depth} blocks, dim {width}, {heads} x {width // heads} heads, MLP "
        f"{int(width * config['ff_mult'])}, UMT5-base captions) at {seconds} s of 24 kHz speech ({frames} "
        f"latent frames at 11.72 Hz, {text} caption tokens)",
        config=config,
        inputs={"seconds": seconds, "text_tokens": text},
        make_inputs=make_inputs,
    )


LONGCAT_AUDIO = Family(
    name="longcat-audio",
    description="LongCat-AudioDiT text-to-speech DiT (LongCatAudioDiTTransformer)",
    models=(f"{_M}.LongCatAudioDiTTransformer",),
    block_lists=(BlockList("blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(
        BlockClass(f"{_M}.AudioDiTBlock", ffn=(("ffn",),), attention=("self_attn", "cross_attn"),
                   optional=("cross_attn",)),
    ),
    presets={
        # 30 s: the pipeline's longest clip for the 1B (max_wav_duration); the 3.5B's config allows 60 s
        "1b-30s": _preset("1B", CONFIG_1B, 30),
        "3.5b-30s": _preset("3.5B", CONFIG_3_5B, 30),
        "3.5b-60s": _preset("3.5B", CONFIG_3_5B, 60),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(LONGCAT_AUDIO)
