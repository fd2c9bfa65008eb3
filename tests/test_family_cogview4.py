"""CogView4: a tiny deterministic model through the conformance kit (text and image as two streams of one
block, the shared ``ff`` called once per stream), input variants (a batch of two at different timesteps
and sizes on a non-square latent, with ``attention_kwargs``; the training script's padded-text
``attention_mask``; the training attention processor with its masks through ``attention_kwargs``; the
Control model's extra channels), interval chunks that chain both streams, the loop handing every block
the same conditioning, and the presets at full size with their real input builder."""

from __future__ import annotations

import inspect

import pytest
import torch
from family_checks import (
    assert_plans_cover_every_block,
    check_chunks_run_whole,
    record_block_calls,
    sample_output,
)

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

TEXT, TEXT_DIM, SIDE = 6, 12, 4  # GLM tokens, GLM width, latent side (2x2 patches: 4 image tokens)

# 2 heads x 8 = 16 wide (the 2-D RoPE splits a head 4 + 4 over rows and columns), 4 blocks.
TINY = dict(
    patch_size=2, in_channels=4, out_channels=4, num_layers=4, attention_head_dim=8, num_attention_heads=2,
    text_embed_dim=TEXT_DIM, time_embed_dim=8, condition_dim=4,
)
TINY_CONTROL = dict(TINY, in_channels=8)


def cogview4_model(**config):
    from diffusers import CogView4Transformer2DModel

    return CogView4Transformer2DModel(**config)


def _sizes(batch: int, height: int, width: int) -> dict:
    # original_size / target_size / crop_coords as the pipeline passes them: (batch, 2), the text dtype
    size = torch.tensor([[height, width]], dtype=torch.float32).repeat(batch, 1)
    return {"original_size": size, "target_size": size.clone(), "crop_coords": torch.zeros(batch, 2)}


def cogview4_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": randn(g, 1, 4, SIDE, SIDE, grad=True),
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM, grad=True),
        "timestep": torch.tensor([500.0]),
        **_sizes(1, 32, 32),
    }


def cogview4_batch_inputs(g: torch.Generator) -> dict:
    # Two samples at their own timesteps and size conditions (temb differs per sample), a 4x8 latent (2x4
    # patches: a non-square RoPE grid), and attention_kwargs as a pipeline passes them (the LoRA-scale
    # decorator copies the dict once and pops "scale"; every block gets that copy).
    sizes = _sizes(2, 32, 64)
    sizes["original_size"] = torch.tensor([[32.0, 64.0], [48.0, 96.0]])
    sizes["crop_coords"] = torch.tensor([[0.0, 0.0], [8.0, 16.0]])
    return {
        "hidden_states": randn(g, 2, 4, SIDE, 2 * SIDE, grad=True),
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
        "timestep": torch.tensor([120.0, 870.0]),
        "attention_kwargs": {"scale": 1.0},
        **sizes,
    }


def _text_mask(batch: int) -> torch.Tensor:
    # the pipeline left-pads prompts: the second sample's first two text tokens are padding
    mask = torch.ones(batch, TEXT)
    mask[-1, :2] = 0
    return mask


def cogview4_mask_inputs(g: torch.Generator) -> dict:
    # diffusers' CogView4 Control training script passes the tokenizer's attention mask, (batch, text)
    return {
        "hidden_states": randn(g, 2, 4, SIDE, SIDE, grad=True),
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
        "timestep": torch.tensor([300.0, 700.0]),
        "attention_mask": _text_mask(2),
        **_sizes(2, 32, 32),
    }


def training_processor_model():
    from diffusers.models.transformers.transformer_cogview4 import CogView4TrainingAttnProcessor

    model = cogview4_model(**TINY)
    for block in model.transformer_blocks:  # the model has no set_attn_processor
        block.attn1.set_processor(CogView4TrainingAttnProcessor())
    return model


def cogview4_training_inputs(g: torch.Generator) -> dict:
    # CogView4TrainingAttnProcessor: int32 text and latent masks through attention_kwargs (no packing)
    latent = torch.ones(2, SIDE * SIDE // 4, dtype=torch.int32)
    latent[-1, -1] = 0
    return {
        "hidden_states": randn(g, 2, 4, SIDE, SIDE, grad=True),
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
        "timestep": torch.tensor([300.0, 700.0]),
        "attention_kwargs": {"text_attn_mask": _text_mask(2).to(torch.int32), "latent_attn_mask": latent},
        **_sizes(2, 32, 32),
    }


def cogview4_control_inputs(g: torch.Generator) -> dict:
    # CogView4-Control: the noisy and the control latents concatenated on the channels
    return {**cogview4_inputs(g), "hidden_states": randn(g, 1, 8, SIDE, SIDE, grad=True)}


COGVIEW4 = Case("cogview4", lambda: cogview4_model(**TINY), cogview4_inputs)
COGVIEW4_BATCH = Case("cogview4-batch", lambda: cogview4_model(**TINY), cogview4_batch_inputs)
COGVIEW4_MASK = Case("cogview4-mask", lambda: cogview4_model(**TINY), cogview4_mask_inputs)
COGVIEW4_TRAINING = Case("cogview4-training-processor", training_processor_model, cogview4_training_inputs)
COGVIEW4_CONTROL = Case("cogview4-control", lambda: cogview4_model(**TINY_CONTROL), cogview4_control_inputs)
CASES = [COGVIEW4, COGVIEW4_BATCH, COGVIEW4_MASK, COGVIEW4_TRAINING, COGVIEW4_CONTROL]


class TestCogView4(ConformanceSuite):
    case = COGVIEW4


class TestCogView4Batch(ConformanceSuite):
    case = COGVIEW4_BATCH
    reduced = True


class TestCogView4Mask(ConformanceSuite):
    case = COGVIEW4_MASK
    reduced = True


class TestCogView4TrainingProcessor(ConformanceSuite):
    case = COGVIEW4_TRAINING
    reduced = True


class TestCogView4Control(ConformanceSuite):
    case = COGVIEW4_CONTROL
    reduced = True


CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_interval_chunks_chain_both_streams(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back): both chunks must be served whole, and the
    # text stream, which leaves the last block unused, must still get its gradient through them.
    report = check_chunks_run_whole(case, CHUNKED, ["transformer_blocks[0, 1]", "transformer_blocks[2, 3]"])
    assert report.saved_ratio < 1
    assert report.patched.input_grads["encoder_hidden_states"].abs().sum() > 0


@pytest.mark.parametrize("case", [COGVIEW4_BATCH, COGVIEW4_MASK, COGVIEW4_TRAINING], ids=lambda c: c.name)
def test_the_loop_hands_every_block_the_same_conditioning(case: Case) -> None:
    # What the carry relies on: temb, the RoPE tuple, the mask and attention_kwargs are one object each
    # for every block (the loop passes them positionally); the streams are what the previous block returned.
    model = case.fresh()
    seen, returned = record_block_calls(model.transformer_blocks)
    with torch.no_grad():
        model(**case.inputs(torch.Generator().manual_seed(1)))
    assert len(seen) == 4
    for name in ("temb", "image_rotary_emb", "attention_mask", "attention_kwargs"):
        assert all(kw[name] is seen[0][name] for kw in seen), (case.name, name)
    assert seen[0]["temb"].shape[0] == 2 and not torch.equal(seen[0]["temb"][0], seen[0]["temb"][1])
    assert (seen[0]["attention_mask"] is None) == (case is not COGVIEW4_MASK)
    for before, kw in zip(returned, seen[1:]):
        assert kw["hidden_states"] is before[0] and kw["encoder_hidden_states"] is before[1]


def test_variant_inputs_change_the_output() -> None:
    # The variants exercise their paths: the text mask, the training processor's masks, the size
    # conditions and the per-sample timesteps all matter.
    assert not torch.equal(sample_output(COGVIEW4_MASK), sample_output(COGVIEW4_MASK, attention_mask=None))
    assert not torch.equal(sample_output(COGVIEW4_TRAINING), sample_output(COGVIEW4_TRAINING, attention_kwargs=None))
    batch = sample_output(COGVIEW4_BATCH)
    assert not torch.equal(batch, sample_output(COGVIEW4_BATCH, timestep=torch.tensor([120.0, 120.0])))
    assert not torch.equal(batch, sample_output(COGVIEW4_BATCH, crop_coords=torch.zeros(2, 2)))


def test_ff_is_one_region_per_stream() -> None:
    # The seam's module is called twice per block (image stream, then text stream): each call is a region
    # of its own, both run, and the -ffn step is exact.
    family = family_for(COGVIEW4.fresh())
    assert family.name == "cogview4"
    ffn = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}
    the_plan = plan(COGVIEW4.fresh(), family, gradseam.CheckpointConfig.coerce(ffn))
    assert [(r.blocks, r.seam) for r in the_plan.regions] == [((i,), ("ff",)) for i in range(4)]
    report = check_strategy(COGVIEW4, ffn, whole=True)
    ff = [r for r in report.regions if r.shape == "ffn"]
    # counted over one step: two calls (image stream, text stream), each computed as its own region
    assert len(ff) == 4 and all(r.calls == (2,) and r.runs == 2 and r.whole for r in ff), ff


# -- the presets at full size ----------------------------------------------------------------------
PRESETS = {"6b-1024": 16, "6b-control-1024": 32}  # in_channels


def _preset_model(name: str):
    return preset_model("cogview4", name)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_plan_at_full_size(name: str) -> None:
    from diffusers import CogView4Transformer2DModel

    family, preset, model = _preset_model(name)
    assert set(family.presets) == set(PRESETS)
    assert family_for(model) is family
    params = set(inspect.signature(CogView4Transformer2DModel.__init__).parameters) - {"self"}
    assert set(preset.config) == params  # every constructor argument, spelled out
    assert 6.0e9 < sum(p.numel() for p in model.parameters()) < 6.5e9
    block = model.transformer_blocks[0]
    assert (len(model.transformer_blocks), block.attn1.heads, block.ff.net[0].proj.out_features) == (28, 32, 16384)
    assert model.patch_embed.proj.in_features == PRESETS[name] * 4
    assert_plans_cover_every_block(model, family, 28, (
        ({"gradient_checkpointing": True}, 28), (CHUNKED, 14),
        ({"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}, 28)
    ))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_inputs_have_the_pipelines_sizes(name: str) -> None:
    _, preset, model = _preset_model(name)
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, PRESETS[name], 128, 128) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 224, 4096)
    assert x["timestep"].shape == (1,)
    assert [x[k].shape for k in ("original_size", "target_size", "crop_coords")] == [(1, 2)] * 3
    assert all(x[k].dtype == torch.bfloat16 for k in ("original_size", "target_size", "crop_coords"))
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 1024, **preset.inputs)
    assert fewer["hidden_states"].shape == (1, PRESETS[name], 64, 64)


def test_preset_sizes_are_the_pipelines() -> None:
    # original_size / target_size / crop_coords carry the picture's values, as CogView4Pipeline passes them
    _, preset, model = _preset_model("6b-1024")
    x = preset.make_inputs(model, "cpu", torch.float32, None, height=768, width=1360)
    assert x["hidden_states"].shape == (1, 16, 96, 170)
    assert x["original_size"].tolist() == x["target_size"].tolist() == [[768.0, 1360.0]]
    assert x["crop_coords"].tolist() == [[0.0, 0.0]]
    x = preset.make_inputs(model, "cpu", torch.float32, 4096, **preset.inputs)
    assert x["original_size"].tolist() == [[1024.0, 1024.0]]


@pytest.mark.parametrize(("case", "preset"), [(COGVIEW4, "6b-1024"), (COGVIEW4_CONTROL, "6b-control-1024")],
                         ids=lambda v: getattr(v, "name", v))
def test_preset_input_builder_runs_the_model(case: Case, preset: str) -> None:
    family = gradseam.registry.REGISTRY.get("cogview4")
    model = case.fresh()
    x = family.presets[preset].make_inputs(model, "cpu", torch.float32, None, height=32, width=32,
                                           text_tokens=TEXT)
    assert x["encoder_hidden_states"].shape == (1, TEXT, TEXT_DIM)
    out = model(**x).sample
    assert out.shape == (1, 4, SIDE, SIDE)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


@pytest.mark.parametrize(("config", "preset"), [(TINY, "6b-1024"), (TINY_CONTROL, "6b-control-1024")],
                         ids=["6b", "control"])
def test_bench_workload_truncates_steps_and_patches_exactly(config: dict, preset: str) -> None:
    """`gradseam bench --family cogview4 --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload("cogview4", config, {"height": 32, "width": 32, "text_tokens": TEXT}, preset=preset,
                         sequence=SIDE * SIDE // 4)
