"""ChronoEdit (ChronoEditTransformer3DModel) through the conformance kit, plus its presets.

The main case is an editing step as the pipeline runs it: two latent frames (the input image and the
edited one, with ChronoEdit's skipped temporal RoPE positions), the image's mask and latents as extra
channels, CLIP image tokens in front of exactly 512 text tokens; it runs the kit's whole matrix. A
temporal-reasoning step (four latent frames: the ordinary RoPE path) and a batch of two at their own
timesteps run a reduced matrix. Then: the chunks run whole, the loop hands every block the same
objects, the inputs really change the output, and the presets build on the meta device and plan at
full size.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from family_checks import assert_plans_cover_every_block, chunks_served_whole

import gradseam
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_bench_workload,
    check_strategy,
    randn,
)

CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}

# Five blocks: two chunks and a lone block at interval 2. Head width 8 (RoPE 4 + 2 + 2), hidden 16;
# 12 input channels (4 noise + 4 mask + 4 image latents, the released model's 16 + 4 + 16 in small);
# the CLIP image states 8 wide through the cross-attention's added K/V projections.
TINY = {
    "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 12,
    "out_channels": 4, "text_dim": 16, "freq_dim": 16, "ffn_dim": 32, "num_layers": 5, "image_dim": 8,
    "added_kv_proj_dim": 16, "rope_max_seq_len": 32,
}


def chronoedit_model(**overrides):
    from diffusers import ChronoEditTransformer3DModel

    return ChronoEditTransformer3DModel(**{**TINY, **overrides})


def edit_inputs(g: torch.Generator, frames: int = 2, batch: int = 1) -> dict:
    # `frames` latent frames of 2 x 2 patches; exactly 512 text tokens (the cross-attention splits the
    # 4 CLIP tokens off by that count)
    return {
        "hidden_states": randn(g, batch, 12, frames, 4, 4, grad=True),
        "timestep": torch.tensor([500.0] * batch),
        "encoder_hidden_states": randn(g, batch, 512, 16),
        "encoder_hidden_states_image": randn(g, batch, 4, 8, grad=True),
    }


def reasoning_inputs(g: torch.Generator) -> dict:
    # temporal reasoning: reasoning frames between the input and the edit, ordinary temporal RoPE positions
    return edit_inputs(g, frames=4)


def batch_inputs(g: torch.Generator) -> dict:
    return {**edit_inputs(g, batch=2), "timestep": torch.tensor([900.0, 150.0])}


CHRONOEDIT = Case("chronoedit", chronoedit_model, edit_inputs)
CHRONOEDIT_REASONING = Case("chronoedit-reasoning", chronoedit_model, reasoning_inputs)
CHRONOEDIT_BATCH = Case("chronoedit-batch", chronoedit_model, batch_inputs)
CASES = [CHRONOEDIT, CHRONOEDIT_REASONING, CHRONOEDIT_BATCH]


class TestChronoEdit(ConformanceSuite):
    case = CHRONOEDIT


class TestChronoEditReasoning(ConformanceSuite):
    case = CHRONOEDIT_REASONING
    reduced = True


class TestChronoEditBatch(ConformanceSuite):
    case = CHRONOEDIT_BATCH
    reduced = True


# -- the chunks chain, the inputs matter --------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_chunk_runs_whole(case: Case) -> None:
    assert chunks_served_whole(case, CHUNKED) == {"blocks[0, 1]": True, "blocks[2, 3]": True}


@pytest.mark.parametrize("case", [CHRONOEDIT, CHRONOEDIT_REASONING], ids=lambda c: c.name)
def test_the_loop_hands_every_block_the_same_objects(case: Case) -> None:
    # What the carry relies on: the text + image states, the timestep projection and the RoPE tuple are
    # one object each for every block; hidden_states is what the previous block returned.
    model = case.fresh()
    seen: list[tuple] = []
    returned: list[torch.Tensor] = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda _m, args: seen.append(args))
        block.register_forward_hook(lambda _m, _a, out: returned.append(out))
    with torch.no_grad():
        model(**case.inputs(torch.Generator().manual_seed(1)))
    assert len(seen) == 5 and all(len(args) == 4 for args in seen)
    for position in (1, 2, 3):
        assert all(args[position] is seen[0][position] for args in seen), position
    assert seen[0][1].shape[1] == 4 + 512  # the CLIP tokens in front of the text
    for before, args in zip(returned, seen[1:]):
        assert args[0] is before


def _output(case: Case, model: torch.nn.Module | None = None, **changes) -> torch.Tensor:
    model = model or case.fresh()
    with torch.no_grad():
        return model(**{**case.inputs(torch.Generator().manual_seed(1)), **changes}, return_dict=False)[0]


def test_skipped_rope_image_states_and_timesteps_reach_the_output() -> None:
    # two latent frames take temporal positions 0 and rope_temporal_skip_len - 1: another skip length
    # changes an editing step, and leaves a reasoning step (ordinary positions) bit for bit the same
    torch.manual_seed(0)
    skip4 = chronoedit_model(rope_temporal_skip_len=4)
    assert not torch.equal(_output(CHRONOEDIT), _output(CHRONOEDIT, skip4))
    torch.manual_seed(0)
    skip4 = chronoedit_model(rope_temporal_skip_len=4)
    assert torch.equal(_output(CHRONOEDIT_REASONING), _output(CHRONOEDIT_REASONING, skip4))
    batch = _output(CHRONOEDIT_BATCH)
    assert not torch.equal(batch, _output(CHRONOEDIT_BATCH, timestep=torch.tensor([900.0, 900.0])))
    report = check_strategy(CHRONOEDIT, CHUNKED, whole=True)
    assert report.patched.input_grads["encoder_hidden_states_image"].abs().sum() > 0


def test_regions() -> None:
    model = CHRONOEDIT.fresh()
    family = family_for(model)
    assert family.name == "chronoedit" and family.supports_interval and family.has_ffn and family.has_attention
    ffn = plan(model, family, gradseam.CheckpointConfig.coerce(
        gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn"))
    assert [(r.blocks, r.seam) for r in ffn.regions] == [((i,), ("ffn",)) for i in range(5)]
    chunks = plan(model, family, gradseam.CheckpointConfig.coerce(CHUNKED))
    assert [r.blocks for r in chunks.regions] == [(0, 1), (2, 3), (4,)]


def test_wan_keeps_its_own_blocks() -> None:
    # ChronoEdit's block is a copy of Wan's under Wan's name, in its own module: a distinct class
    from diffusers.models.transformers import transformer_chronoedit, transformer_wan

    assert transformer_chronoedit.WanTransformerBlock is not transformer_wan.WanTransformerBlock
    assert not issubclass(transformer_chronoedit.ChronoEditTransformer3DModel, transformer_wan.WanTransformer3DModel)
    assert family_for(CHRONOEDIT.fresh()) is gradseam.registry.REGISTRY.get("chronoedit")


# -- presets at full size -----------------------------------------------------------------------

PRESETS = {  # latent frames and latent picture at the preset's size
    "14b-720p": (2, 90, 160),
    "14b-1024": (2, 128, 128),
    "14b-720p-reasoning": (8, 90, 160),
}


def _meta_model(preset, **overrides):
    from diffusers import ChronoEditTransformer3DModel

    with torch.device("meta"):
        return ChronoEditTransformer3DModel(**{**preset.config, **overrides})


def test_preset_config_keys_are_constructor_arguments() -> None:
    from diffusers import ChronoEditTransformer3DModel

    accepted = set(inspect.signature(ChronoEditTransformer3DModel.__init__).parameters) - {"self"}
    for preset in gradseam.registry.REGISTRY.get("chronoedit").presets.values():
        assert set(preset.config) <= accepted, set(preset.config) - accepted


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_plan_at_full_size(name: str) -> None:
    family = gradseam.registry.REGISTRY.get("chronoedit")
    assert set(family.presets) == set(PRESETS)
    model = _meta_model(family.presets[name])
    assert family_for(model) is family
    block = model.blocks[0]
    assert (len(model.blocks), block.attn1.heads, block.ffn.net[0].proj.out_features) == (40, 40, 13824)
    assert block.attn2.add_k_proj is not None and model.config.in_channels == 36  # the released I2V conditioning
    assert_plans_cover_every_block(model, family, 40, (
        ({"gradient_checkpointing": True}, 40), (CHUNKED, 20),
        ({"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}, 40)
    ))


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_inputs_have_the_pipelines_sizes(name: str) -> None:
    preset = gradseam.registry.REGISTRY.get("chronoedit").presets[name]
    model = _meta_model(preset)
    x = preset.make_inputs(model, "meta", torch.bfloat16, **preset.inputs)
    assert x["hidden_states"].shape == (1, 36, *PRESETS[name]) and x["hidden_states"].requires_grad
    assert x["timestep"].shape == (1,)
    assert x["encoder_hidden_states"].shape == (1, 512, 4096)
    assert x["encoder_hidden_states_image"].shape == (1, 257, 1280)
    _, h, w = PRESETS[name]
    more = preset.make_inputs(model, "meta", torch.bfloat16, 4 * (h // 2) * (w // 2), **preset.inputs)
    assert more["hidden_states"].shape[2] == 4


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_inputs_run_through_the_full_width_model_on_meta(name: str) -> None:
    # the 512 text tokens split the CLIP tokens off, the 2-frame RoPE fits: the full-width model, one block
    preset = gradseam.registry.REGISTRY.get("chronoedit").presets[name]
    model = _meta_model(preset, num_layers=1)
    x = preset.make_inputs(model, "meta", torch.float32, **preset.inputs)
    assert model(**x, return_dict=False)[0].shape == (1, 16, *PRESETS[name])


@pytest.mark.parametrize(("frames", "latent_frames"), [(5, 2), (13, 4)])
def test_preset_input_builder_runs_the_model(frames: int, latent_frames: int) -> None:
    family = gradseam.registry.REGISTRY.get("chronoedit")
    model = CHRONOEDIT.fresh()
    inputs = family.presets["14b-720p"].make_inputs(model, "cpu", torch.float32, frames=frames, height=32, width=32)
    assert inputs["hidden_states"].shape == (1, 12, latent_frames, 4, 4)
    assert inputs["encoder_hidden_states_image"].shape == (1, 257, 8)
    out = model(**inputs, return_dict=False)[0]
    assert out.shape == (1, 4, latent_frames, 4, 4)
    out.square().mean().backward()
    assert inputs["hidden_states"].grad is not None


@pytest.mark.parametrize("preset", list(PRESETS))
def test_bench_workload_truncates_steps_and_patches_exactly(preset: str) -> None:
    """`gradseam bench --family chronoedit --layers 2` on a tiny preset with the real input builder."""
    frames = 29 if preset.endswith("reasoning") else 5
    tokens = ((frames - 1) // 4 + 1) * 2 * 2
    check_bench_workload("chronoedit", TINY, {"frames": frames, "height": 32, "width": 32}, preset=preset,
                         sequence=tokens)
