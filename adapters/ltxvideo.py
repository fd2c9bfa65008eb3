"""LTX-Video 0.9 (LTXVideoTransformer3DModel; the 0.9 to 0.9.8 checkpoints share the class).

Every block is one ``LTXVideoTransformerBlock``: modulated self-attention ``attn1`` (RoPE),
unmodulated cross-attention ``attn2`` on the projected T5 states, then ``ff`` (diffusers'
``FeedForward``). The block returns the new hidden states. The model calls it by keyword
(positionally only under its own checkpointing flag, which gradseam switches off) with
``encoder_hidden_states``, ``temb``, ``image_rotary_emb`` and ``encoder_attention_mask``, all
computed once before the loop (the 2-D text mask is turned into an additive bias there, once) and
passed unchanged to every block; nothing is added between blocks. So a chunk only carries
``hidden_states``: ``Carry({"hidden_states": None})``. This holds as well for the conditioning
pipelines' per-token timesteps (``temb`` of shape ``(B, L, 6·D)``) and explicit ``video_coords``:
they change what is built before the loop, not what the loop passes.

``ff`` is called on exactly ``norm2(hidden_states) * (1 + scale_mlp) + shift_mlp``, with the gate
and residual applied to its return value outside it; it is the seam, and recomputing it drops the
4·d-wide GELU activations. ``norm2`` cannot join (its output is modulated before ``ff`` sees it),
and everything before it is attention. The attention side is ``attn1`` and ``attn2``.
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl

_M = "diffusers.models.transformers.transformer_ltx"


def make_inputs(
    model, device, dtype, tokens=None, *, frames=161, height=512, width=704, frame_rate=25, text_tokens=128
) -> dict:
    """One real-size batch: packed video latents ``(1, F' * H/32 * W/32, 128)`` (grad) with
    ``F' = (frames-1)/8+1``, and T5-XXL caption states with their mask, as the LTX pipeline builds them
    (128 text tokens, RoPE interpolation scale ``(8 / frame_rate, 32, 32)``).

    ``tokens`` overrides the video token count by changing the number of latent frames.
    """
    import torch

    cfg = model.config
    h, w = height // 32 // cfg.patch_size, width // 32 // cfg.patch_size
    latent_frames = ((frames - 1) // 8 + 1) // cfg.patch_size_t
    if tokens:
        latent_frames = max(1, round(tokens / (h * w)))
    return {
        "hidden_states": torch.randn(
            1, latent_frames * h * w, cfg.in_channels, device=device, dtype=dtype, requires_grad=True
        ),
        "encoder_hidden_states": torch.randn(1, text_tokens, cfg.caption_channels, device=device, dtype=dtype),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "encoder_attention_mask": torch.ones(1, text_tokens, device=device, dtype=torch.int64),
        "num_frames": latent_frames,
        "height": h,
        "width": w,
        "rope_interpolation_scale": (8 / frame_rate, 32, 32),
    }


LTXVIDEO = Family(
    name="ltxvideo",
    description="LTX-Video 0.9 text/image-to-video (LTXVideoTransformer3DModel)",
    models=(f"{_M}.LTXVideoTransformer3DModel",),
    block_lists=(BlockList("transformer_blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(BlockClass(f"{_M}.LTXVideoTransformerBlock", ffn=(("ff",),), attention=("attn1", "attn2")),),
    presets={
        "2b-704x512": Preset(
            "LTX-Video 0.9 2B (28 blocks, 32 x 64 heads, FFN 8192) at 704x512, 161 frames "
            "(21 x 16 x 22 = 7392 video tokens, 128 text tokens)",
            config={},  # the class defaults are the published 2B transformer
            inputs={"frames": 161, "height": 512, "width": 704},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(LTXVIDEO)
