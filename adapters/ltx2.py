"""LTX-2 audio-video (LTX2VideoTransformer3DModel; the LTX-2, 2.3 and 2.5 checkpoints share the class).

Every block is one ``LTX2VideoTransformerBlock`` carrying two streams side by side, video and
audio, and it returns ``(hidden_states, audio_hidden_states)``. The model calls it by keyword
(positionally only under its own checkpointing flag, which gradseam switches off); all the other
arguments (text states, the timestep and cross-modal modulation tensors, RoPE, masks) are the
same object for every block, so a chunk only has to carry the two streams. The exception is
spatio-temporal guidance, which hands the selected blocks their own perturbation mask: a chunk
that meets such a block sees the arguments differ and falls back to per-block regions, exactly.

Each stream ends in its own ``FeedForward`` (``ff``, ``audio_ff``), called on exactly the
modulated ``norm3`` output, with the gate and residual applied to its return value outside it;
each is therefore a seam of its own, and recomputing it drops the 4·d-wide GELU activations of
that stream. No wider cut is safe: everything before the FFNs is attention, and the cross-modal
attentions read both streams, so a seam spanning more would recompute attention.

The attention side is all six attentions: self (``attn1``, ``audio_attn1``), text cross
(``attn2``, ``audio_attn2``) and the two cross-modal ones.
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker

_M = "diffusers.models.transformers.transformer_ltx2"


def make_inputs(
    model, device, dtype, tokens=None, *, frames=121, height=512, width=768, fps=24, text_tokens=1024
) -> dict:
    """One real-size batch: packed video and audio latents (both grad), caption states for both streams.

    Video latents are ``(frames-1)/8+1`` frames of ``H/32 x W/32``; audio gets one latent per
    ``hop_length x audio_scale_factor`` samples of the clip's duration. ``tokens`` overrides the
    video token count by changing the number of latent frames (the audio stays the preset's).
    """
    import torch

    cfg = model.config
    st, sh, sw = cfg.vae_scale_factors
    h, w = height // sh, width // sw
    latent_frames = (frames - 1) // st + 1
    if tokens:
        latent_frames = max(1, round(tokens / (h * w)))
    audio = round(frames / fps * cfg.audio_sampling_rate / cfg.audio_hop_length / cfg.audio_scale_factor)

    randn = tensor_maker(device, dtype)

    return {
        "hidden_states": randn(1, latent_frames * h * w, cfg.in_channels, grad=True),
        "audio_hidden_states": randn(1, audio, cfg.audio_in_channels, grad=True),
        "encoder_hidden_states": randn(1, text_tokens, cfg.caption_channels),
        "audio_encoder_hidden_states": randn(1, text_tokens, cfg.caption_channels),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "num_frames": latent_frames,
        "height": h,
        "width": w,
        "fps": float(fps),
        "audio_num_frames": audio,
    }

LTX2 = Family(
    name="ltx2",
    description="LTX-2 / LTX-2.3 joint audio-video generation (LTX2VideoTransformer3DModel)",
    models=(f"{_M}.LTX2VideoTransformer3DModel",),
    block_lists=(
        BlockList("transformer_blocks", carry=Carry({"hidden_states": 0, "audio_hidden_states": 1})),
    ),
    block_classes=(
        BlockClass(
            f"{_M}.LTX2VideoTransformerBlock",
            ffn=(("ff",), ("audio_ff",)),
            attention=(
                "attn1",
                "audio_attn1",
                "attn2",
                "audio_attn2",
                "audio_to_video_attn",
                "video_to_audio_attn",
            ),
        ),
    ),
    presets={
        "19b-768x512": Preset(
            "LTX-2 trunk (48 blocks; video 32 x 128 heads, audio 32 x 64 heads) at 768x512, 121 frames "
            "at 24 fps (6144 video + 126 audio tokens, 1024 text tokens)",
            config={},  # the class defaults are the flagship config
            inputs={"frames": 121, "height": 512, "width": 768, "fps": 24, "text_tokens": 1024},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(LTX2)
