"""The conformance kit, run from the plugin's own repository: exact parity for every strategy."""

import torch
from diffusers import SD3Transformer2DModel

from gradseam.testing import Case, ConformanceSuite


def tiny_sd3():
    # 4 blocks: block 3 is the context_pre_only one and closes a chunk at interval 2;
    # block 0 has SD3.5's dual attention, and qk-norm is on as in SD3.5.
    return SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=4, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8,
        pos_embed_max_size=8, dual_attention_layers=(0,), qk_norm="rms_norm",
    )


def inputs(g):
    return {
        "hidden_states": torch.randn(1, 4, 8, 8, generator=g).requires_grad_(True),
        "encoder_hidden_states": torch.randn(1, 6, 16, generator=g).requires_grad_(True),
        "pooled_projections": torch.randn(1, 8, generator=g),
        "timestep": torch.tensor([500]),
    }


def controlnet_inputs(g):
    # ControlNet residuals are added between blocks in the model's loop: chunks fall back, exactly.
    return {**inputs(g), "block_controlnet_hidden_states": [torch.randn(1, 16, 16, generator=g)] * 2}


class TestSD3(ConformanceSuite):
    case = Case("sd3", tiny_sd3, inputs)


class TestSD3ControlNet(ConformanceSuite):
    case = Case("sd3-controlnet", tiny_sd3, controlnet_inputs)
    whole_regions = False  # the residuals make chunks compute block by block on purpose
    configs = [{"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}]
    offload = [{"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth",
                "gradient_checkpointing_interval": 2}]
