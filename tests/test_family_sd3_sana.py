"""SD3 / SD3.5, Sana and SANA-Video: the conformance kit's whole matrix on tiny models, reduced
matrices for their optional inputs (SD3.5's dual attention and qk-norm, ControlNet residuals,
prompt masks, per-token image-to-video timesteps), and the presets at full size on the meta device."""

from __future__ import annotations

import pytest
import torch

import gradseam
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    assert_same_step,
    randn,
    reduced_configs,
    reduced_offload_configs,
    run_step,
)

ON = {"gradient_checkpointing": True}
CHUNKS = {**ON, "gradient_checkpointing_interval": 2}


# -- SD3 / SD3.5 --------------------------------------------------------------------------------
def sd3_model(**extra):
    from diffusers import SD3Transformer2DModel

    # 4 blocks: block 3 is the context_pre_only one (no ff_context) and closes a chunk at interval 2.
    return SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=4, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8,
        pos_embed_max_size=8, **extra,
    )


def sd35_model():
    # SD3.5: dual attention (attn2) in blocks 0 and 1 only, RMS qk-norm everywhere.
    return sd3_model(dual_attention_layers=(0, 1), qk_norm="rms_norm")


def sd3_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": randn(g, 1, 4, 8, 8, grad=True),
        "encoder_hidden_states": randn(g, 1, 6, 16, grad=True),
        "pooled_projections": randn(g, 1, 8),
        "timestep": torch.tensor([500]),
    }


def sd3_controlnet_inputs(g: torch.Generator) -> dict:
    # ControlNet residuals are added between blocks in the model's loop: chunks fall back, exactly.
    return {**sd3_inputs(g), "block_controlnet_hidden_states": [randn(g, 1, 16, 16), randn(g, 1, 16, 16)]}


SD3 = Case("sd3", sd3_model, sd3_inputs)
SD35 = Case("sd3.5", sd35_model, sd3_inputs)
SD3_CONTROLNET = Case("sd3-controlnet", sd3_model, sd3_controlnet_inputs)


class TestSD3(ConformanceSuite):
    case = SD3


class TestSD35DualAttention(ConformanceSuite):
    case = SD35
    reduced = True


class TestSD3ControlNet(ConformanceSuite):
    case = SD3_CONTROLNET
    whole_regions = False  # the residuals make chunks compute block by block on purpose
    configs = reduced_configs(ffn=False, kept=False)  # chunks, where the residuals meet them
    offload = reduced_offload_configs(ffn=False, attention=False)


# -- Sana ---------------------------------------------------------------------------------------
def sana_model(**extra):
    from diffusers import SanaTransformer2DModel

    return SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=4,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=12,
        sample_size=8, patch_size=1, **extra,
    )


def sana_sprint_model():
    # Sana 1.5 / Sprint options: RMS qk-norm and an embedded guidance scale.
    return sana_model(qk_norm="rms_norm_across_heads", guidance_embeds=True)


def sana_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": randn(g, 1, 4, 4, 4, grad=True),
        "encoder_hidden_states": randn(g, 1, 6, 12, grad=True),
        "timestep": torch.tensor([500]),
    }


def sana_masked_inputs(g: torch.Generator) -> dict:
    # A padded prompt: the model turns the 0/1 mask into a bias that every block's attn2 gets.
    return {**sana_inputs(g), "encoder_attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]])}


def sana_sprint_inputs(g: torch.Generator) -> dict:
    return {**sana_masked_inputs(g), "guidance": torch.tensor([4.5])}


SANA = Case("sana", sana_model, sana_inputs)
SANA_MASKED = Case("sana-masked", sana_model, sana_masked_inputs)
SANA_SPRINT = Case("sana-sprint", sana_sprint_model, sana_sprint_inputs)


class TestSana(ConformanceSuite):
    case = SANA


class TestSanaMasked(ConformanceSuite):
    case = SANA_MASKED
    reduced = True


class TestSanaSprint(ConformanceSuite):
    case = SANA_SPRINT
    reduced = True


# -- SANA-Video ---------------------------------------------------------------------------------
def sana_video_model():
    from diffusers import SanaVideoTransformer3DModel

    return SanaVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=4,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=12,
        sample_size=8, patch_size=(1, 2, 2), rope_max_seq_len=32,
    )


def sana_video_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": randn(g, 1, 4, 3, 4, 4, grad=True),
        "encoder_hidden_states": randn(g, 1, 6, 12, grad=True),
        "timestep": torch.tensor([500]),
        "encoder_attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]]),
    }


def sana_video_i2v_inputs(g: torch.Generator) -> dict:
    # Image-to-video, as SanaVideoImageToVideoPipeline calls it: one timestep per token,
    # (batch, 1, frames, h, w), 0 on the conditioning first frame.
    conditioning = torch.zeros(1, 1, 3, 2, 2)
    conditioning[:, :, 0] = 1.0
    return {**sana_video_inputs(g), "timestep": 500 * (1 - conditioning)}


SANA_VIDEO = Case("sana-video", sana_video_model, sana_video_inputs)
SANA_VIDEO_I2V = Case("sana-video-i2v", sana_video_model, sana_video_i2v_inputs)


class TestSanaVideo(ConformanceSuite):
    case = SANA_VIDEO


class TestSanaVideoPerTokenTimesteps(ConformanceSuite):
    case = SANA_VIDEO_I2V
    reduced = True


# -- The optional inputs really reach the blocks ------------------------------------------------


def _output(model: torch.nn.Module, case: Case) -> torch.Tensor:
    with torch.no_grad():
        return case.output(model(**case.inputs(torch.Generator().manual_seed(1))))


@pytest.mark.parametrize(
    ("variant", "plain"),
    [(SD3_CONTROLNET, SD3), (SANA_MASKED, SANA), (SANA_VIDEO_I2V, SANA_VIDEO)],
    ids=["sd3-controlnet", "sana-mask", "sana-video-i2v"],
)
def test_variant_cases_change_the_output(variant: Case, plain: Case) -> None:
    # Otherwise the variant's parity runs would prove nothing about that input reaching the blocks.
    model = variant.fresh()
    assert not torch.equal(_output(model, variant), _output(model, plain))


def test_sd35_case_has_dual_attention_in_some_blocks_only() -> None:
    model = SD35.fresh()
    assert [b.attn2 is not None for b in model.transformer_blocks] == [True, True, False, False]
    assert [b.ff_context is not None for b in model.transformer_blocks] == [True, True, True, False]


def test_sd3_optional_seams_are_skipped_only_where_absent() -> None:
    model = SD35.fresh()
    handle = gradseam.patch(model, gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn")
    try:
        seams = sorted((r.blocks, r.seam) for r in handle.plan.regions if r.shape == "ffn")
        expected = [((i,), ("ff",)) for i in range(4)] + [((i,), ("ff_context",)) for i in range(3)]
        assert seams == sorted(expected)
        assert_same_step(run_step(SD35.fresh(), SD35), run_step(model, SD35), what="sd3.5 torch-ffn")
    finally:
        handle.remove()


@pytest.mark.parametrize("case", [SD3, SD35, SANA_MASKED, SANA_VIDEO], ids=lambda c: c.name)
def test_interval_chunks_chain_without_fallback(case: Case) -> None:
    model = case.fresh()
    handle = gradseam.patch(model, CHUNKS)
    try:
        assert [r.shape for r in handle.plan.regions] == ["chunk", "chunk"]
        run_step(model, case)
        for region in handle.regions():
            assert region.chunk_calls == 1 and not region.fallbacks, f"{region.label} fell back: {region.fallbacks}"
    finally:
        handle.remove()


# -- Presets: the real-size configs build (on the meta device) and plan as documented ------------


@pytest.mark.parametrize(
    ("model_name", "expected"),
    [
        ("SD3Transformer2DModel", {"3-medium-1024": 24, "3.5-medium-1024": 24, "3.5-large-1024": 38}),
        ("SanaTransformer2DModel", {"1600m-1024": 20}),
        ("SanaVideoTransformer3DModel", {"2b-480p": 20}),
    ],
)
def test_presets_plan_at_full_size(model_name: str, expected: dict[str, int]) -> None:
    import diffusers

    cls = getattr(diffusers, model_name)
    with torch.device("meta"):
        probe = cls()
    family = family_for(probe)
    assert set(family.presets) == set(expected)
    for name, preset in family.presets.items():
        with torch.device("meta"):
            model = cls(**preset.config)
        whole = plan(model, family, gradseam.CheckpointConfig.coerce(ON))
        assert sorted(b for r in whole.regions for b in r.blocks) == list(range(expected[name])), name
        # every block has its FFN seam(s); SD3's optional ones are simply absent where the block lacks them
        seams = plan(model, family, gradseam.CheckpointConfig.coerce({**ON, "gradient_checkpointing_backend": "torch-ffn"}))
        assert {b for r in seams.regions if r.shape == "ffn" for b in r.blocks} == set(range(expected[name])), name
        inputs = preset.make_inputs(model, torch.device("meta"), torch.bfloat16, **preset.inputs)
        assert inputs["hidden_states"].requires_grad and inputs["hidden_states"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("family_name", "config", "sizes"),
    [
        ("sd3", {"sample_size": 8, "in_channels": 4, "out_channels": 4, "num_layers": 3, "attention_head_dim": 8,
                 "num_attention_heads": 2, "joint_attention_dim": 16, "caption_projection_dim": 16,
                 "pooled_projection_dim": 8, "pos_embed_max_size": 8, "dual_attention_layers": (0,),
                 "qk_norm": "rms_norm"},
         {"image_tokens": 16, "text_tokens": 5}),
        ("sana", {"in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8,
                  "num_layers": 3, "num_cross_attention_heads": 2, "cross_attention_head_dim": 8,
                  "cross_attention_dim": 16, "caption_channels": 12, "sample_size": 8, "guidance_embeds": True},
         {"image_tokens": 16, "text_tokens": 5}),
        ("sana-video", {"in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8,
                        "num_layers": 3, "num_cross_attention_heads": 2, "cross_attention_head_dim": 8,
                        "cross_attention_dim": 16, "caption_channels": 12, "sample_size": 8,
                        "rope_max_seq_len": 32},
         {"frames": 9, "height": 32, "width": 32, "text_tokens": 5}),
    ],
)
def test_preset_inputs_drive_the_model_and_patch_exactly(family_name, config, sizes) -> None:
    """What `gradseam bench` does, on a tiny preset: build truncated, build inputs, step; the same
    step patched with chunks is bit-identical."""
    from dataclasses import replace

    from gradseam import Preset
    from gradseam.tools.checks import find_family
    from gradseam.tools.measure import forward_backward, grad_leaves
    from gradseam.tools.workloads import build, sequence_length

    family = find_family(family_name)
    real = next(iter(family.presets.values()))
    tiny = replace(family, presets={"tiny": Preset("tiny", config, sizes, real.make_inputs)})
    workload = build(tiny, "tiny", layers=2, device="cpu", dtype=torch.float32)
    assert workload.truncated == {"transformer_blocks": (2, 3)}
    inputs = workload.inputs()
    assert sequence_length(workload.model, workload.family, inputs) > 0
    leaves = grad_leaves(inputs)
    forward_backward(workload.model, inputs)()
    reference = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    with gradseam.patch(workload.model, CHUNKS) as handle:
        assert handle.family.name == family_name
        forward_backward(workload.model, inputs)()
    assert all(torch.equal(t.grad, r) for t, r in zip(leaves, reference))
    assert workload.inputs(tokens=64) is not None
