"""ACE-Step 1.5: a tiny deterministic music DiT through the conformance kit (alternating sliding-window
and full self-attention with the banded mask really masking, GQA, cross-attention to a condition of
another width), a batch of two at mean-flow timesteps (``timestep_r`` != ``timestep``) on an odd
latent length the model pads, the interval the family ignores by design, and both presets at full
size."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import gradseam
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_bench_workload,
    check_strategy,
    preset_model,
    randn,
)

LAYERS, ACOUSTIC, CONTEXT, COND, WINDOW = 4, 4, 8, 12, 2
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}
CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}

# 4 query heads x 8 over 2 KV heads (GQA) on a 16-wide trunk; the condition is 12 wide, so the
# condition_embedder projects it up (as in the XL turbo); a 2-patch window, so 8 patches are masked.
TINY = dict(
    hidden_size=16, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, in_channels=ACOUSTIC + CONTEXT, audio_acoustic_hidden_dim=ACOUSTIC, patch_size=2,
    sliding_window=WINDOW, encoder_hidden_size=COND,
)


def ace_step_model():
    from diffusers import AceStepTransformer1DModel

    return AceStepTransformer1DModel(**TINY)


def ace_step_inputs(g: torch.Generator) -> dict:
    # 16 latent frames: 8 patches, more than the window, so the sliding layers' mask masks something
    return {
        "hidden_states": randn(g, 1, 16, ACOUSTIC, grad=True),
        "timestep": torch.tensor([0.6]),
        "timestep_r": torch.tensor([0.6]),
        "encoder_hidden_states": randn(g, 1, 5, COND, grad=True),
        "context_latents": randn(g, 1, 16, CONTEXT, grad=True),
    }


def ace_step_batch_inputs(g: torch.Generator) -> dict:
    # Two samples at their own (t, r) pairs (mean-flow training: both timestep embeddings differ per
    # sample), 13 latent frames (the model pads to 14 and crops the output back), and attention_kwargs
    # as the pipeline passes them (the LoRA-scale decorator pops "scale").
    return {
        "hidden_states": randn(g, 2, 13, ACOUSTIC, grad=True),
        "timestep": torch.tensor([0.3, 0.8]),
        "timestep_r": torch.tensor([0.1, 0.8]),
        "encoder_hidden_states": randn(g, 2, 7, COND, grad=True),
        "context_latents": randn(g, 2, 13, CONTEXT, grad=True),
        "attention_kwargs": {"scale": 1.0},
    }


ACE_STEP = Case("ace-step", ace_step_model, ace_step_inputs)
ACE_STEP_BATCH = Case("ace-step-batch", ace_step_model, ace_step_batch_inputs)


# -- The conformance kit --------------------------------------------------------------------------
# The family declares no carry, so the matrices the suites derive have no interval row.
class TestAceStep(ConformanceSuite):
    case = ACE_STEP


class TestAceStepBatch(ConformanceSuite):
    case = ACE_STEP_BATCH
    reduced = True


def test_the_family_takes_no_interval() -> None:
    assert not TestAceStep.family().supports_interval
    rows = TestAceStep.strategy_configs() + TestAceStep.offload_configs()
    assert rows and not any(c.get("gradient_checkpointing_interval") for c in rows)


# -- What the suites cannot see -------------------------------------------------------------------

def test_blocks_share_everything_but_the_alternating_mask() -> None:
    # Why there is no carry: RoPE, temb and the condition are one object for all blocks, but the
    # sliding layers get the banded mask and the full layers None.
    model = ACE_STEP_BATCH.fresh()
    seen: list[dict] = []
    for block in model.layers:
        block.register_forward_pre_hook(lambda _m, _a, kw: seen.append(dict(kw)), with_kwargs=True)
    with torch.no_grad():
        model(**ace_step_batch_inputs(torch.Generator().manual_seed(1)))
    assert len(seen) == LAYERS
    first = seen[0]
    for kw in seen:
        for name in ("position_embeddings", "temb", "encoder_hidden_states"):
            assert kw[name] is first[name], name
        assert kw["encoder_attention_mask"] is None
    assert model.layer_types == ["sliding_attention", "full_attention"] * (LAYERS // 2)
    masks = [kw["attention_mask"] for kw in seen]
    assert all(m is masks[0] for m in masks[0::2]) and all(m is None for m in masks[1::2])
    assert masks[0].shape == (1, 1, 7, 7) and (masks[0] < 0).any()  # the window masks far patches


def test_interval_is_ignored_with_a_warning_and_every_block_is_its_own_region() -> None:
    from gradseam.errors import GradseamWarning

    model = ACE_STEP.fresh()
    family = family_for(model)
    assert family.name == "ace-step" and not family.supports_interval
    with pytest.warns(GradseamWarning, match="does not support gradient_checkpointing_interval"):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(CHUNKED))
    assert [(r.list_path, r.blocks, r.shape) for r in the_plan.regions] == [
        ("layers", (i,), "block") for i in range(LAYERS)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GradseamWarning)
        report = check_strategy(ACE_STEP, CHUNKED, whole=True)
    assert report.saved_ratio < 1


def test_a_carry_would_only_fall_back(monkeypatch) -> None:
    # With the carry the loop would allow, every chunk's second block is a full-attention layer that
    # gets None where the chunk ran it with the sliding mask, and computes again.
    from dataclasses import replace

    import gradseam.patcher as patcher
    from gradseam.errors import GradseamWarning
    from gradseam.family import Carry

    model = ACE_STEP.fresh()
    family = family_for(model)
    carried = replace(family, block_lists=tuple(
        replace(bl, carry=Carry({"hidden_states": None})) for bl in family.block_lists))
    monkeypatch.setattr(patcher, "family_for", lambda m: carried)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GradseamWarning)  # the fallbacks this test is about
        report = check_strategy(ACE_STEP, CHUNKED)
    chunks = [r for r in report.regions if r.shape == "chunk"]
    assert len(chunks) == LAYERS // 2
    assert all(r.fallbacks and not r.whole for r in chunks)


def test_ffn_seams_are_planned_as_declared() -> None:
    model = ACE_STEP.fresh()
    the_plan = plan(model, family_for(model), gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.list_path, r.blocks, r.seam) for r in the_plan.regions] == [
        ("layers", (i,), ("mlp",)) for i in range(LAYERS)]


# -- The presets at full size ---------------------------------------------------------------------
PRESETS = {"1.5-60s": 1500, "1.5-240s": 6000}  # latent frames at 25 Hz


def _preset_model(name: str):
    return preset_model("ace-step", name)


def test_preset_config_is_the_constructors_arguments_and_its_defaults() -> None:
    from diffusers import AceStepTransformer1DModel

    family = gradseam.registry.REGISTRY.get("ace-step")
    params = inspect.signature(AceStepTransformer1DModel.__init__).parameters
    for preset in family.presets.values():
        assert set(preset.config) == set(params) - {"self"}
        # the class defaults stand for the published config, except the turbo flags (metadata only)
        differs = {k for k, v in preset.config.items() if params[k].default != v}
        assert differs == {"is_turbo", "model_version"}


@pytest.mark.parametrize("name", PRESETS)
def test_preset_plans_at_full_size(name: str) -> None:
    from gradseam.errors import GradseamWarning

    family, _, model = _preset_model(name)
    assert set(family.presets) == set(PRESETS)
    assert family_for(model) is family
    assert 1.5e9 < sum(p.numel() for p in model.parameters()) < 1.6e9
    block = model.layers[0]
    assert (block.self_attn.heads, block.self_attn.kv_heads, block.mlp.gate_proj.out_features) == (16, 8, 6144)
    assert [b.self_attn.sliding_window for b in model.layers[:2]] == [128, None]
    for config in ({"gradient_checkpointing": True}, FFN):
        regions = plan(model, family, gradseam.CheckpointConfig.coerce(config)).regions
        assert sorted(r.blocks for r in regions) == [(i,) for i in range(24)]
    with pytest.warns(GradseamWarning, match="does not support gradient_checkpointing_interval"):
        assert len(plan(model, family, gradseam.CheckpointConfig.coerce(CHUNKED)).regions) == 24


@pytest.mark.parametrize("name", PRESETS)
def test_preset_inputs_have_the_pipelines_sizes(name: str) -> None:
    _, preset, model = _preset_model(name)
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    frames = PRESETS[name]
    assert x["hidden_states"].shape == (1, frames, 64) and x["hidden_states"].requires_grad
    assert x["context_latents"].shape == (1, frames, 128)
    assert x["encoder_hidden_states"].shape == (1, 512 + 1 + 256, 2048)
    assert x["timestep"].shape == x["timestep_r"].shape == (1,)
    assert x["hidden_states"].dtype == torch.bfloat16
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 100, **preset.inputs)
    assert fewer["hidden_states"].shape == (1, 200, 64) and fewer["context_latents"].shape == (1, 200, 128)


def test_latent_frames_follow_the_pipeline() -> None:
    from gradseam.adapters.ace_step import latent_frames

    assert [latent_frames(s) for s in (60, 240, 30.5, 1)] == [1500, 6000, 763, 25]


def test_preset_input_builder_runs_the_model() -> None:
    family = gradseam.registry.REGISTRY.get("ace-step")
    model = ACE_STEP.fresh()
    x = family.presets["1.5-60s"].make_inputs(model, "cpu", torch.float32, None, seconds=1, text_tokens=3,
                                              lyric_tokens=2)
    assert x["encoder_hidden_states"].shape == (1, 2 + 1 + 3, COND)
    out = model(**x).sample
    assert out.shape == (1, 25, ACOUSTIC)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


@pytest.mark.parametrize("preset", PRESETS)
def test_bench_workload_truncates_steps_and_patches_exactly(preset: str) -> None:
    """`gradseam bench --family ace-step --layers 2` on a tiny preset with the real input builder."""
    # 1 s: 25 latent frames, padded to 26, 13 patches
    check_bench_workload("ace-step", TINY, {"seconds": 1, "text_tokens": 3, "lyric_tokens": 2}, preset=preset,
                         sequence=13)
