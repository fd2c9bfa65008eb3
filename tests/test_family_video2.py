"""HunyuanVideo 1.5, LTX-Video 0.9 and Wan VACE through the conformance kit, plus their presets.

Each family gets a plain tiny case with the kit's whole matrix (exact outputs and every parameter
and input gradient for ``torch`` / ``torch-ffn`` x interval x stride, kept attention, the offload
backends through the engine's CPU test mode, ``no_grad``, refusals) and a case with its optional
inputs (padded prompts, image conditioning, per-token timesteps, VACE control scales) on a reduced
matrix. The presets must build on the meta device and plan every block at full size.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import gradseam
from gradseam.errors import GradseamWarning
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_bench_workload,
    check_strategy,
    randn,
    run_step,
)

# -- HunyuanVideo 1.5 ---------------------------------------------------------------------------
# Head width 8 split 2 + 2 + 4 over (frame, row, column) for RoPE.
_HV15_TINY = {
    "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 5,
    "num_refiner_layers": 3, "text_embed_dim": 12, "text_embed_2_dim": 10, "image_embed_dim": 8,
    "rope_axes_dim": (2, 2, 4),
}


def _hv15_model(**overrides):
    def build():
        from diffusers import HunyuanVideo15Transformer3DModel
        from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15ByT5TextProjection

        model = HunyuanVideo15Transformer3DModel(**{**_HV15_TINY, **overrides})
        # upstream fixes the ByT5 projection's hidden width at 2048 (4M of the 4.3M parameters);
        # the same class 16 wide keeps every step fast. It runs before the blocks, outside any region.
        model.context_embedder_2 = HunyuanVideo15ByT5TextProjection(10, 16, 16)
        return model

    return build


def hv15_inputs(g: torch.Generator, batch: int = 1) -> dict:
    # 2 latent frames x 2 x 2 video tokens, 6 MLLM + 4 ByT5 + 3 vision tokens; T2V: image_embeds all zero
    return {
        "hidden_states": randn(g, batch, 4, 2, 2, 2, grad=True),
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": randn(g, batch, 6, 12, grad=True),
        "encoder_attention_mask": torch.ones(batch, 6, dtype=torch.int64),
        "encoder_hidden_states_2": randn(g, batch, 4, 10, grad=True),
        "encoder_attention_mask_2": torch.ones(batch, 4, dtype=torch.int64),
        "image_embeds": torch.zeros(batch, 3, 8),
    }


def hv15_i2v_inputs(g: torch.Generator) -> dict:
    # I2V with SigLIP states, two padded prompts, a timestep each and the MeanFlow reference timestep
    x = hv15_inputs(g, batch=2)
    x["encoder_attention_mask"][1, 4:] = 0
    x["encoder_attention_mask_2"][0, 3:] = 0
    x["image_embeds"] = randn(g, 2, 3, 8, grad=True)
    x["timestep"] = torch.tensor([500.0, 200.0])
    x["timestep_r"] = torch.tensor([300.0, 100.0])
    return x


HV15 = Case("hunyuanvideo15", _hv15_model(), hv15_inputs)
HV15_I2V = Case("hunyuanvideo15-i2v", _hv15_model(use_meanflow=True), hv15_i2v_inputs)


class TestHunyuanVideo15(ConformanceSuite):
    case = HV15


class TestHunyuanVideo15I2V(ConformanceSuite):
    case = HV15_I2V
    reduced = True


# -- LTX-Video 0.9 ------------------------------------------------------------------------------
_LTXV_TINY = {
    "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8,
    "cross_attention_dim": 16, "num_layers": 5, "caption_channels": 12,
}


def _ltxv_model():
    from diffusers import LTXVideoTransformer3DModel

    return LTXVideoTransformer3DModel(**_LTXV_TINY)


def ltxv_inputs(g: torch.Generator) -> dict:
    # 2 latent frames x 2 x 2 packed video tokens, 6 text tokens, RoPE grid from the sizes
    return {
        "hidden_states": randn(g, 1, 8, 4, grad=True),
        "encoder_hidden_states": randn(g, 1, 6, 12, grad=True),
        "timestep": torch.tensor([500.0]),
        "encoder_attention_mask": torch.ones(1, 6, dtype=torch.int64),
        "num_frames": 2,
        "height": 2,
        "width": 2,
        "rope_interpolation_scale": (8 / 25, 32, 32),
    }


def ltxv_conditioned_inputs(g: torch.Generator) -> dict:
    # The condition pipeline's way: a timestep per token (the clean conditioning frame at 0), explicit
    # video_coords instead of sizes, and a padded second prompt.
    coords = torch.stack(torch.meshgrid(*(torch.arange(2.0),) * 3, indexing="ij")).reshape(1, 3, 8)
    mask = torch.ones(2, 6, dtype=torch.int64)
    mask[1, 4:] = 0
    timestep = torch.full((2, 8), 700.0)
    timestep[:, :4] = 0.0  # first latent frame: the conditioning image, not noised
    return {
        "hidden_states": randn(g, 2, 8, 4, grad=True),
        "encoder_hidden_states": randn(g, 2, 6, 12, grad=True),
        "timestep": timestep,
        "encoder_attention_mask": mask,
        "video_coords": coords.repeat(2, 1, 1) * torch.tensor([1 / 25, 32.0, 32.0])[None, :, None],
    }


LTXV = Case("ltxvideo", _ltxv_model, ltxv_inputs)
LTXV_CONDITIONED = Case("ltxvideo-conditioned", _ltxv_model, ltxv_conditioned_inputs)


class TestLTXVideo(ConformanceSuite):
    case = LTXV


class TestLTXVideoConditioned(ConformanceSuite):
    case = LTXV_CONDITIONED
    reduced = True


# -- Wan VACE -----------------------------------------------------------------------------------
# Six trunk blocks, control hints after blocks 0, 2 and 4 (the 1.3B layout: every second block),
# so three control blocks: an interval of 2 gives the control list one chunk and one single block.
_VACE_TINY = {
    "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 4, "out_channels": 4,
    "text_dim": 16, "freq_dim": 16, "ffn_dim": 32, "num_layers": 6, "rope_max_seq_len": 32,
    "vace_layers": [0, 2, 4], "vace_in_channels": 6,
}


def _vace_model():
    from diffusers import WanVACETransformer3DModel

    return WanVACETransformer3DModel(**_VACE_TINY)


def vace_inputs(g: torch.Generator) -> dict:
    # 2 latent frames x 2 x 2 patches = 8 video tokens, the control video just as long
    return {
        "hidden_states": randn(g, 1, 4, 2, 4, 4, grad=True),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": randn(g, 1, 6, 16, grad=True),
        "control_hidden_states": randn(g, 1, 6, 2, 4, 4, grad=True),
    }


def vace_scaled_inputs(g: torch.Generator) -> dict:
    # Two samples, a control video one latent frame short (the model pads its tokens with zeros),
    # and a per-layer context scale that itself receives a gradient
    return {
        "hidden_states": randn(g, 2, 4, 2, 4, 4, grad=True),
        "timestep": torch.tensor([500, 200]),
        "encoder_hidden_states": randn(g, 2, 6, 16, grad=True),
        "control_hidden_states": randn(g, 2, 6, 1, 4, 4, grad=True),
        "control_hidden_states_scale": torch.tensor([1.0, 0.5, 0.8]).requires_grad_(),
    }


VACE = Case("wan-vace", _vace_model, vace_inputs)
VACE_SCALED = Case("wan-vace-scaled", _vace_model, vace_scaled_inputs)


class TestWanVACE(ConformanceSuite):
    case = VACE


class TestWanVACEScaled(ConformanceSuite):
    case = VACE_SCALED
    reduced = True


# -- what the suites cannot see ------------------------------------------------------------------

CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}


def _chunks(case: Case) -> dict[str, bool]:
    """Each chunk of an interval-2 step, and whether it fell back."""
    torch.manual_seed(case.seed)
    model = case.build()
    with gradseam.patch(model, CHUNKED) as handle:
        run_step(model, case)
        return {f"{r.list_path}{list(r.blocks)}": bool(r.fallbacks) for r in handle.regions() if r.shape == "chunk"}


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (
            HV15_I2V,
            {
                "context_embedder.token_refiner.refiner_blocks[0, 1]": False,
                "transformer_blocks[0, 1]": False,
                "transformer_blocks[2, 3]": False,
            },
        ),
        (LTXV_CONDITIONED, {"transformer_blocks[0, 1]": False, "transformer_blocks[2, 3]": False}),
        (VACE_SCALED, {"vace_blocks[0, 1]": False}),  # the trunk has no carry: no chunks there
    ],
    ids=lambda v: v.name if isinstance(v, Case) else "",
)
def test_chunks_run_whole_with_optional_inputs(case, expected):
    # A wrong Carry would still be exact (the chunk falls back), so parity alone cannot tell.
    assert _chunks(case) == expected


def test_hv15_optional_inputs_reach_the_blocks():
    # The I2V case's extras must matter: the vision states get a gradient through the chunked
    # trunk, and dropping padding, image and MeanFlow inputs changes the output.
    report = check_strategy(HV15_I2V, CHUNKED)
    assert report.patched.input_grads["image_embeds"].abs().sum() > 0
    plain = Case("hv15-plain", HV15_I2V.build, lambda g: {**hv15_i2v_inputs(g), **_hv15_plain_extras()})
    torch.manual_seed(HV15_I2V.seed)
    assert not torch.equal(run_step(plain.build(), plain).outputs[0], report.reference.outputs[0])


def _hv15_plain_extras() -> dict:
    return {
        "encoder_attention_mask": torch.ones(2, 6, dtype=torch.int64),
        "encoder_attention_mask_2": torch.ones(2, 4, dtype=torch.int64),
        "image_embeds": torch.zeros(2, 3, 8),
        "timestep_r": None,
    }


def test_hv15_regions():
    torch.manual_seed(0)
    model = HV15.build()
    family = family_for(model)
    assert family.name == "hunyuanvideo15"
    ffn = plan(model, family, gradseam.CheckpointConfig.coerce(
        gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn"))
    assert [r.seam for r in ffn.regions if r.blocks == (0,)] == [("norm2", "ff"), ("ff",), ("ff_context",)]
    chunks = plan(model, family, gradseam.CheckpointConfig.coerce(CHUNKED))
    assert [(r.list_path.rsplit(".", 1)[-1], r.blocks) for r in chunks.regions] == [
        ("refiner_blocks", (0, 1)), ("refiner_blocks", (2,)),
        ("transformer_blocks", (0, 1)), ("transformer_blocks", (2, 3)), ("transformer_blocks", (4,)),
    ]


# -- presets at full size ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family_name", "preset_name", "expected"),
    [
        ("hunyuanvideo15", "8.3b-480p", {"context_embedder.token_refiner.refiner_blocks": 2, "transformer_blocks": 54}),
        ("hunyuanvideo15", "8.3b-720p", {"context_embedder.token_refiner.refiner_blocks": 2, "transformer_blocks": 54}),
        ("ltxvideo", "2b-704x512", {"transformer_blocks": 28}),
        ("wan-vace", "14b-480p", {"vace_blocks": 8, "blocks": 40}),
        ("wan-vace", "1.3b-480p", {"vace_blocks": 15, "blocks": 30}),
    ],
)
def test_presets_plan_at_full_size(family_name: str, preset_name: str, expected: dict[str, int]) -> None:
    from gradseam.tools.checks import find_family, model_class

    family = find_family(family_name)
    preset = family.presets[preset_name]
    with torch.device("meta"):
        model = model_class(family)(**preset.config)
    assert family_for(model) is family
    for interval, regions in ((None, sum(expected.values())), (2, None)):
        config = gradseam.CheckpointConfig.coerce(gradient_checkpointing=True, gradient_checkpointing_interval=interval)
        the_plan = plan(model, family, config)
        counts: dict[str, int] = {}
        for region in the_plan.regions:
            counts[region.list_path] = counts.get(region.list_path, 0) + len(region.blocks)
        assert counts == expected
        if regions is not None:
            assert len(the_plan.regions) == regions  # one region per block without an interval


def test_all_presets_are_covered():
    covered = {(f, p) for f, p, _ in test_presets_plan_at_full_size.pytestmark[0].args[1]}
    for name in ("hunyuanvideo15", "ltxvideo", "wan-vace"):
        family = gradseam.registry.REGISTRY.get(name)
        assert {(name, p) for p in family.presets} <= covered


def test_hv15_preset_inputs_have_the_published_sizes():
    preset = gradseam.registry.REGISTRY.get("hunyuanvideo15").presets["8.3b-720p"]
    from diffusers import HunyuanVideo15Transformer3DModel

    with torch.device("meta"):
        model = HunyuanVideo15Transformer3DModel(**preset.config)
    block = model.transformer_blocks[0]
    assert (block.attn.heads, block.ff.net[0].proj.out_features) == (16, 4 * 2048)
    x = preset.make_inputs(model, torch.device("meta"), torch.bfloat16, **preset.inputs)
    assert x["hidden_states"].shape == (1, 65, 31, 45, 80) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 1000, 3584)
    assert x["encoder_hidden_states_2"].shape == (1, 256, 1472)
    assert x["image_embeds"].shape == (1, 729, 1152)
    more = preset.make_inputs(model, torch.device("meta"), torch.bfloat16, 3600 * 2, **preset.inputs)
    assert more["hidden_states"].shape[2] == 2  # tokens: 2 latent frames of 45 x 80


def test_ltxv_conditioning_reaches_the_blocks():
    # Per-token timesteps give each token its own modulation inside every block: dropping them for
    # one shared timestep (and the padding) must change the output, or the case would test nothing.
    report = check_strategy(LTXV_CONDITIONED, CHUNKED)
    shared = Case("ltxv-shared", _ltxv_model, lambda g: {**ltxv_conditioned_inputs(g),
                                                          "timestep": torch.tensor([700.0, 700.0]),
                                                          "encoder_attention_mask": torch.ones(2, 6)})
    torch.manual_seed(LTXV_CONDITIONED.seed)
    assert not torch.equal(run_step(shared.build(), shared).outputs[0], report.reference.outputs[0])


def test_ltxv_preset_inputs_have_the_published_sizes():
    from diffusers import LTXVideoTransformer3DModel

    preset = gradseam.registry.REGISTRY.get("ltxvideo").presets["2b-704x512"]
    with torch.device("meta"):
        model = LTXVideoTransformer3DModel(**preset.config)
    block = model.transformer_blocks[0]
    assert (block.attn1.heads, block.ff.net[0].proj.out_features, len(model.transformer_blocks)) == (32, 8192, 28)
    x = preset.make_inputs(model, torch.device("meta"), torch.bfloat16, **preset.inputs)
    assert x["hidden_states"].shape == (1, 21 * 16 * 22, 128) and x["hidden_states"].requires_grad
    assert (x["num_frames"], x["height"], x["width"]) == (21, 16, 22)
    assert x["encoder_hidden_states"].shape == (1, 128, 4096)
    torch.manual_seed(0)
    tiny = _ltxv_model()
    small = preset.make_inputs(tiny, torch.device("cpu"), torch.float32, 8, height=64, width=64)
    assert small["hidden_states"].shape == (1, 2 * 2 * 2, 4)
    assert tiny(**{**small, "encoder_hidden_states": torch.randn(1, 128, 12)}).sample.shape == (1, 8, 4)


def test_vace_and_wan_stay_apart():
    # The VACE model is not a Wan subclass: each family claims its own model class, and both
    # declare the same trunk block class.
    torch.manual_seed(0)
    vace = family_for(VACE.build())
    from cases import WAN

    assert (vace.name, family_for(WAN.build()).name) == ("wan-vace", "wan")
    wan_block = "diffusers.models.transformers.transformer_wan.WanTransformerBlock"
    assert wan_block in {bc.name for bc in vace.block_classes}
    assert wan_block in {bc.name for bc in gradseam.registry.REGISTRY.get("wan").block_classes}


def test_vace_trunk_is_not_chunked_and_why(monkeypatch):
    # The trunk declares no carry. Had it one, the chunks meeting a control hint would fall back
    # (exact, but recomputing in forward): here after blocks 0, 2, 4 every interval-2 chunk does.
    from dataclasses import replace

    import gradseam.patcher as patcher
    from gradseam.family import BlockList, Carry

    torch.manual_seed(0)
    model = VACE.build()
    family = family_for(model)
    chunks = plan(model, family, gradseam.CheckpointConfig.coerce(CHUNKED))
    assert [(r.list_path, r.blocks) for r in chunks.regions] == [
        ("vace_blocks", (0, 1)), ("vace_blocks", (2,)), *(("blocks", (i,)) for i in range(6))
    ]
    carried = replace(family, block_lists=(family.block_lists[0], BlockList("blocks", Carry({"hidden_states": None}))))
    monkeypatch.setattr(patcher, "family_for", lambda m: carried)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GradseamWarning)  # the fallbacks this test is about
        found = _chunks(VACE)
    assert found == {"vace_blocks[0, 1]": False, "blocks[0, 1]": True, "blocks[2, 3]": True,
                             "blocks[4, 5]": True}


def test_vace_control_inputs_reach_the_blocks():
    # The control video and each layer's scale get gradients through the chunked control blocks,
    # and the scale changes the output.
    report = check_strategy(VACE_SCALED, CHUNKED)
    for name in ("control_hidden_states", "control_hidden_states_scale"):
        assert report.patched.input_grads[name].abs().sum() > 0, name
    assert (report.patched.input_grads["control_hidden_states_scale"] != 0).all()
    unscaled = Case("vace-unscaled", _vace_model,
                    lambda g: {k: v for k, v in vace_scaled_inputs(g).items() if k != "control_hidden_states_scale"})
    torch.manual_seed(VACE_SCALED.seed)
    assert not torch.equal(run_step(unscaled.build(), unscaled).outputs[0], report.reference.outputs[0])


def test_vace_preset_inputs_have_the_published_sizes():
    from diffusers import WanVACETransformer3DModel

    preset = gradseam.registry.REGISTRY.get("wan-vace").presets["1.3b-480p"]
    with torch.device("meta"):
        model = WanVACETransformer3DModel(**preset.config)
    assert (model.blocks[0].attn1.heads, model.blocks[0].ffn.net[0].proj.out_features) == (12, 8960)
    assert model.vace_blocks[0].proj_in is not None and model.vace_blocks[1].proj_in is None
    x = preset.make_inputs(model, torch.device("meta"), torch.bfloat16, **preset.inputs)
    assert x["hidden_states"].shape == (1, 16, 21, 60, 104) and x["hidden_states"].requires_grad
    assert x["control_hidden_states"].shape == (1, 96, 21, 60, 104)
    assert x["encoder_hidden_states"].shape == (1, 512, 4096)
    torch.manual_seed(0)
    tiny = _vace_model()
    small = preset.make_inputs(tiny, torch.device("cpu"), torch.float32, 8, height=32, width=32, text_tokens=6)
    assert small["hidden_states"].shape == (1, 4, 2, 4, 4)
    assert tiny(**small).sample.shape == (1, 4, 2, 4, 4)


WORKLOADS = {
    "hunyuanvideo15": (
        _HV15_TINY, {"frames": 5, "height": 32, "width": 32, "text_tokens": 6, "byt5_tokens": 4, "image_tokens": 3},
    ),
    "ltxvideo": (_LTXV_TINY, {"frames": 9, "height": 64, "width": 64, "text_tokens": 6}),
    "wan-vace": (_VACE_TINY, {"frames": 5, "height": 32, "width": 32, "text_tokens": 6}),
}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_bench_workload_truncates_steps_and_patches_exactly(name):
    """`gradseam bench --family NAME --layers 2` on a tiny preset with the real input builder: the kit's check."""
    check_bench_workload(name, *WORKLOADS[name])


@pytest.mark.parametrize("name", ["hunyuanvideo15", "ltxvideo", "wan-vace"])
def test_families_lists_them(name):
    from typer.testing import CliRunner

    from gradseam.tools.cli import app

    result = CliRunner().invoke(app, ["families"], env={"COLUMNS": "200", "NO_COLOR": "1"}, prog_name="gradseam")
    assert result.exit_code == 0, result.output
    assert name in result.output
