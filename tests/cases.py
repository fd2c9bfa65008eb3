"""Tiny, deterministic instances of every built-in family for the conformance kit (CPU, fp32)."""

from __future__ import annotations

import torch

from gradseam.testing import Case, randn


# -- Flux ---------------------------------------------------------------------------------------
def flux_model():
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=5, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=[2, 2, 4],
    )


def flux_inputs(g: torch.Generator, image: int = 16, text: int = 8) -> dict:
    return {
        "hidden_states": randn(g, 1, image, 4, grad=True),
        "encoder_hidden_states": randn(g, 1, text, 16, grad=True),
        "pooled_projections": randn(g, 1, 8),
        "timestep": torch.tensor([0.5]),
        "img_ids": randn(g, image, 3),
        "txt_ids": torch.zeros(text, 3),
    }


FLUX = Case("flux", flux_model, flux_inputs)



def tiny_flux_bench_family():
    """The installed flux family with one preset, ``tiny``: a real-model ``gradseam bench`` sweep on the CPU in seconds
    (the CLI's tests stand it in for the real-size preset)."""
    import dataclasses

    from gradseam.tools.checks import find_family

    family = find_family("flux")
    preset = dataclasses.replace(next(iter(family.presets.values())), config={
        "in_channels": 4, "num_layers": 2, "num_single_layers": 4, "attention_head_dim": 8,
        "num_attention_heads": 2, "joint_attention_dim": 16, "pooled_projection_dim": 8,
        "axes_dims_rope": [2, 2, 4]}, inputs={"image_tokens": 16, "text_tokens": 8})
    return dataclasses.replace(family, presets={"tiny": preset})

# -- Wan ----------------------------------------------------------------------------------------
def wan_model():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=5, rope_max_seq_len=32,
    )


def wan_inputs(g: torch.Generator, side: int = 4, text: int = 6) -> dict:
    # 2 frames x (side / 2)^2 patches: 8 tokens at the default side of 4
    return {
        "hidden_states": randn(g, 1, 4, 2, side, side, grad=True),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": randn(g, 1, text, 16, grad=True),
    }


def wan_ti2v_inputs(g: torch.Generator) -> dict:
    # Wan 2.2 TI2V: one timestep per token (2 frames x 2 x 2 patches = 8 tokens)
    x = wan_inputs(g)
    x["timestep"] = torch.arange(8).reshape(1, 8) * 100
    return x


WAN = Case("wan", wan_model, wan_inputs)
WAN_TI2V = Case("wan-ti2v", wan_model, wan_ti2v_inputs)

ALL = [FLUX, WAN]

# Named strategies the lifecycle and fault tests run every case through (offload ones under cpu_test_mode).
STRATEGIES = {
    "torch": {"gradient_checkpointing": True},
    "torch-ffn": {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"},
    "torch-interval2": {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2},
    "unsloth": {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"},
    "unsloth-ffn": {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-ffn"},
    "unsloth-interval2": {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth",
                          "gradient_checkpointing_interval": 2},
    "attention-offload": {"gradient_checkpointing_offload_attention": True},
}

# One representative case per built-in family: the offload and GPU matrices run over these.
from cases_image import CHROMA, KREA2, ZIMAGE  # noqa: E402
from cases_video import LTX2, MAGEFLOW  # noqa: E402

FAMILIES = [FLUX, WAN, CHROMA, KREA2, ZIMAGE, LTX2, MAGEFLOW]
