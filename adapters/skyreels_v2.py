"""SkyReels V2: text/image-to-video and diffusion forcing (SkyReelsV2Transformer3DModel).

A Wan-shaped trunk. One block list, ``blocks``, all ``SkyReelsV2TransformerBlock``, called
positionally as ``block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb,
causal_mask)`` and returning the new hidden states. Everything but ``hidden_states`` is built once
before the loop and is the same object for every block: the text states (with the CLIP image
tokens in front for I2V), the RoPE table, the block-causal frame mask (None unless
``num_frame_per_block > 1``, the asynchronous diffusion-forcing mode) and the timestep projection.
With diffusion forcing (``enable_diffusion_forcing=True``, one timestep per latent frame, the DF
checkpoints' training and sampling mode) that projection is expanded once to every token,
``(B, 6, tokens, D)``, and the optional fps embedding (``inject_sample_info``) is added to it, also
before the loop. Nothing is added between blocks, so ``Carry({"hidden_states": None})``.

FFN seam: ``ffn`` (diffusers' ``FeedForward``), called on exactly the modulated ``norm3`` output
(per token under diffusion forcing), gate and residual outside it. ``norm3`` cannot join (its output
is modulated first); everything before it is attention. Attention side: ``attn1`` (self-attention,
where the causal mask applies) and ``attn2`` (text, and the CLIP image tokens through the added K/V
projections in the I2V models).
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker, video_latent_size

_M = "diffusers.models.transformers.transformer_skyreels_v2"


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, frames: int = 97, height: int = 544,
    width: int = 960, text_tokens: int = 512,
) -> dict:
    """One diffusion-forcing training batch: the VAE latent video ``(1, 16, (frames-1)/4+1, H/8, W/8)``
    (grad) with its own noise level per latent frame (``timestep`` of shape ``(1, frames)``, spread over
    the schedule), ``enable_diffusion_forcing=True``, umT5 states and, for the checkpoints trained with
    sample info, the pipeline's fps flag (1: 24 fps).

    ``tokens`` overrides the video token count by changing the number of latent frames.
    """
    import torch

    cfg = model.config
    latent_frames, h, w = video_latent_size(frames, height, width, patch=tuple(cfg.patch_size), tokens=tokens)
    randn = tensor_maker(device, dtype)
    inputs = {
        "hidden_states": randn(1, cfg.in_channels, latent_frames, h, w, grad=True),
        "timestep": torch.linspace(999.0, 0.0, latent_frames, device=device, dtype=dtype)[None],
        "encoder_hidden_states": randn(1, text_tokens, cfg.text_dim),
        "enable_diffusion_forcing": True,
    }
    if cfg.inject_sample_info:
        inputs["fps"] = [1]
    return inputs


# diffusers' conversion configs of the released DF checkpoints; the class defaults (32 blocks, 16 x 128
# heads, FFN 8192) are none of them.
_DF_14B = {"num_attention_heads": 40, "num_layers": 40, "ffn_dim": 13824}
_DF_1_3B = {"num_attention_heads": 12, "num_layers": 30, "ffn_dim": 8960, "inject_sample_info": True}

SKYREELS_V2 = Family(
    name="skyreels-v2",
    description="SkyReels V2 text/image-to-video and diffusion forcing (SkyReelsV2Transformer3DModel)",
    models=(f"{_M}.SkyReelsV2Transformer3DModel",),
    block_lists=(BlockList("blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(BlockClass(f"{_M}.SkyReelsV2TransformerBlock", ffn=(("ffn",),), attention=("attn1", "attn2")),),
    presets={
        "df-14b-540p": Preset(
            "SkyReels-V2-DF-14B-540P (40 blocks, 40 x 128 heads, FFN 13824) at 544x960, 97 frames (25 x 34 x 60 "
            "= 51000 video tokens, one timestep per latent frame; 512 text tokens)",
            config=_DF_14B,
            inputs={"frames": 97, "height": 544, "width": 960},
            make_inputs=make_inputs,
        ),
        "df-14b-720p": Preset(
            "SkyReels-V2-DF-14B-720P (as 'df-14b-540p') at 720x1280, 121 frames (31 x 45 x 80 = 111600 video "
            "tokens; 512 text tokens)",
            config=_DF_14B,
            inputs={"frames": 121, "height": 720, "width": 1280},
            make_inputs=make_inputs,
        ),
        "df-1.3b-540p": Preset(
            "SkyReels-V2-DF-1.3B-540P (30 blocks, 12 x 128 heads, FFN 8960, fps embedding) at 544x960, 97 frames "
            "(51000 video tokens; 512 text tokens)",
            config=_DF_1_3B,
            inputs={"frames": 97, "height": 544, "width": 960},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(SKYREELS_V2)
