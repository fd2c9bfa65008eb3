"""Hunyuan-DiT (HunyuanDiT2DModel) through the conformance kit, plus its presets.

The plain case (v1.2: no size or style condition; padded CLIP and mT5 masks; the pipeline's RoPE) runs the
kit's whole matrix. Reduced suites: v1.0 / v1.1 (size and style conditions) on a batch of two at their own
timesteps and sizes over a non-square latent, and ControlNet samples added to the long skips. Then what the
declaration rests on (the loop's per-block ``skip``, no carry, the ``norm3 → ff`` seam, diffusers' refused
flag) and the presets at full size with their real input builder.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import pytest
import torch
from diffusers import HunyuanDiT2DModel
from family_checks import record_block_calls, sample_output

import gradseam
from gradseam.adapters.hunyuandit import crop_region, rotary_embedding
from gradseam.errors import GradseamWarning
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

CLIP, T5 = 3, 4  # text_len, text_len_t5: the model takes exactly these many tokens of each
# 2 heads x 8 = 16 wide (hidden_size must equal the heads' width), four blocks: block 3 merges block 0's
# output through its skip_norm / skip_linear, blocks 1 and 2 take no skip. The T5 width is a multiple of 8,
# the attention pooler's head count.
TINY: dict[str, Any] = dict(
    num_attention_heads=2, attention_head_dim=8, in_channels=4, patch_size=2, sample_size=4, hidden_size=16,
    num_layers=4, cross_attention_dim=8, cross_attention_dim_t5=16, pooled_projection_dim=8, text_len=CLIP,
    text_len_t5=T5, use_style_cond_and_image_meta_size=False,
)
TINY_V11 = dict(TINY, use_style_cond_and_image_meta_size=True)
SIDE = 4  # latent side: 2 x 2 patches
CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}


def hunyuandit_model(**changes: Any) -> HunyuanDiT2DModel:
    return HunyuanDiT2DModel(**{**TINY, **changes})


def _masks(batch: int) -> dict:
    # the tokenizers pad to max_length: the last CLIP token and the last two mT5 tokens of the last sample
    clip, t5 = torch.ones(batch, CLIP, dtype=torch.int64), torch.ones(batch, T5, dtype=torch.int64)
    clip[-1, -1:] = 0
    t5[-1, -2:] = 0
    return {"text_embedding_mask": clip, "text_embedding_mask_t5": t5}


def hunyuandit_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": randn(g, 1, 4, SIDE, SIDE, grad=True),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": randn(g, 1, CLIP, 8, grad=True),
        "encoder_hidden_states_t5": randn(g, 1, T5, 16, grad=True),
        **_masks(1),
        "image_rotary_emb": rotary_embedding(8, 2, SIDE // 2, SIDE // 2),
    }


def v11_batch_inputs(g: torch.Generator) -> dict:
    # v1.0 / v1.1: the size condition [H, W, target H, W, crop top, left] and style 0 for two samples at
    # their own timesteps; a 4 x 8 latent (2 x 4 patches), so the RoPE grid sits off-centre in its square
    return {
        "hidden_states": randn(g, 2, 4, SIDE, 2 * SIDE, grad=True),
        "timestep": torch.tensor([120.0, 870.0]),
        "encoder_hidden_states": randn(g, 2, CLIP, 8, grad=True),
        "encoder_hidden_states_t5": randn(g, 2, T5, 16, grad=True),
        **_masks(2),
        "image_rotary_emb": rotary_embedding(8, 2, SIDE // 2, SIDE),
        "image_meta_size": torch.tensor([[32.0, 64.0, 32.0, 64.0, 0.0, 0.0],
                                         [48.0, 96.0, 32.0, 64.0, 8.0, 16.0]]),
        "style": torch.zeros(2, dtype=torch.int64),
    }


class KeepsControlSamples(HunyuanDiT2DModel):
    """The upstream model, handed a copy of the ControlNet list: its loop pops the samples off the list it
    is given, and the kit looks for the samples' gradients in the inputs after the step."""

    def forward(self, *args: Any, controlnet_block_samples: list | None = None, **kwargs: Any) -> Any:
        samples = None if controlnet_block_samples is None else list(controlnet_block_samples)
        return super().forward(*args, controlnet_block_samples=samples, **kwargs)


def control_inputs(g: torch.Generator) -> dict:
    # one sample per long skip (num_layers // 2 - 1 of them), as HunyuanDiT2DControlNetModel returns them,
    # with gradients: ControlNet training sends them back into the ControlNet
    samples = [randn(g, 1, SIDE * SIDE // 4, 16, grad=True)]
    return {**hunyuandit_inputs(g), "controlnet_block_samples": samples}


HUNYUANDIT = Case("hunyuandit", hunyuandit_model, hunyuandit_inputs)
HUNYUANDIT_V11 = Case("hunyuandit-v11-batch", lambda: hunyuandit_model(**TINY_V11), v11_batch_inputs)
HUNYUANDIT_CONTROL = Case("hunyuandit-controlnet", lambda: KeepsControlSamples(**TINY), control_inputs)


class TestHunyuanDiT(ConformanceSuite):
    case = HUNYUANDIT


class TestHunyuanDiTV11Batch(ConformanceSuite):
    case = HUNYUANDIT_V11
    reduced = True


class TestHunyuanDiTControlNet(ConformanceSuite):
    case = HUNYUANDIT_CONTROL
    reduced = True


def test_variant_inputs_change_the_output() -> None:
    # the cases exercise their paths: the text padding, the RoPE, the size condition, the ControlNet samples
    plain = sample_output(HUNYUANDIT)
    unpadded = {k: torch.ones_like(v) for k, v in _masks(1).items()}
    assert not torch.equal(plain, sample_output(HUNYUANDIT, **unpadded))
    assert not torch.equal(plain, sample_output(HUNYUANDIT, image_rotary_emb=None))
    v11 = sample_output(HUNYUANDIT_V11)
    assert not torch.equal(v11, sample_output(HUNYUANDIT_V11, image_meta_size=torch.full((2, 6), 32.0)))
    assert not torch.equal(plain, sample_output(HUNYUANDIT_CONTROL))


def test_the_loop_hands_each_second_half_block_its_own_skip() -> None:
    # What the declaration rests on, on six blocks: the conditioning is one object for every block, but
    # blocks 4 and 5 get a skip each (the outputs of blocks 1 and 0), blocks 2 and 3 none. A chunk would run
    # its later blocks with its first block's skip, or none: so no carry.
    model = hunyuandit_model(num_layers=6)
    seen, returned = record_block_calls(model.blocks)
    with torch.no_grad():
        model(**hunyuandit_inputs(torch.Generator().manual_seed(1)))
    assert [b.skip_linear is not None for b in model.blocks] == [False] * 4 + [True] * 2
    for name in ("temb", "encoder_hidden_states", "image_rotary_emb"):
        assert all(kw[name] is seen[0][name] for kw in seen), name
    assert [kw.get("skip") is None for kw in seen] == [True] * 4 + [False] * 2
    assert seen[4]["skip"] is returned[1] and seen[5]["skip"] is returned[0]
    assert all(kw["hidden_states"] is out for kw, out in zip(seen[1:], returned))


def test_interval_checkpoints_block_by_block_exactly() -> None:
    model = HUNYUANDIT.fresh()
    family = family_for(model)
    assert family.name == "hunyuandit" and not family.supports_interval
    with pytest.warns(GradseamWarning, match="does not support gradient_checkpointing_interval"):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(CHUNKED))
    assert [r.blocks for r in the_plan.regions] == [(i,) for i in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the interval is ignored, with a warning
        report = check_strategy(HUNYUANDIT, CHUNKED, whole=True)
    assert [r.shape for r in report.regions] == ["block"] * 4 and report.saved_ratio < 1


def test_ffn_seam_is_norm3_then_ff_on_its_output_alone() -> None:
    model = HUNYUANDIT.fresh()
    ffn = plan(model, family_for(model), gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.blocks, r.seam) for r in ffn.regions] == [((i,), ("norm3", "ff")) for i in range(4)]
    normed: list[torch.Tensor] = []
    fed: list[tuple] = []
    for block in model.blocks:
        block.norm3.register_forward_hook(lambda _m, _a, out: normed.append(out))
        block.ff.register_forward_pre_hook(lambda _m, a, kw: fed.append((a, kw)), with_kwargs=True)
    with torch.no_grad():
        model(**hunyuandit_inputs(torch.Generator().manual_seed(1)))
    assert len(fed) == 4 and all(a == (out,) and not kw for (a, kw), out in zip(fed, normed))


def test_diffusers_has_no_checkpointing_of_its_own() -> None:
    # gradseam is the only checkpointing path for this model: diffusers refuses its flag
    model = HUNYUANDIT.fresh()
    with pytest.raises(ValueError, match="does not support gradient checkpointing"):
        model.enable_gradient_checkpointing()


# -- the presets at full size ----------------------------------------------------------------------
PRESETS = {"v1.2-1024": (1024, False), "v1.2-1280": (1280, False), "v1.1-1024": (1024, True)}


@functools.cache
def _preset_model(name: str) -> tuple:
    return preset_model("hunyuandit", name)  # on meta; the tests below only read and plan it


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_plan_at_full_size(name: str) -> None:
    family, preset, model = _preset_model(name)
    assert set(family.presets) == set(PRESETS)
    assert family_for(model) is family
    params = set(inspect.signature(HunyuanDiT2DModel.__init__).parameters) - {"self"}
    assert set(preset.config) == params  # every constructor argument, spelled out
    assert 1.49e9 < sum(p.numel() for p in model.parameters()) < 1.52e9
    assert model.config.use_style_cond_and_image_meta_size is PRESETS[name][1]
    block = model.blocks[0]
    assert (len(model.blocks), block.attn1.heads, block.ff.net[0].proj.out_features) == (40, 16, 6144)
    assert [i for i, b in enumerate(model.blocks) if b.skip_linear is not None] == list(range(21, 40))
    for config in ({"gradient_checkpointing": True}, CHUNKED, FFN):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the interval is ignored, with a warning
            the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert [r.blocks for r in the_plan.regions] == [(i,) for i in range(40)]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_inputs_have_the_pipelines_sizes(name: str) -> None:
    _, preset, model = _preset_model(name)
    side, v11 = PRESETS[name]
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 4, side // 8, side // 8) and x["hidden_states"].requires_grad
    assert x["timestep"].dtype == torch.bfloat16  # the model takes temb's dtype from the timestep
    assert x["encoder_hidden_states"].shape == (1, 77, 1024)
    assert x["encoder_hidden_states_t5"].shape == (1, 256, 2048)
    assert x["text_embedding_mask"].shape == (1, 77) and x["text_embedding_mask_t5"].shape == (1, 256)
    tokens = (side // 16) ** 2
    assert [t.shape for t in x["image_rotary_emb"]] == [(tokens, 88)] * 2
    assert ("image_meta_size" in x, "style" in x) == (v11, v11)
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 1024, **preset.inputs)
    assert fewer["hidden_states"].shape == (1, 4, 64, 64)


def test_rope_grid_sits_where_the_pipeline_puts_it() -> None:
    # HunyuanDiTPipeline's get_resize_crop_region_for_grid on its supported shapes (height, width), 16-pixel
    # patches in a 32-patch base square: the values it returns, to the patch
    expected = {
        (1024, 1024): ((0, 0), (32, 32)), (1280, 1280): ((0, 0), (32, 32)),
        (1024, 768): ((0, 4), (32, 28)), (1152, 864): ((0, 4), (32, 28)), (1280, 960): ((0, 4), (32, 28)),
        (768, 1024): ((4, 0), (28, 32)), (864, 1152): ((4, 0), (28, 32)), (960, 1280): ((4, 0), (28, 32)),
        (1280, 768): ((0, 6), (32, 25)), (768, 1280): ((6, 0), (25, 32)),
    }
    assert {shape: crop_region(shape[0] // 16, shape[1] // 16, 32) for shape in expected} == expected


@pytest.mark.parametrize(("case", "preset"), [(HUNYUANDIT, "v1.2-1024"), (HUNYUANDIT_V11, "v1.1-1024")],
                         ids=lambda v: getattr(v, "name", v))
def test_preset_input_builder_runs_the_model(case: Case, preset: str) -> None:
    family = gradseam.registry.REGISTRY.get("hunyuandit")
    model = case.fresh()
    x = family.presets[preset].make_inputs(model, "cpu", torch.float32, None, height=32, width=64)
    assert x["hidden_states"].shape == (1, 4, 4, 8)
    out = model(**x).sample
    assert out.shape == (1, 8, 4, 8)  # learn_sigma: twice the channels
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


@pytest.mark.parametrize(("config", "preset"), [(TINY, "v1.2-1024"), (TINY_V11, "v1.1-1024")],
                         ids=["v12", "v11"])
def test_bench_workload_truncates_steps_and_patches_exactly(config: dict, preset: str) -> None:
    """`gradseam bench --family hunyuandit --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload("hunyuandit", config, {"height": 32, "width": 32}, preset=preset, sequence=4)
