"""Wan 2.1 / 2.2 (WanTransformer3DModel).

Every block is one ``WanTransformerBlock``: self-attention ``attn1``, cross-attention ``attn2``,
then ``ffn`` (diffusers' ``FeedForward``). The block returns the new hidden states and is called
positionally as ``block(hidden_states, encoder_hidden_states, temb, rotary_emb)``; the same
wrapper serves the 2.1 / 2.2-A14B path (``temb`` of shape ``(B, 6, D)``) and the 2.2 TI2V path
with a timestep per token (``(B, L, 6, D)``), since gradseam passes arguments through untouched.
Wan 2.2 pipelines carry two transformers (``transformer``, ``transformer_2``); patching the
pipeline patches both.
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import video_latent_size

_M = "diffusers.models.transformers.transformer_wan"


def make_inputs(model, device, dtype, tokens=None, *, frames=81, height=480, width=832, text_tokens=512) -> dict:
    """One real-size batch: a VAE latent video ``(1, C, (frames-1)/4+1, H/8, W/8)`` (grad) and T5 states.

    ``tokens`` overrides the video token count by changing the number of latent frames.
    """
    import torch

    cfg = model.config
    latent_frames, h, w = video_latent_size(frames, height, width, patch=tuple(cfg.patch_size), tokens=tokens)
    return {
        "hidden_states": torch.randn(
            1, cfg.in_channels, latent_frames, h, w, device=device, dtype=dtype, requires_grad=True
        ),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "encoder_hidden_states": torch.randn(1, text_tokens, cfg.text_dim, device=device, dtype=dtype),
    }

WAN = Family(
    name="wan",
    description="Wan 2.1 / 2.2 text/image-to-video (WanTransformer3DModel)",
    models=(f"{_M}.WanTransformer3DModel",),
    block_lists=(BlockList("blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(BlockClass(f"{_M}.WanTransformerBlock", ffn=(("ffn",),), attention=("attn1", "attn2")),),
    presets={
        "14b-480p": Preset(
            "Wan 2.1 14B (40 blocks, 40 x 128 heads, FFN 13824) at 480x832, 81 frames",
            config={"num_layers": 40, "num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824},
            inputs={"frames": 81, "height": 480, "width": 832},
            make_inputs=make_inputs,
        ),
        "1.3b-480p": Preset(
            "Wan 2.1 1.3B (30 blocks, 12 x 128 heads, FFN 8960) at 480x832, 81 frames",
            config={"num_layers": 30, "num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 8960},
            inputs={"frames": 81, "height": 480, "width": 832},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(WAN)
