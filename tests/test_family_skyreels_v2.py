"""SkyReels V2 (SkyReelsV2Transformer3DModel) through the conformance kit, plus its presets.

The main case is diffusion forcing as the DF checkpoints train and sample: one timestep per latent
frame (expanded to a per-token modulation before the trunk) and the fps embedding of the 1.3B DF
model; it runs the kit's whole matrix. The asynchronous mode (``num_frame_per_block > 1``: a
block-causal frame mask for every block's self-attention) and the I2V model (CLIP image tokens
through added K/V projections) run a reduced matrix. Then: the chunks run whole, the inputs really
change the output, and the presets build on the meta device and plan at full size.
"""

from __future__ import annotations

import pytest
import torch
from family_checks import assert_plans_cover_every_block, chunks_served_whole

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

# Five blocks: two chunks and a lone block at interval 2; stride 4 leaves blocks 2 and 3 alone.
_TINY = {
    "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 4, "out_channels": 4,
    "text_dim": 16, "freq_dim": 16, "ffn_dim": 32, "num_layers": 5, "rope_max_seq_len": 32,
}


def _model(**overrides):
    def build():
        from diffusers import SkyReelsV2Transformer3DModel

        return SkyReelsV2Transformer3DModel(**{**_TINY, **overrides})

    return build


def df_inputs(g: torch.Generator, frames: int = 2) -> dict:
    # `frames` latent frames of 2 x 2 patches, each at its own noise level; 6 text tokens; fps flag 1 (24 fps)
    return {
        "hidden_states": randn(g, 1, 4, frames, 4, 4, grad=True),
        "timestep": torch.linspace(900.0, 100.0, frames)[None],
        "encoder_hidden_states": randn(g, 1, 6, 16, grad=True),
        "enable_diffusion_forcing": True,
        "fps": [1],
    }


def causal_inputs(g: torch.Generator) -> dict:
    # asynchronous mode: 4 latent frames in 2 causal blocks of 2, the later block lagging behind
    inputs = df_inputs(g, frames=4)
    inputs["timestep"] = torch.tensor([[200.0, 200.0, 700.0, 700.0]])
    del inputs["fps"]
    return inputs


def i2v_inputs(g: torch.Generator) -> dict:
    # the I2V model: one shared timestep, CLIP image tokens in front of exactly 512 text tokens (the
    # cross-attention splits them off by that count)
    return {
        "hidden_states": randn(g, 1, 4, 2, 4, 4, grad=True),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": randn(g, 1, 512, 16),
        "encoder_hidden_states_image": randn(g, 1, 4, 8, grad=True),
    }


SKYREELS_V2_DF = Case("skyreels-v2-df", _model(inject_sample_info=True), df_inputs)
SKYREELS_V2_CAUSAL = Case("skyreels-v2-causal", _model(num_frame_per_block=2), causal_inputs)
SKYREELS_V2_I2V = Case("skyreels-v2-i2v", _model(image_dim=8, added_kv_proj_dim=16), i2v_inputs)


class TestSkyReelsV2DiffusionForcing(ConformanceSuite):
    case = SKYREELS_V2_DF


class TestSkyReelsV2Causal(ConformanceSuite):
    case = SKYREELS_V2_CAUSAL
    reduced = True


class TestSkyReelsV2I2V(ConformanceSuite):
    case = SKYREELS_V2_I2V
    reduced = True


# -- the chunks chain, the inputs matter --------------------------------------------------------


@pytest.mark.parametrize("case", [SKYREELS_V2_DF, SKYREELS_V2_CAUSAL, SKYREELS_V2_I2V], ids=lambda c: c.name)
def test_every_chunk_runs_whole(case: Case) -> None:
    # the per-token modulation, the causal mask and the image tokens are one object each for all blocks
    assert chunks_served_whole(case, CHUNKED) == {"blocks[0, 1]": True, "blocks[2, 3]": True}


def _output(case: Case, model: torch.nn.Module | None = None, **changes) -> torch.Tensor:
    torch.manual_seed(case.seed)
    model = model or case.build()
    with torch.no_grad():
        return model(**{**case.inputs(torch.Generator().manual_seed(1)), **changes})[0]


def test_per_frame_timesteps_fps_causal_mask_and_image_reach_the_output() -> None:
    plain = _output(SKYREELS_V2_DF)
    assert not torch.equal(plain, _output(SKYREELS_V2_DF, timestep=torch.tensor([[500.0, 500.0]])))
    assert not torch.equal(plain, _output(SKYREELS_V2_DF, fps=[0]))
    # the causal mask: the same weights without it see the later frames from the earlier ones
    causal = _output(SKYREELS_V2_CAUSAL)
    torch.manual_seed(0)
    full = SKYREELS_V2_CAUSAL.build()
    full._set_ar_attention(1)  # what the DF pipeline calls to switch modes
    unmasked = _output(SKYREELS_V2_CAUSAL, full)
    assert not torch.equal(causal[:, :, :2], unmasked[:, :, :2])  # the first block no longer sees the second
    report = check_strategy(SKYREELS_V2_I2V, CHUNKED, whole=True)
    assert report.patched.input_grads["encoder_hidden_states_image"].abs().sum() > 0


def test_regions() -> None:
    torch.manual_seed(0)
    model = SKYREELS_V2_DF.build()
    family = family_for(model)
    assert family.name == "skyreels-v2"
    ffn = plan(model, family, gradseam.CheckpointConfig.coerce(
        gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn"))
    assert [(r.blocks, r.seam) for r in ffn.regions] == [((i,), ("ffn",)) for i in range(5)]
    chunks = plan(model, family, gradseam.CheckpointConfig.coerce(CHUNKED))
    assert [r.blocks for r in chunks.regions] == [(0, 1), (2, 3), (4,)]


# -- presets at full size -----------------------------------------------------------------------

PRESETS = {"df-14b-540p": (40, 40), "df-14b-720p": (40, 40), "df-1.3b-540p": (30, 12)}


def _meta_model(preset):
    from diffusers import SkyReelsV2Transformer3DModel

    with torch.device("meta"):
        return SkyReelsV2Transformer3DModel(**preset.config)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_plan_at_full_size(name: str) -> None:
    family = gradseam.registry.REGISTRY.get("skyreels-v2")
    assert set(family.presets) == set(PRESETS)
    model = _meta_model(family.presets[name])
    assert family_for(model) is family
    depth, heads = PRESETS[name]
    assert len(model.blocks) == depth and model.blocks[0].attn1.heads == heads
    assert_plans_cover_every_block(model, family, depth, (
        ({"gradient_checkpointing": True}, depth), (CHUNKED, depth // 2),
        ({"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}, depth)
    ))


def test_preset_inputs_have_the_published_sizes() -> None:
    family = gradseam.registry.REGISTRY.get("skyreels-v2")
    preset = family.presets["df-14b-540p"]
    model = _meta_model(preset)
    x = preset.make_inputs(model, "meta", torch.bfloat16, **preset.inputs)
    assert x["hidden_states"].shape == (1, 16, 25, 68, 120) and x["hidden_states"].requires_grad
    assert x["timestep"].shape == (1, 25) and x["enable_diffusion_forcing"] is True and "fps" not in x
    assert x["encoder_hidden_states"].shape == (1, 512, 4096)
    hd = family.presets["df-14b-720p"]
    assert hd.make_inputs(model, "meta", torch.bfloat16, **hd.inputs)["hidden_states"].shape == (1, 16, 31, 90, 160)
    small = family.presets["df-1.3b-540p"]
    x = small.make_inputs(_meta_model(small), "meta", torch.bfloat16, 2 * 2040, **small.inputs)
    assert x["hidden_states"].shape[2] == 2 and x["timestep"].shape == (1, 2) and x["fps"] == [1]


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_inputs_run_through_the_full_width_model_on_meta(name: str) -> None:
    # per-frame timesteps expanded to every token at full size: the full-width model, one block, on meta
    from diffusers import SkyReelsV2Transformer3DModel

    preset = gradseam.registry.REGISTRY.get("skyreels-v2").presets[name]
    with torch.device("meta"):
        model = SkyReelsV2Transformer3DModel(**{**preset.config, "num_layers": 1})
    x = preset.make_inputs(model, "meta", torch.float32, **preset.inputs)
    assert model(**x, return_dict=False)[0].shape == x["hidden_states"].shape


@pytest.mark.parametrize("case", [SKYREELS_V2_DF, SKYREELS_V2_CAUSAL], ids=lambda c: c.name)
def test_preset_input_builder_runs_the_model(case: Case) -> None:
    family = gradseam.registry.REGISTRY.get("skyreels-v2")
    torch.manual_seed(0)
    model = case.build()
    inputs = family.presets["df-1.3b-540p"].make_inputs(model, "cpu", torch.float32, frames=13, height=32,
                                                        width=32, text_tokens=6)
    out = model(**inputs, return_dict=False)[0]
    assert out.shape == (1, 4, 4, 4, 4)
    out.square().mean().backward()
    assert inputs["hidden_states"].grad is not None
