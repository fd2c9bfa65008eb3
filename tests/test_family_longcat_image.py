"""LongCat-Image: a tiny deterministic model through the conformance kit (double and single blocks),
an edit batch (source-image tokens appended to the target's, two samples at their own timesteps),
interval chunks that really chain in both lists, the unused ``guidance`` argument, and the presets
at full size."""

from __future__ import annotations

import pytest
import torch
from family_checks import check_chunks_run_whole

import gradseam
from gradseam.adapters.longcat_image import position_ids
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_bench_workload,
    preset_model,
    randn,
    run_step,
)

LISTS = ("transformer_blocks", "single_transformer_blocks")
TEXT, TEXT_DIM, SIDE, CHANNELS = 6, 12, 3, 8

TINY = dict(
    patch_size=1, in_channels=CHANNELS, num_layers=4, num_single_layers=4, attention_head_dim=8,
    num_attention_heads=2, joint_attention_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM, axes_dims_rope=(2, 2, 4),
)


def longcat_model():
    from diffusers import LongCatImageTransformer2DModel

    return LongCatImageTransformer2DModel(**TINY)


def longcat_inputs(g: torch.Generator) -> dict:
    # text-to-image: a 3 x 3 grid of packed latent tokens, 6 prompt tokens, the pipeline's ids
    txt_ids, img_ids = position_ids(TEXT, SIDE, "cpu")
    return {
        "hidden_states": randn(g, 1, SIDE * SIDE, CHANNELS, grad=True),
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM, grad=True),
        "timestep": torch.tensor([0.6]),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
    }


def longcat_edit_inputs(g: torch.Generator) -> dict:
    # edit: the source image's tokens follow the target's (modality 2 ids), two samples, two timesteps
    txt_ids, img_ids = position_ids(TEXT, SIDE, "cpu", images=1)
    return {
        "hidden_states": randn(g, 2, 2 * SIDE * SIDE, CHANNELS, grad=True),
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
        "timestep": torch.tensor([0.2, 0.9]),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
    }


LONGCAT = Case("longcat-image", longcat_model, longcat_inputs)
LONGCAT_EDIT = Case("longcat-image-edit", longcat_model, longcat_edit_inputs)


class TestLongCatImage(ConformanceSuite):
    case = LONGCAT


class TestLongCatImageEdit(ConformanceSuite):
    case = LONGCAT_EDIT
    reduced = True


CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}


@pytest.mark.parametrize("case", [LONGCAT, LONGCAT_EDIT], ids=lambda c: c.name)
def test_interval_chunks_chain_in_both_lists(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back): every chunk must be served whole.
    check_chunks_run_whole(case, CHUNKED, sorted(f"{path}[{i}, {i + 1}]" for path in LISTS for i in (0, 2)))


def test_seams_are_the_mlps() -> None:
    model = LONGCAT.fresh()
    family = family_for(model)
    assert family.name == "longcat-image"
    ffn = plan(model, family, gradseam.CheckpointConfig.coerce(
        gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn"))
    assert [r.seam for r in ffn.regions if r.blocks == (0,)] == [("ff",), ("ff_context",), ("proj_mlp", "act_mlp")]


def test_position_ids_are_the_pipelines() -> None:
    txt, img = position_ids(4, 2, "cpu", images=1, start=512)
    assert txt.tolist() == [[0, i, i] for i in range(4)]
    target = [[1, 512 + r, 512 + c] for r in range(2) for c in range(2)]
    assert img.tolist() == target + [[2, y, x] for _, y, x in target]


def test_guidance_is_ignored_and_the_edit_source_matters() -> None:
    model = LONGCAT_EDIT.fresh()
    inputs = longcat_edit_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(**inputs).sample
        guided = model(**inputs, guidance=torch.tensor([4.5, 4.5])).sample
        source = inputs["hidden_states"].clone()
        source[:, SIDE * SIDE:] = 0
        blank = model(**{**inputs, "hidden_states": source}).sample
    assert torch.equal(plain, guided)
    assert not torch.equal(plain[:, : SIDE * SIDE], blank[:, : SIDE * SIDE])


# -- the presets at full size ----------------------------------------------------------------------
def _preset_model(name: str):
    return preset_model("longcat-image", name)


@pytest.mark.parametrize("name", ["6b-1024", "6b-edit-1024"])
def test_presets_plan_at_full_size(name: str) -> None:
    family, _, model = _preset_model(name)
    assert set(family.presets) == {"6b-1024", "6b-edit-1024"}
    assert family_for(model) is family
    # 6.27B parameters: 12.54 GB in bf16, the size of the released transformer
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 6.27
    expected = {"transformer_blocks": 10, "single_transformer_blocks": 20}
    for config, regions in (({"gradient_checkpointing": True}, 30), (CHUNKED, 15),
                            ({"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}, 40)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        blocks: dict[str, set[int]] = {}
        for region in the_plan.regions:
            blocks.setdefault(region.list_path, set()).update(region.blocks)
        assert {path: len(found) for path, found in blocks.items()} == expected
        assert len(the_plan.regions) == regions


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    _, t2i, model = _preset_model("6b-1024")
    x = t2i.make_inputs(model, "meta", torch.bfloat16, None, **t2i.inputs)
    assert x["hidden_states"].shape == (1, 4096, 64) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 512, 3584)
    assert x["txt_ids"].shape == (512, 3) and x["img_ids"].shape == (4096, 3)
    _, edit, _ = _preset_model("6b-edit-1024")
    x = edit.make_inputs(model, "meta", torch.bfloat16, None, **edit.inputs)
    assert x["hidden_states"].shape == (1, 2 * 4096, 64) and x["encoder_hidden_states"].shape == (1, 838, 3584)
    small = edit.make_inputs(model, "meta", torch.bfloat16, 1024, **edit.inputs)
    assert small["hidden_states"].shape == (1, 2 * 1024, 64)


@pytest.mark.parametrize("images", [0, 1])
def test_preset_input_builder_runs_the_model(images: int) -> None:
    family = gradseam.registry.REGISTRY.get("longcat-image")
    model = LONGCAT.fresh()
    x = family.presets["6b-edit-1024"].make_inputs(model, "cpu", torch.float32, 9, text_tokens=TEXT, images=images)
    step = run_step(model, Case("builder", LONGCAT.build, lambda _g: x))
    assert step.outputs[0].shape == (1, (images + 1) * 9, CHANNELS)
    assert step.input_grads["hidden_states"].abs().sum() > 0


def test_bench_workload_truncates_steps_and_patches_exactly() -> None:
    """`gradseam bench --family longcat-image --layers 2` on a tiny preset with the real input builder: the kit's check."""
    check_bench_workload("longcat-image", TINY, {"image_tokens": 9, "text_tokens": TEXT, "images": 1},
                         preset="6b-edit-1024", sequence=2 * 9)
