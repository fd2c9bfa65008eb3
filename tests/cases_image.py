"""Tiny, deterministic Chroma, Krea 2 and Z-Image models for the conformance kit (CPU, fp32)."""

from __future__ import annotations

import torch

from gradseam.testing import Case, randn

# -- Chroma -------------------------------------------------------------------------------------
CHROMA_IMAGE, CHROMA_TEXT = 16, 8


def chroma_model():
    from diffusers import ChromaTransformer2DModel

    return ChromaTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=5, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(2, 2, 4),
        approximator_num_channels=8, approximator_hidden_dim=16, approximator_layers=1,
    )


def chroma_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": randn(g, 1, CHROMA_IMAGE, 4, grad=True),
        "encoder_hidden_states": randn(g, 1, CHROMA_TEXT, 16, grad=True),
        "timestep": torch.tensor([0.5]),
        "img_ids": randn(g, CHROMA_IMAGE, 3),
        "txt_ids": torch.zeros(CHROMA_TEXT, 3),
    }


def chroma_mask() -> torch.Tensor:
    """The pipeline's layout: one entry per ``[text, image]`` token, the last text tokens padding."""
    mask = torch.ones(1, CHROMA_TEXT + CHROMA_IMAGE, dtype=torch.bool)
    mask[:, CHROMA_TEXT - 3 : CHROMA_TEXT] = False
    return mask


def chroma_masked_inputs(g: torch.Generator) -> dict:
    return {**chroma_inputs(g), "attention_mask": chroma_mask()}


CHROMA = Case("chroma", chroma_model, chroma_inputs)
CHROMA_MASKED = Case("chroma-masked", chroma_model, chroma_masked_inputs)


# -- Krea 2 -------------------------------------------------------------------------------------
KREA2_GRID, KREA2_TEXT = (4, 4), 6


def krea2_model():
    from diffusers import Krea2Transformer2DModel

    return Krea2Transformer2DModel(
        in_channels=4, num_layers=5, attention_head_dim=8, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, timestep_embed_dim=16, text_hidden_dim=16, num_text_layers=3,
        text_num_attention_heads=2, text_num_key_value_heads=1, text_intermediate_size=32,
        num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=(2, 2, 4),
    )


def krea2_inputs(g: torch.Generator) -> dict:
    h, w = KREA2_GRID
    grid = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), dim=-1).reshape(-1, 2)
    image_ids = torch.cat([torch.zeros(h * w, 1, dtype=torch.long), grid], dim=1)
    return {
        "hidden_states": randn(g, 1, h * w, 4, grad=True),
        "encoder_hidden_states": randn(g, 1, KREA2_TEXT, 3, 16, grad=True),
        "timestep": torch.tensor([0.7]),
        "position_ids": torch.cat([torch.zeros(KREA2_TEXT, 3, dtype=torch.long), image_ids]),
    }


def krea2_masked_inputs(g: torch.Generator) -> dict:
    mask = torch.ones(1, KREA2_TEXT, dtype=torch.bool)
    mask[:, -2:] = False
    return {**krea2_inputs(g), "encoder_attention_mask": mask}


KREA2 = Case("krea2", krea2_model, krea2_inputs)
KREA2_MASKED = Case("krea2-masked", krea2_model, krea2_masked_inputs)


# -- Z-Image ------------------------------------------------------------------------------------
# The model takes lists of per-sample tensors and pads every sequence to a multiple of 32 tokens.
# Gradients of list elements are not compared by the kit, but the embedders' parameter gradients
# (which are compared) are exactly what flows back into those inputs.
def zimage_model(siglip: bool = False):
    from diffusers import ZImageTransformer2DModel

    return ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=4, n_refiner_layers=2,
        n_heads=2, n_kv_heads=2, cap_feat_dim=16, siglip_feat_dim=8 if siglip else None,
        axes_dims=[4, 6, 6], axes_lens=[256, 16, 16],
    )


def _zimage_output(out) -> tuple[torch.Tensor, ...]:
    return tuple(out.sample)


def zimage_inputs(g: torch.Generator) -> dict:
    return {
        "x": [randn(g, 4, 1, 8, 8, grad=True)],
        "t": torch.tensor([0.3]),
        "cap_feats": [randn(g, 7, 16, grad=True)],
    }


def zimage_batch_inputs(g: torch.Generator) -> dict:
    # Different image sizes and caption lengths: every refiner and the main layers get a padding mask.
    return {
        "x": [randn(g, 4, 1, 8, 8, grad=True), randn(g, 4, 1, 12, 12, grad=True)],
        "t": torch.tensor([0.3, 0.8]),
        "cap_feats": [randn(g, 7, 16, grad=True), randn(g, 40, 16, grad=True)],
    }


def zimage_omni_inputs(g: torch.Generator) -> dict:
    # Omni mode: a clean reference image with SigLIP features, then the noisy target (no SigLIP);
    # blocks then use per-token modulation (noise_mask, adaln_noisy, adaln_clean).
    return {
        "x": [[randn(g, 4, 1, 8, 8, grad=True), randn(g, 4, 1, 8, 8, grad=True)]],
        "t": torch.tensor([0.4]),
        "cap_feats": [[randn(g, 5, 16, grad=True), randn(g, 6, 16, grad=True)]],
        "siglip_feats": [[randn(g, 4, 4, 8, grad=True), None]],
        "image_noise_mask": [[0, 1]],
    }


ZIMAGE = Case("zimage", zimage_model, zimage_inputs, output=_zimage_output)
ZIMAGE_BATCH = Case("zimage-batch", zimage_model, zimage_batch_inputs, output=_zimage_output)
ZIMAGE_OMNI = Case("zimage-omni", lambda: zimage_model(siglip=True), zimage_omni_inputs, output=_zimage_output)

ALL = [CHROMA, CHROMA_MASKED, KREA2, KREA2_MASKED, ZIMAGE, ZIMAGE_BATCH, ZIMAGE_OMNI]
