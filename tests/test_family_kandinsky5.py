"""Kandinsky 5.0: a tiny deterministic video model through the conformance kit (both block lists:
the text refiner and the visual CrossDiT blocks), an image batch (one frame, no visual conditioning,
two timesteps), interval chunks that really chain, and the presets at full size."""

from __future__ import annotations

import pytest
import torch
from family_checks import check_chunks_run_whole

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

LISTS = ("text_transformer_blocks", "visual_transformer_blocks")
TEXT, TEXT_DIM, POOLED = 6, 12, 6

# Head width 8 split 2 + 2 + 4 over (frame, row, column) for the 3-D RoPE: 2 heads of 8.
TINY = dict(
    in_visual_dim=4, out_visual_dim=4, in_text_dim=TEXT_DIM, in_text_dim2=POOLED, time_dim=8, model_dim=16,
    ff_dim=32, num_text_blocks=4, num_visual_blocks=4, axes_dims=(2, 2, 4), visual_cond=True,
)


def kandinsky5_model(**overrides):
    from diffusers import Kandinsky5Transformer3DModel
    from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Modulation

    model = Kandinsky5Transformer3DModel(**{**TINY, **overrides})
    # upstream zero-initialises every modulation (adaLN-zero): each block would then add nothing and
    # most gradients would be zero, which any cut reproduces. Random modulations make the check bite.
    for module in model.modules():
        if isinstance(module, Kandinsky5Modulation):
            torch.nn.init.normal_(module.out_layer.weight, std=0.3)
            torch.nn.init.normal_(module.out_layer.bias, std=0.3)
    return model


def kandinsky5_inputs(g: torch.Generator) -> dict:
    # text-to-video: 2 latent frames x 4 x 4 (2 x 2 x 2 = 8 tokens in 1x2x2 patches), visual_cond channels
    # (noise 4 + condition 4 + mask 1), 6 prompt tokens
    return {
        "hidden_states": randn(g, 1, 2, 4, 4, 9, grad=True),
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM, grad=True),
        "timestep": torch.tensor([500.0]),
        "pooled_projections": randn(g, 1, POOLED, grad=True),
        "visual_rope_pos": [torch.arange(2), torch.arange(2), torch.arange(2)],
        "text_rope_pos": torch.arange(TEXT),
        "scale_factor": (1.0, 2.0, 2.0),
    }


def kandinsky5_image_inputs(g: torch.Generator) -> dict:
    # text-to-image: one frame of 4 x 8 latents (2 x 4 tokens), no visual conditioning, two prompts at
    # different timesteps, the image pipeline's RoPE scale
    return {
        "hidden_states": randn(g, 2, 1, 4, 8, 4, grad=True),
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
        "timestep": torch.tensor([300.0, 900.0]),
        "pooled_projections": randn(g, 2, POOLED, grad=True),
        "visual_rope_pos": [torch.arange(1), torch.arange(2), torch.arange(4)],
        "text_rope_pos": torch.arange(TEXT),
        "scale_factor": (1.0, 1.0, 1.0),
    }


KANDINSKY5 = Case("kandinsky5", kandinsky5_model, kandinsky5_inputs)
KANDINSKY5_IMAGE = Case("kandinsky5-image", lambda: kandinsky5_model(visual_cond=False), kandinsky5_image_inputs)


class TestKandinsky5(ConformanceSuite):
    case = KANDINSKY5


class TestKandinsky5Image(ConformanceSuite):
    case = KANDINSKY5_IMAGE
    reduced = True


CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}


@pytest.mark.parametrize("case", [KANDINSKY5, KANDINSKY5_IMAGE], ids=lambda c: c.name)
def test_interval_chunks_chain_in_both_lists(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back): every chunk must be served whole.
    check_chunks_run_whole(case, CHUNKED, sorted(f"{path}[{i}, {i + 1}]" for path in LISTS for i in (0, 2)))


def test_blocks_really_compute_and_the_refined_prompt_reaches_the_visual_blocks() -> None:
    # The case is not vacuous: the modulation gates are not upstream's zeros, every block's attention
    # and MLP get gradients through the chunked run, and so do the prompt and the pooled CLIP vector.
    report = check_strategy(KANDINSKY5, CHUNKED)
    grads = report.patched.param_grads
    for path in LISTS:
        for i in range(4):
            for name in ("self_attention.to_query.weight", "feed_forward.in_layer.weight"):
                assert grads[f"{path}.{i}.{name}"].abs().sum() > 0, f"{path}.{i}.{name}"
    for name in ("encoder_hidden_states", "pooled_projections", "hidden_states"):
        assert report.patched.input_grads[name].abs().sum() > 0, name


def test_seams_and_attention_are_planned_as_declared() -> None:
    model = KANDINSKY5.fresh()
    family = family_for(model)
    assert family.name == "kandinsky5"
    ffn = plan(model, family, gradseam.CheckpointConfig.coerce(
        gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn"))
    assert [(r.list_path, r.blocks, r.seam) for r in ffn.regions] == [
        (path, (i,), ("feed_forward",)) for path in LISTS for i in range(4)
    ]
    by_class = {bc.name.rsplit(".", 1)[-1]: bc.attention for bc in family.block_classes}
    assert by_class == {"Kandinsky5TransformerEncoderBlock": ("self_attention",),
                        "Kandinsky5TransformerDecoderBlock": ("self_attention", "cross_attention")}


# -- the presets at full size ----------------------------------------------------------------------
EXPECTED = {
    "video-lite-5s": ({"text_transformer_blocks": 2, "visual_transformer_blocks": 32}, (28, 7168)),
    "video-pro-5s": ({"text_transformer_blocks": 4, "visual_transformer_blocks": 60}, (32, 16384)),
    "image-lite-1024": ({"text_transformer_blocks": 2, "visual_transformer_blocks": 50}, (20, 10240)),
}


def _preset_model(name: str):
    return preset_model("kandinsky5", name)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_presets_plan_at_full_size(name: str) -> None:
    family, _, model = _preset_model(name)
    assert set(family.presets) == set(EXPECTED)
    assert family_for(model) is family
    expected, (heads, ff) = EXPECTED[name]
    block = model.visual_transformer_blocks[0]
    assert (block.self_attention.num_heads, block.feed_forward.in_layer.out_features) == (heads, ff)
    total = sum(expected.values())
    for config, regions in (({"gradient_checkpointing": True}, total),
                            ({"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}, total),
                            (CHUNKED, sum((n + 1) // 2 for n in expected.values()))):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        counts: dict[str, int] = {}
        for region in the_plan.regions:
            counts[region.list_path] = counts.get(region.list_path, 0) + len(region.blocks)
        assert counts == expected and len(the_plan.regions) == regions


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    _, video, model = _preset_model("video-lite-5s")
    x = video.make_inputs(model, "meta", torch.bfloat16, None, **video.inputs)
    assert x["hidden_states"].shape == (1, 31, 64, 96, 33) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 256, 3584) and x["pooled_projections"].shape == (1, 768)
    assert [p.shape[0] for p in x["visual_rope_pos"]] == [31, 32, 48] and x["text_rope_pos"].shape == (256,)
    fewer = video.make_inputs(model, "meta", torch.bfloat16, 2 * 32 * 48, **video.inputs)
    assert fewer["hidden_states"].shape[1] == 2
    _, image, model = _preset_model("image-lite-1024")
    x = image.make_inputs(model, "meta", torch.bfloat16, None, **image.inputs)
    assert x["hidden_states"].shape == (1, 1, 128, 128, 16) and x["scale_factor"] == (1.0, 1.0, 1.0)
    assert x["encoder_hidden_states"].shape == (1, 512, 3584)
    small = image.make_inputs(model, "meta", torch.bfloat16, 1024, **image.inputs)
    assert small["hidden_states"].shape == (1, 1, 64, 64, 16)


@pytest.mark.parametrize(("case", "sizes"), [
    (KANDINSKY5, {"frames": 5, "height": 32, "width": 32}),
    (KANDINSKY5_IMAGE, {"frames": 1, "height": 32, "width": 64}),
], ids=["video", "image"])
def test_preset_input_builder_runs_the_model(case: Case, sizes: dict) -> None:
    family = gradseam.registry.REGISTRY.get("kandinsky5")
    model = case.fresh()
    x = family.presets["video-lite-5s"].make_inputs(model, "cpu", torch.float32, None, text_tokens=TEXT, **sizes)
    out = model(**x).sample
    assert out.shape == (*x["hidden_states"].shape[:4], 4)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_steps_and_patches_exactly() -> None:
    """`gradseam bench --family kandinsky5 --layers 2` on a tiny preset with the real input builder: the kit's check."""
    check_bench_workload("kandinsky5", TINY, {"frames": 5, "height": 32, "width": 32, "text_tokens": TEXT},
                         preset="video-lite-5s", sequence=2 * 2 * 2)
