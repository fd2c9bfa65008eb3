"""The conformance kit, run from the plugin's own repository: exact parity for every strategy."""

import torch
from diffusers import PixArtTransformer2DModel

from gradseam.testing import Case, ConformanceSuite


def tiny_pixart():
    # 4 blocks: interval 2 with stride 4 forms a chunk and leaves blocks alone.
    return PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=4,
        cross_attention_dim=16, sample_size=8, patch_size=2, caption_channels=12, norm_num_groups=4,
    )


def inputs(g):
    return {
        "hidden_states": torch.randn(1, 4, 8, 8, generator=g).requires_grad_(True),
        "encoder_hidden_states": torch.randn(1, 6, 12, generator=g).requires_grad_(True),
        "timestep": torch.tensor([500]),
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
    }


def masked_inputs(g):
    # A padded prompt: the cross-attention mask reaches every block's attn2 through the chunks.
    return {**inputs(g), "encoder_attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]])}


class TestPixArt(ConformanceSuite):
    case = Case("pixart", tiny_pixart, inputs)


class TestPixArtMasked(ConformanceSuite):
    case = Case("pixart-masked", tiny_pixart, masked_inputs)
    configs = [{"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}]
    offload = [{"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth",
                "gradient_checkpointing_interval": 2}]
