"""FramePack (HunyuanVideoFramepackTransformer3DModel) through the conformance kit, plus its presets.

The batch-1 case is the pipeline's (no attention mask: the model trims the prompt to its valid
tokens instead) and runs the kit's whole matrix. A batch of two with a padded prompt (the model then
builds a mask over the joint sequence) runs a reduced matrix. Both carry the FramePack history the
released checkpoints take: the clean start and 1x frames, 2x and 4x downsampled history, each with
its frame indices. Then: the chunks run whole, the history and image inputs reach the output, and
the presets build on the meta device, plan at full size and give the token counts they describe.
"""

from __future__ import annotations

import pytest
import torch
from family_checks import blocks_per_list, chunks_served_whole

import gradseam
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_strategy,
    randn,
)

CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}

# Patch 2 (the history embedders' 1x kernel is fixed at (1, 2, 2), so the trunk's must match); head
# width 8 split 2 + 2 + 4 for RoPE; 3 dual-stream, 4 single-stream and 2 refiner blocks.
_TINY = {
    "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 3,
    "num_single_layers": 4, "num_refiner_layers": 2, "text_embed_dim": 12, "pooled_projection_dim": 8,
    "rope_axes_dim": (2, 2, 4), "has_image_proj": True, "image_proj_dim": 8, "has_clean_x_embedder": True,
}
LISTS = ("context_embedder.token_refiner.refiner_blocks", "transformer_blocks", "single_transformer_blocks")


def framepack_model():
    from diffusers import HunyuanVideoFramepackTransformer3DModel

    return HunyuanVideoFramepackTransformer3DModel(**_TINY)


def framepack_inputs(g: torch.Generator, batch: int = 1) -> dict:
    # a section of 2 latent frames of 4 x 4 (2 x 2 tokens each) behind the released history layout:
    # [start | 16 frames at 4x | 2 at 2x | 1 at 1x | section]; 6 prompt tokens (the last one padding)
    # and 3 SigLIP tokens
    indices = torch.arange(1 + 16 + 2 + 1 + 2)
    prefix, history_4x, history_2x, history_1x, section = indices.split([1, 16, 2, 1, 2])
    mask = torch.ones(batch, 6, dtype=torch.int64)
    mask[:, -1] = 0
    return {
        "hidden_states": randn(g, batch, 4, 2, 4, 4, grad=True),
        "timestep": torch.tensor([500.0] * batch),
        "encoder_hidden_states": randn(g, batch, 6, 12, grad=True),
        "encoder_attention_mask": mask,
        "pooled_projections": randn(g, batch, 8),
        "image_embeds": randn(g, batch, 3, 8, grad=True),
        "indices_latents": section,
        "guidance": torch.tensor([10000.0] * batch),
        "latents_clean": randn(g, batch, 4, 2, 4, 4, grad=True),
        "indices_latents_clean": torch.cat([prefix, history_1x]),
        "latents_history_2x": randn(g, batch, 4, 2, 4, 4, grad=True),
        "indices_latents_history_2x": history_2x,
        "latents_history_4x": randn(g, batch, 4, 16, 4, 4, grad=True),
        "indices_latents_history_4x": history_4x,
    }


def framepack_batch_inputs(g: torch.Generator) -> dict:
    # two samples, the second prompt two tokens shorter: the model masks the joint sequence instead
    inputs = framepack_inputs(g, batch=2)
    inputs["encoder_attention_mask"][1, 3:] = 0
    inputs["timestep"] = torch.tensor([500.0, 200.0])
    return inputs


FRAMEPACK = Case("hunyuanvideo-framepack", framepack_model, framepack_inputs)
FRAMEPACK_BATCH = Case("hunyuanvideo-framepack-batch", framepack_model, framepack_batch_inputs)


class TestFramePack(ConformanceSuite):
    case = FRAMEPACK


class TestFramePackBatch(ConformanceSuite):
    case = FRAMEPACK_BATCH
    reduced = True


# -- the chunks chain, the inputs matter --------------------------------------------------------


@pytest.mark.parametrize("case", [FRAMEPACK, FRAMEPACK_BATCH], ids=lambda c: c.name)
def test_every_chunk_of_every_list_runs_whole(case: Case) -> None:
    assert chunks_served_whole(case, CHUNKED) == {
        "refiner_blocks[0, 1]": True, "transformer_blocks[0, 1]": True,
        "single_transformer_blocks[0, 1]": True, "single_transformer_blocks[2, 3]": True,
    }


def test_history_and_image_inputs_reach_the_section() -> None:
    # The history tokens and SigLIP states only enter through attention in the trunk: each must get a
    # gradient through the chunked blocks, and changing them must change the section's output.
    report = check_strategy(FRAMEPACK, CHUNKED, whole=True)
    for name in ("latents_clean", "latents_history_2x", "latents_history_4x", "image_embeds"):
        assert report.patched.input_grads[name].abs().sum() > 0, name
    torch.manual_seed(0)
    model = framepack_model()
    inputs = framepack_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(**inputs)[0]
        inputs["latents_history_4x"] = torch.zeros_like(inputs["latents_history_4x"])
        assert not torch.equal(plain, model(**inputs)[0])


def test_regions() -> None:
    torch.manual_seed(0)
    model = framepack_model()
    family = family_for(model)
    assert family.name == "hunyuanvideo-framepack"
    ffn = plan(model, family, gradseam.CheckpointConfig.coerce(
        gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn"))
    assert [r.seam for r in ffn.regions if r.blocks == (0,)] == [
        ("norm2", "ff"), ("ff",), ("ff_context",), ("proj_mlp", "act_mlp")
    ]


# -- presets at full size -----------------------------------------------------------------------


def _meta_model(preset):
    from diffusers import HunyuanVideoFramepackTransformer3DModel

    with torch.device("meta"):
        return HunyuanVideoFramepackTransformer3DModel(**preset.config)


@pytest.mark.parametrize("name", ["13b-480p", "13b-720p"])
def test_presets_plan_at_full_size(name: str) -> None:
    family = gradseam.registry.REGISTRY.get("hunyuanvideo-framepack")
    assert set(family.presets) == {"13b-480p", "13b-720p"}
    model = _meta_model(family.presets[name])
    assert family_for(model) is family
    expected = {LISTS[0]: 2, LISTS[1]: 20, LISTS[2]: 40}
    for config, regions in (({"gradient_checkpointing": True}, 62), (CHUNKED, 31),
                            ({"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}, 82)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert blocks_per_list(the_plan.regions) == expected
        assert len(the_plan.regions) == regions


@pytest.mark.parametrize(("name", "tokens"), [("13b-480p", (14040, 3120, 390, 416)),
                                              ("13b-720p", (32400, 7200, 920, 960))])
def test_preset_token_counts(name: str, tokens: tuple[int, ...]) -> None:
    # the counts the descriptions give, from the model's own patch embedders (on the meta device)
    family = gradseam.registry.REGISTRY.get("hunyuanvideo-framepack")
    preset = family.presets[name]
    model = _meta_model(preset)
    x = preset.make_inputs(model, "meta", torch.float32, **preset.inputs)
    assert x["hidden_states"].requires_grad and x["image_embeds"].shape == (1, 729, 1152)
    section = model.x_embedder(x["hidden_states"]).shape[1]
    clean, x2, x4 = model.clean_x_embedder(x["latents_clean"], x["latents_history_2x"], x["latents_history_4x"])
    assert (section, clean.shape[1], x2.shape[1], x4.shape[1]) == tokens
    assert len(x["indices_latents"]) == x["hidden_states"].shape[2] == 9
    more = preset.make_inputs(model, "meta", torch.bfloat16, 2 * tokens[0] // 9, **preset.inputs)
    assert more["hidden_states"].shape[2] == 2 and len(more["indices_latents"]) == 2


def test_preset_input_builder_runs_the_model() -> None:
    family = gradseam.registry.REGISTRY.get("hunyuanvideo-framepack")
    torch.manual_seed(0)
    model = framepack_model()
    inputs = family.presets["13b-480p"].make_inputs(model, "cpu", torch.float32, window=2, height=32, width=32,
                                                    text_tokens=5, image_tokens=3)
    out = model(**inputs, return_dict=False)[0]
    assert out.shape == (1, 4, 2, 4, 4)
    out.square().mean().backward()
    assert inputs["hidden_states"].grad is not None
