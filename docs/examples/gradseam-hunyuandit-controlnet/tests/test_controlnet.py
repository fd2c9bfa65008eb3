"""The conformance kit, run from the plugin's own repository: exact parity for every strategy."""

import torch
from diffusers import HunyuanDiT2DControlNetModel
from diffusers.models.embeddings import get_2d_rotary_pos_embed

from gradseam.testing import Case, ConformanceSuite, check_bench_workload

# 2 heads x 8 = 16 wide; transformer_num_layers=10 builds 10 // 2 - 1 = 4 blocks, so interval 2 with
# stride 4 forms a chunk and leaves blocks alone. Text lengths are fixed by the config (3 CLIP, 4 mT5).
TINY = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, patch_size=2, sample_size=4,
            hidden_size=16, transformer_num_layers=10, cross_attention_dim=8, cross_attention_dim_t5=16,
            pooled_projection_dim=8, text_len=3, text_len_t5=4, use_style_cond_and_image_meta_size=False)


def tiny_controlnet():
    return HunyuanDiT2DControlNetModel(**TINY)


def inputs(g):
    clip, t5 = torch.ones(1, 3, dtype=torch.int64), torch.ones(1, 4, dtype=torch.int64)
    clip[0, -1:], t5[0, -2:] = 0, 0  # padded prompts: the padding embedding replaces those tokens
    return {
        "hidden_states": torch.randn(1, 4, 4, 4, generator=g).requires_grad_(True),
        "timestep": torch.tensor([500.0]),
        "controlnet_cond": torch.randn(1, 4, 4, 4, generator=g).requires_grad_(True),
        "conditioning_scale": 0.7,
        "encoder_hidden_states": torch.randn(1, 3, 8, generator=g).requires_grad_(True),
        "text_embedding_mask": clip,
        "encoder_hidden_states_t5": torch.randn(1, 4, 16, generator=g).requires_grad_(True),
        "text_embedding_mask_t5": t5,
        "image_rotary_emb": get_2d_rotary_pos_embed(8, ((0, 0), (2, 2)), (2, 2), output_type="pt"),
    }


def v11_inputs(g):
    # v1.1 ControlNets: the size condition [H, W, target H, W, crop top, left] and a style id
    return {**inputs(g), "image_meta_size": torch.tensor([[32.0, 32.0, 32.0, 32.0, 0.0, 0.0]]),
            "style": torch.zeros(1, dtype=torch.int64)}


def samples(out):
    return tuple(out.controlnet_block_samples)  # one residual per block, for the frozen Hunyuan-DiT


class TestControlNet(ConformanceSuite):
    case = Case("hunyuandit-controlnet", tiny_controlnet, inputs, output=samples)


class TestControlNetV11(ConformanceSuite):
    case = Case("hunyuandit-controlnet-v11",
                lambda: HunyuanDiT2DControlNetModel(**{**TINY, "use_style_cond_and_image_meta_size": True}),
                v11_inputs, output=samples)
    reduced = True  # one row per mechanism: only the conditioning differs from the suite above
    quantized_bases = ("torchao-int8",)


def test_bench_runs_the_preset_input_builder():
    check_bench_workload("hunyuandit-controlnet", TINY, {"height": 32, "width": 32}, sequence=4)
