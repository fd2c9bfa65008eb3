"""Wan 2.2 Animate (WanAnimateTransformer3DModel) through the conformance kit, plus its presets.

The family declares no carry (face-adapter residuals between trunk blocks), so the kit's matrix is
``torch`` / ``torch-ffn`` x stride, kept attention and the offload backends without an interval;
the main case runs all of it, a batch of two (its own timesteps, the face video encoded in several
motion-encoder batches) a reduced set. Then: an interval is ignored with a warning, a carry would
make the chunks around a face injection fall back (why there is none), the face inputs reach the
output and the face adapters train, and the presets build on the meta device and plan at full size.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

import gradseam
from gradseam.errors import GradseamWarning
from gradseam.family import Carry
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_strategy,
    randn,
)

CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}

# Six trunk blocks with a face adapter after blocks 0 and 3 (every 3rd: the released model's pattern at
# period 5), a 16-wide trunk with the CLIP image K/V projections, and the motion encoder at 8 x 8 pixels.
_TINY = {
    "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 12,
    "latent_channels": 4, "out_channels": 4, "text_dim": 16, "freq_dim": 16, "ffn_dim": 32, "num_layers": 6,
    "image_dim": 8, "added_kv_proj_dim": 16, "rope_max_seq_len": 32, "motion_encoder_size": 8,
    "motion_encoder_channel_sizes": {"8": 4, "4": 4}, "motion_style_dim": 8, "motion_dim": 4,
    "motion_encoder_dim": 8, "face_encoder_hidden_dim": 8, "face_encoder_num_heads": 2,
    "inject_face_latents_blocks": 3,
}


def animate_model():
    from diffusers import WanAnimateTransformer3DModel

    return WanAnimateTransformer3DModel(**_TINY)


def animate_inputs(g: torch.Generator, batch: int = 1) -> dict:
    # T = 2 latent frames behind the reference frame (3 x 2 x 2 = 12 tokens), their pose latents, 5 face
    # frames (the face encoder halves them twice: 2 motion frames, plus a zero one for the reference);
    # exactly 512 text tokens (the cross-attention splits the 4 CLIP tokens off by that count)
    return {
        "hidden_states": randn(g, batch, 12, 3, 4, 4, grad=True),
        "timestep": torch.tensor([500] * batch),
        "encoder_hidden_states": randn(g, batch, 512, 16),
        "encoder_hidden_states_image": randn(g, batch, 4, 8, grad=True),
        "pose_hidden_states": randn(g, batch, 4, 2, 4, 4, grad=True),
        "face_pixel_values": randn(g, batch, 3, 5, 8, 8, grad=True),
    }


def animate_batch_inputs(g: torch.Generator) -> dict:
    return {**animate_inputs(g, batch=2), "timestep": torch.tensor([700, 200]), "motion_encode_batch_size": 3}


WAN_ANIMATE = Case("wan-animate", animate_model, animate_inputs)
WAN_ANIMATE_BATCH = Case("wan-animate-batch", animate_model, animate_batch_inputs)


class TestWanAnimate(ConformanceSuite):
    case = WAN_ANIMATE


class TestWanAnimateBatch(ConformanceSuite):
    case = WAN_ANIMATE_BATCH
    reduced = True


def test_the_matrix_has_no_interval() -> None:
    family = TestWanAnimate.family()
    assert family.name == "wan-animate" and not family.supports_interval and family.has_ffn and family.has_attention
    rows = TestWanAnimate.strategy_configs() + TestWanAnimate.offload_configs()
    assert rows and not any(c.get("gradient_checkpointing_interval") for c in rows)


# -- no carry, and why ---------------------------------------------------------------------------


def test_an_interval_is_ignored_with_a_warning() -> None:
    torch.manual_seed(0)
    model = animate_model()
    family = family_for(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(CHUNKED))
    assert any(issubclass(w.category, GradseamWarning) and "does not support gradient_checkpointing_interval"
               in str(w.message) for w in caught)
    assert [r.blocks for r in the_plan.regions] == [(i,) for i in range(6)]  # one region per block
    report = check_strategy(WAN_ANIMATE, CHUNKED, whole=True)  # exact, and every block region whole
    assert {r.label for r in report.regions} == {f"blocks[{i}]" for i in range(6)}


def test_a_carry_would_make_the_chunks_around_a_face_injection_fall_back(monkeypatch) -> None:
    # What the missing carry avoids: with one, the chunk whose first block feeds a face adapter
    # (blocks 0 -> 1) falls back, computing block 1 twice in forward; the others (2 -> 3, 4 -> 5) run
    # whole. Still exact either way.
    import gradseam.patcher as patcher

    torch.manual_seed(0)
    family = family_for(animate_model())
    carried = replace(family, block_lists=(replace(family.block_lists[0], carry=Carry({"hidden_states": None})),))
    monkeypatch.setattr(patcher, "family_for", lambda m: carried)
    report = check_strategy(WAN_ANIMATE, CHUNKED)
    whole = {r.label: r.whole for r in report.regions if r.shape == "chunk"}
    assert whole == {"blocks[0, 1]": False, "blocks[2, 3]": True, "blocks[4, 5]": True}


# -- the inputs matter, the face adapters train -------------------------------------------------


def test_face_pose_and_image_inputs_reach_the_output_and_the_face_adapters_train() -> None:
    report = check_strategy(WAN_ANIMATE, {"gradient_checkpointing": True}, whole=True)
    for name in ("face_pixel_values", "pose_hidden_states", "encoder_hidden_states_image"):
        assert report.patched.input_grads[name].abs().sum() > 0, name
    # the adapters run between blocks, outside every region, and still get their gradients exactly
    assert report.patched.param_grads["face_adapter.1.to_q.weight"].abs().sum() > 0
    assert all("face_adapter" not in r.label for r in report.regions)


def test_regions() -> None:
    torch.manual_seed(0)
    model = animate_model()
    family = family_for(model)
    ffn = plan(model, family, gradseam.CheckpointConfig.coerce(
        gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn"))
    assert [(r.blocks, r.seam) for r in ffn.regions] == [((i,), ("ffn",)) for i in range(6)]


# -- presets at full size -----------------------------------------------------------------------


def _meta_model(preset):
    from diffusers import WanAnimateTransformer3DModel

    with torch.device("meta"):
        return WanAnimateTransformer3DModel(**preset.config)


@pytest.mark.parametrize("name", ["14b-720p", "14b-480p"])
def test_presets_plan_at_full_size(name: str) -> None:
    family = gradseam.registry.REGISTRY.get("wan-animate")
    assert set(family.presets) == {"14b-720p", "14b-480p"}
    model = _meta_model(family.presets[name])
    assert family_for(model) is family
    assert len(model.blocks) == 40 and len(model.face_adapter) == 8
    assert model.blocks[0].attn2.add_k_proj is not None  # the released model's CLIP image K/V
    for config in ({"gradient_checkpointing": True}, CHUNKED,
                   {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert [r.blocks for r in the_plan.regions] == [(i,) for i in range(40)]


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    family = gradseam.registry.REGISTRY.get("wan-animate")
    preset = family.presets["14b-720p"]
    model = _meta_model(preset)
    x = preset.make_inputs(model, "meta", torch.bfloat16, **preset.inputs)
    assert x["hidden_states"].shape == (1, 36, 21, 90, 160) and x["hidden_states"].requires_grad
    assert x["pose_hidden_states"].shape == (1, 16, 20, 90, 160)
    assert x["face_pixel_values"].shape == (1, 3, 77, 512, 512)
    assert x["encoder_hidden_states"].shape == (1, 512, 4096) and x["encoder_hidden_states_image"].shape == (1, 257, 1280)
    more = preset.make_inputs(model, "meta", torch.bfloat16, 11 * 3600, **preset.inputs)
    assert more["hidden_states"].shape[2] == 11 and more["face_pixel_values"].shape[2] == 4 * 9 + 1


@pytest.mark.parametrize(("name", "shape"), [("14b-720p", (1, 16, 21, 90, 160)), ("14b-480p", (1, 16, 21, 60, 104))])
def test_preset_inputs_run_through_the_full_width_model_on_meta(name: str, shape: tuple[int, ...]) -> None:
    # the real-size segment fits the model: 77 face frames give 21 motion frames for 21 latent frames,
    # the 512 text tokens split the CLIP tokens off; the full-width model with 5 blocks (one face adapter)
    from diffusers import WanAnimateTransformer3DModel

    preset = gradseam.registry.REGISTRY.get("wan-animate").presets[name]
    with torch.device("meta"):
        model = WanAnimateTransformer3DModel(**preset.config, num_layers=5)
    out = model(**preset.make_inputs(model, "meta", torch.float32, **preset.inputs), return_dict=False)[0]
    assert out.shape == shape


def test_preset_input_builder_runs_the_model() -> None:
    # the builder's frame arithmetic must give the face encoder one motion frame per latent frame
    family = gradseam.registry.REGISTRY.get("wan-animate")
    torch.manual_seed(0)
    model = animate_model()
    inputs = family.presets["14b-480p"].make_inputs(model, "cpu", torch.float32, frames=9, height=32, width=32)
    assert inputs["hidden_states"].shape[2] == 4
    out = model(**inputs, return_dict=False)[0]
    assert out.shape == (1, 4, 4, 4, 4)
    out.square().mean().backward()
    assert inputs["hidden_states"].grad is not None
    # and with a token override (3 x 2 x 2 tokens: the reference frame and 2 latent frames)
    inputs = family.presets["14b-480p"].make_inputs(model, "cpu", torch.float32, 12, frames=9, height=32, width=32)
    assert inputs["hidden_states"].shape[2] == 3
    model(**inputs)
