"""Tiny, deterministic LTX-2 and MageFlow instances for the conformance kit (CPU, fp32).

LTX-2's variants exist because each sends the blocks something the plain case does not: padding
masks and a separate audio timestep, per-block perturbation masks (spatio-temporal guidance,
which breaks the "every other argument is the same" rule chunks rely on), and the LTX-2.3 layout
(gated attention, prompt modulation from sigma, split RoPE, no caption projection).
"""

from __future__ import annotations

import torch

from gradseam.testing import Case, randn

# -- LTX-2 --------------------------------------------------------------------------------------
# Cross-attention widths must equal the stream widths: the text projections map captions to the
# stream width, and the audio-video cross attentions use the audio width for their RoPE.
_LTX2_TINY = {
    "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8,
    "cross_attention_dim": 16, "audio_in_channels": 4, "audio_out_channels": 4,
    "audio_num_attention_heads": 2, "audio_attention_head_dim": 4, "audio_cross_attention_dim": 8,
    "num_layers": 5, "caption_channels": 12,
}
# 2 latent frames x 2 x 2 video tokens, 5 audio tokens, 6 text tokens
_VIDEO = {"num_frames": 2, "height": 2, "width": 2, "audio_num_frames": 5}


def _ltx2_model(**overrides):
    def build():
        from diffusers import LTX2VideoTransformer3DModel

        return LTX2VideoTransformer3DModel(**{**_LTX2_TINY, **overrides})

    return build


def ltx2_inputs(g: torch.Generator, batch: int = 1, text_dim: int = 12, audio_text_dim: int = 12) -> dict:
    return {
        "hidden_states": randn(g, batch, 8, 4, grad=True),
        "audio_hidden_states": randn(g, batch, 5, 4, grad=True),
        "encoder_hidden_states": randn(g, batch, 6, text_dim, grad=True),
        "audio_encoder_hidden_states": randn(g, batch, 6, audio_text_dim, grad=True),
        "timestep": torch.full((batch,), 500.0),
        **_VIDEO,
    }


def ltx2_masked_inputs(g: torch.Generator) -> dict:
    x = ltx2_inputs(g, batch=2)
    text_mask = torch.ones(2, 6)
    text_mask[1, 4:] = 0  # the second prompt is padded
    x["encoder_attention_mask"] = text_mask
    x["audio_encoder_attention_mask"] = text_mask.clone()
    x["audio_timestep"] = torch.tensor([250.0, 750.0])
    self_mask = torch.ones(2, 8, 8)
    self_mask[0, :, 6:] = 0.5  # IC-LoRA style: weaker attention to trailing reference tokens
    x["video_self_attention_mask"] = self_mask
    return x


def ltx2_stg_inputs(g: torch.Generator) -> dict:
    x = ltx2_inputs(g, batch=2)
    x["spatio_temporal_guidance_blocks"] = [1, 2]
    x["perturbation_mask"] = torch.tensor([1.0, 0.0])  # perturb the second sample only
    return x


def ltx23_inputs(g: torch.Generator) -> dict:
    # LTX-2.3 drops the caption projection: text arrives at the stream widths.
    x = ltx2_inputs(g, text_dim=16, audio_text_dim=8)
    x["sigma"] = torch.tensor([0.5])
    x["audio_sigma"] = torch.tensor([0.25])
    x["use_cross_timestep"] = True
    return x


def _both_streams(out):
    return out.sample, out.audio_sample


LTX2 = Case("ltx2", _ltx2_model(), ltx2_inputs, output=_both_streams)
LTX2_MASKED = Case("ltx2-masked", _ltx2_model(), ltx2_masked_inputs, output=_both_streams)
LTX2_STG = Case("ltx2-stg", _ltx2_model(perturbed_attn=True), ltx2_stg_inputs, output=_both_streams)
LTX23 = Case(
    "ltx2.3",
    _ltx2_model(
        gated_attn=True, audio_gated_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True,
        use_prompt_embeddings=False, rope_type="split",
    ),
    ltx23_inputs,
    output=_both_streams,
)


# -- MageFlow (reference model: the class is not in a diffusers release yet) --------------------
# Upstream's constructor arguments. Head width 8 with rotary widths 2 + 2 + 2: the last two channels
# of each head stay unrotated, as they may upstream.
MAGEFLOW_TINY = {
    "in_channels": 4, "out_channels": 4, "context_in_dim": 12, "hidden_size": 16, "num_attention_heads": 2,
    "num_layers": 5, "axes_dim": (2, 2, 2),
}


def mageflow_class() -> type:
    """diffusers' class once a release exports it, else the from-scratch reference of the same signature:
    the day the class ships, every MageFlow test runs against it unchanged."""
    import diffusers

    found = getattr(diffusers, "MageFlowTransformer2DModel", None)
    if found is None:
        from mageflow_reference import MageFlowTransformer2DModel as found
    return found


def mageflow_model():
    return mageflow_class()(**MAGEFLOW_TINY)


def mageflow_img_ids(rows: int, cols: int) -> torch.Tensor:
    """(frame, row, column) of each image token of one frame, as upstream's ``img_ids``."""
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([torch.zeros_like(r), r, c], dim=-1).reshape(-1, 3)


def mageflow_inputs(g: torch.Generator, batch: int = 1) -> dict:
    # a 4 x 4 grid of patch-1 latent tokens, 6 text tokens
    return {
        "hidden_states": randn(g, batch, 16, 4, grad=True),
        "encoder_hidden_states": randn(g, batch, 6, 12, grad=True),
        "timestep": torch.full((batch,), 0.5),
        "img_ids": mageflow_img_ids(4, 4),
    }


def mageflow_batch_inputs(g: torch.Generator) -> dict:
    x = mageflow_inputs(g, batch=2)
    x["timestep"] = torch.tensor([0.2, 0.9])
    return x


MAGEFLOW = Case("mageflow", mageflow_model, mageflow_inputs)
MAGEFLOW_BATCH = Case("mageflow-batch", mageflow_model, mageflow_batch_inputs)

ALL = [LTX2, LTX2_MASKED, LTX2_STG, LTX23, MAGEFLOW, MAGEFLOW_BATCH]
