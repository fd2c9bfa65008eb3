"""HunyuanImage 2.1 (HunyuanImageTransformer2DModel) through the conformance kit, plus its presets.

The base model's case (ByT5 glyph states and padded prompts on both encoders, so the model
reorders the text stream before the trunk) runs the kit's whole matrix. The distilled model
(guidance embedding and MeanFlow ``timestep_r``) and the refiner (a 3-D patch over one latent
frame, no ByT5) run a reduced matrix. Then: the chunks run whole, the optional inputs reach the
output, and the presets build on the meta device and plan at full size.
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

# Head width 8 split 4 + 4 over (row, column) for RoPE; 3 dual-stream, 4 single-stream, 2 refiner blocks.
_TINY = {
    "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 3,
    "num_single_layers": 4, "num_refiner_layers": 2, "text_embed_dim": 12, "rope_axes_dim": (4, 4),
}
_TINY_REFINER = {**_TINY, "in_channels": 8, "patch_size": (1, 1, 1), "rope_axes_dim": (2, 2, 4),
                 "guidance_embeds": True, "use_meanflow": True}
LISTS = ("context_embedder.token_refiner.refiner_blocks", "transformer_blocks", "single_transformer_blocks")


def _model(byt5: bool = True, **overrides):
    def build():
        from diffusers import HunyuanImageTransformer2DModel
        from diffusers.models.transformers.transformer_hunyuanimage import HunyuanImageByT5TextProjection

        model = HunyuanImageTransformer2DModel(**{**_TINY, **overrides}, text_embed_2_dim=10 if byt5 else None)
        if byt5:
            # upstream fixes the ByT5 projection's hidden width at 2048 (nearly all of the tiny model's
            # parameters); the same class 16 wide keeps steps fast. It runs before the trunk, in no region.
            model.context_embedder_2 = HunyuanImageByT5TextProjection(10, 16, 16)
        return model

    return build


def hunyuanimage_inputs(g: torch.Generator) -> dict:
    # 2 x 4 latent tokens; 6 Qwen2.5-VL tokens (2 padding) and 4 ByT5 tokens (1 padding), batch of 2 with
    # different padding, so the model's text reordering differs per sample
    mask = torch.ones(2, 6, dtype=torch.int64)
    mask[0, 4:] = 0
    mask[1, 5:] = 0
    mask_2 = torch.ones(2, 4, dtype=torch.int64)
    mask_2[1, 3:] = 0
    return {
        "hidden_states": randn(g, 2, 4, 2, 4, grad=True),
        "timestep": torch.tensor([500.0, 300.0]),
        "encoder_hidden_states": randn(g, 2, 6, 12, grad=True),
        "encoder_attention_mask": mask,
        "encoder_hidden_states_2": randn(g, 2, 4, 10, grad=True),
        "encoder_attention_mask_2": mask_2,
    }


def distilled_inputs(g: torch.Generator) -> dict:
    return {**hunyuanimage_inputs(g), "guidance": torch.tensor([3250.0, 3250.0]),
            "timestep_r": torch.tensor([400.0, 200.0])}


def refiner_inputs(g: torch.Generator) -> dict:
    # one latent frame of 2 x 4; the noisy and the conditioning latents stacked on channels (4 + 4)
    return {
        "hidden_states": randn(g, 1, 8, 1, 2, 4, grad=True),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": randn(g, 1, 6, 12, grad=True),
        "encoder_attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]]),
        "guidance": torch.tensor([3250.0]),
    }


HUNYUANIMAGE = Case("hunyuanimage", _model(), hunyuanimage_inputs)
HUNYUANIMAGE_DISTILLED = Case("hunyuanimage-distilled", _model(guidance_embeds=True, use_meanflow=True),
                              distilled_inputs)
HUNYUANIMAGE_REFINER = Case("hunyuanimage-refiner", _model(byt5=False, **_TINY_REFINER), refiner_inputs)


class TestHunyuanImage(ConformanceSuite):
    case = HUNYUANIMAGE


class TestHunyuanImageDistilled(ConformanceSuite):
    case = HUNYUANIMAGE_DISTILLED
    reduced = True


class TestHunyuanImageRefiner(ConformanceSuite):
    case = HUNYUANIMAGE_REFINER
    reduced = True


# -- the chunks chain, the inputs matter --------------------------------------------------------


@pytest.mark.parametrize("case", [HUNYUANIMAGE, HUNYUANIMAGE_DISTILLED, HUNYUANIMAGE_REFINER], ids=lambda c: c.name)
def test_every_chunk_of_every_list_runs_whole(case: Case) -> None:
    assert chunks_served_whole(case, CHUNKED) == {
        "refiner_blocks[0, 1]": True, "transformer_blocks[0, 1]": True,
        "single_transformer_blocks[0, 1]": True, "single_transformer_blocks[2, 3]": True,
    }


def _output(case: Case, **changes) -> torch.Tensor:
    torch.manual_seed(case.seed)
    model = case.build()
    with torch.no_grad():
        return model(**{**case.inputs(torch.Generator().manual_seed(1)), **changes})[0]


def test_glyph_states_padding_guidance_and_meanflow_reach_the_output() -> None:
    report = check_strategy(HUNYUANIMAGE, CHUNKED, whole=True)
    assert report.patched.input_grads["encoder_hidden_states_2"].abs().sum() > 0  # ByT5, through the chunks
    plain = _output(HUNYUANIMAGE)
    assert not torch.equal(plain, _output(HUNYUANIMAGE, encoder_attention_mask=torch.ones(2, 6, dtype=torch.int64)))
    assert not torch.equal(plain, _output(HUNYUANIMAGE, encoder_attention_mask_2=torch.ones(2, 4, dtype=torch.int64)))
    distilled = _output(HUNYUANIMAGE_DISTILLED)
    assert not torch.equal(distilled, _output(HUNYUANIMAGE_DISTILLED, guidance=torch.tensor([1000.0, 1000.0])))
    assert not torch.equal(distilled, _output(HUNYUANIMAGE_DISTILLED, timestep_r=None))


def test_regions() -> None:
    for case in (HUNYUANIMAGE, HUNYUANIMAGE_REFINER):
        torch.manual_seed(0)
        model = case.build()
        family = family_for(model)
        assert family.name == "hunyuanimage"
        ffn = plan(model, family, gradseam.CheckpointConfig.coerce(
            gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn"))
        assert [r.seam for r in ffn.regions if r.blocks == (0,)] == [
            ("norm2", "ff"), ("ff",), ("ff_context",), ("proj_mlp", "act_mlp")
        ]


# -- presets at full size -----------------------------------------------------------------------

PRESETS = ("2048", "1024", "distilled-2048", "refiner-2048")


def _meta_model(preset):
    from diffusers import HunyuanImageTransformer2DModel

    with torch.device("meta"):
        return HunyuanImageTransformer2DModel(**preset.config)


@pytest.mark.parametrize("name", PRESETS)
def test_presets_plan_at_full_size(name: str) -> None:
    family = gradseam.registry.REGISTRY.get("hunyuanimage")
    assert set(family.presets) == set(PRESETS)
    model = _meta_model(family.presets[name])
    assert family_for(model) is family
    expected = {LISTS[0]: 2, LISTS[1]: 20, LISTS[2]: 40}
    for config, regions in (({"gradient_checkpointing": True}, 62), (CHUNKED, 31),
                            ({"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}, 82)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert blocks_per_list(the_plan.regions) == expected
        assert len(the_plan.regions) == regions


def test_preset_inputs_have_the_published_sizes() -> None:
    family = gradseam.registry.REGISTRY.get("hunyuanimage")
    base = family.presets["2048"]
    model = _meta_model(base)
    block = model.transformer_blocks[0]
    assert (block.attn.heads, block.ff.net[0].proj.out_features) == (28, 4 * 3584)
    x = base.make_inputs(model, "meta", torch.bfloat16, **base.inputs)
    assert x["hidden_states"].shape == (1, 64, 64, 64) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 1000, 3584) and x["encoder_hidden_states_2"].shape == (1, 128, 1472)
    assert "guidance" not in x and "timestep_r" not in x
    assert base.make_inputs(model, "meta", torch.bfloat16, 1024, **base.inputs)["hidden_states"].shape == (1, 64, 32, 32)
    small = family.presets["1024"]
    assert small.make_inputs(model, "meta", torch.bfloat16, **small.inputs)["hidden_states"].shape == (1, 64, 32, 32)
    distilled = family.presets["distilled-2048"]
    x = distilled.make_inputs(_meta_model(distilled), "meta", torch.bfloat16, **distilled.inputs)
    assert x["guidance"].shape == x["timestep_r"].shape == (1,)
    refiner = family.presets["refiner-2048"]
    refiner_model = _meta_model(refiner)
    assert refiner_model.transformer_blocks[0].attn.heads == 26 and refiner_model.context_embedder_2 is None
    x = refiner.make_inputs(refiner_model, "meta", torch.bfloat16, **refiner.inputs)
    assert x["hidden_states"].shape == (1, 128, 1, 128, 128) and x["encoder_hidden_states"].shape == (1, 256, 3584)
    assert "encoder_hidden_states_2" not in x


def test_refiner_preset_inputs_run_through_the_full_width_model_on_meta() -> None:
    # (the base model's ByT5 reordering indexes by mask values, which the meta device cannot run)
    from diffusers import HunyuanImageTransformer2DModel

    preset = gradseam.registry.REGISTRY.get("hunyuanimage").presets["refiner-2048"]
    with torch.device("meta"):
        model = HunyuanImageTransformer2DModel(**preset.config, num_layers=1, num_single_layers=1,
                                               num_refiner_layers=1)
    out = model(**preset.make_inputs(model, "meta", torch.float32, **preset.inputs), return_dict=False)[0]
    assert out.shape == (1, 64, 1, 128, 128)


@pytest.mark.parametrize(("case", "preset", "shape"), [
    (HUNYUANIMAGE, "2048", (1, 4, 2, 2)), (HUNYUANIMAGE_DISTILLED, "distilled-2048", (1, 4, 2, 2)),
    (HUNYUANIMAGE_REFINER, "refiner-2048", (1, 4, 1, 2, 2)),
], ids=lambda v: v.name if isinstance(v, Case) else "")
def test_preset_input_builder_runs_the_model(case: Case, preset: str, shape: tuple[int, ...]) -> None:
    family = gradseam.registry.REGISTRY.get("hunyuanimage")
    torch.manual_seed(0)
    model = case.build()
    inputs = family.presets[preset].make_inputs(model, "cpu", torch.float32, 4, text_tokens=5, byt5_tokens=3)
    out = model(**inputs, return_dict=False)[0]
    assert out.shape == shape
    out.square().mean().backward()
    assert inputs["hidden_states"].grad is not None
