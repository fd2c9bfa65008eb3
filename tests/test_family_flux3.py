"""Flux 3: a tiny deterministic model through the conformance kit (with a reference image, so every
block list runs), text-to-image (the reference list never runs), the flow-map variant, interval
chunks that really chain, and the presets at full size."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import gradseam
from gradseam.adapters.flux3 import image_ids, text_ids
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    assert_regions_whole,
    assert_same_step,
    check_bench_workload,
    check_no_grad,
    check_strategy,
    randn,
    record_regions,
    run_step,
)

GRID, TEXT = 2, 3  # 2 x 2 image tokens (and as many per reference image), 3 text tokens
MODE_LISTS = ("txt_mode_blocks", "mode_blocks.image", "mode_blocks.image_cond")
SINGLE = "single_transformer_blocks"
CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}


TINY = dict(
    in_channels=4, cond_in_channels=4, num_layers=2, num_single_layers=4, attention_head_dim=8,
    num_attention_heads=2, joint_attention_dim=12, timestep_channels=16, axes_dims_rope=(2, 2, 2, 2),
)


def flux3_model(**overrides):
    from diffusers import Flux3Transformer2DModel

    return Flux3Transformer2DModel(**{**TINY, **overrides})


def flux3_inputs(g: torch.Generator, images: int = 0, batch: int = 1) -> dict:
    inputs = {
        "hidden_states": randn(g, batch, GRID * GRID, 4, grad=True),
        "encoder_hidden_states": randn(g, batch, TEXT, 12, grad=True),
        "timestep": torch.linspace(0.6, 0.3, batch),
        "img_ids": image_ids(GRID, "cpu"),
        "txt_ids": text_ids(TEXT, "cpu"),
    }
    if images:
        inputs["image_cond_hidden_states"] = randn(g, batch, images * GRID * GRID, 4, grad=True)
        inputs["image_cond_ids"] = torch.cat([image_ids(GRID, "cpu", layer=-(1 + i)) for i in range(images)])
    return inputs


def flux3_edit_inputs(g: torch.Generator) -> dict:
    return flux3_inputs(g, images=1)


def flux3_flow_map_inputs(g: torch.Generator) -> dict:
    # the step-distilled checkpoint: two samples, each with the timestep it jumps to, two references
    return {**flux3_inputs(g, images=2, batch=2), "target_timestep": torch.tensor([0.2, 0.1])}


FLUX3_EDIT = Case("flux3-edit", flux3_model, flux3_edit_inputs)
FLUX3 = Case("flux3", flux3_model, flux3_inputs)
FLUX3_FLOW_MAP = Case("flux3-flow-map", lambda: flux3_model(flow_map=True), flux3_flow_map_inputs)


# -- The conformance kit ------------------------------------------------------------------------
class TestFlux3Edit(ConformanceSuite):
    case = FLUX3_EDIT  # every list runs: the whole matrix, every region whole


class TestFlux3FlowMap(ConformanceSuite):
    case = FLUX3_FLOW_MAP
    reduced = True


# -- What the suites cannot see -------------------------------------------------------------------

# Text-to-image leaves the reference list idle: the kit's check_strategy demands that every planned
# region runs, so this case gets the same parity check here, with the idle list excluded by name.
T2I_CONFIGS = [CHUNKED, FFN, {**CHUNKED, "gradient_checkpointing_keep_attention": True},
               {**CHUNKED, "gradient_checkpointing_backend": "unsloth", "gradient_checkpointing_offload_attention": True}]


@pytest.mark.parametrize("config", T2I_CONFIGS, ids=["interval2", "torch-ffn", "keep-attention", "unsloth+attention"])
def test_text_to_image_is_exact_and_only_the_reference_list_idles(config: dict) -> None:
    from gradseam.offload import cpu_test_mode

    model = FLUX3.fresh()
    reference = run_step(model, FLUX3)
    with cpu_test_mode():
        handle = gradseam.patch(model, config)
        try:
            with record_regions(handle) as regions:
                patched = run_step(model, FLUX3)
        finally:
            handle.remove()
    assert_same_step(reference, patched, what=f"flux3 text-to-image {config}")
    assert_same_step(reference, run_step(model, FLUX3), what="flux3 text-to-image after remove()")
    assert patched.saved_bytes < reference.saved_bytes
    idle = [r for r in regions if r.list_path == "mode_blocks.image_cond"]
    assert idle and not any(r.ran for r in idle)
    assert_regions_whole([r for r in regions if r not in idle], what="flux3 text-to-image")


def test_text_to_image_under_no_grad_is_untouched() -> None:
    check_no_grad(FLUX3)


def test_interval_chunks_chain_in_every_list() -> None:
    # With references every list forms chunks, and each chunk runs as one region (no fallback).
    report = check_strategy(FLUX3_EDIT, CHUNKED, whole=True)
    chunks = {r.label for r in report.regions if r.shape == "chunk"}
    assert chunks == {f"{path}[0, 1]" for path in MODE_LISTS} | {f"{SINGLE}[0, 1]", f"{SINGLE}[2, 3]"}


def test_an_incomplete_carry_makes_the_single_chunks_fall_back(monkeypatch) -> None:
    # The single blocks return (text, content) and both feed the next block. A carry naming only the
    # content would run the later block ahead with the first block's text stream, which the model's
    # call then contradicts: still exact, but the chunk no longer runs as one region.
    import gradseam.patcher as patcher
    from gradseam.family import Carry

    model = FLUX3_EDIT.fresh()
    family = family_for(model)
    swapped = Carry({"hidden_states": 1})
    wrong = replace(family, block_lists=tuple(
        replace(bl, carry=swapped) if bl.path == SINGLE else bl for bl in family.block_lists
    ))
    monkeypatch.setattr(patcher, "family_for", lambda m: wrong)
    report = check_strategy(FLUX3_EDIT, CHUNKED)
    single = [r for r in report.regions if r.label.startswith(SINGLE)]
    assert single and all(not r.whole for r in single)
    assert all(r.whole for r in report.regions if not r.label.startswith(SINGLE))


def test_plan_has_one_seam_per_block_and_the_documented_chunks() -> None:
    model = FLUX3_EDIT.fresh()
    family = family_for(model)
    assert family.name == "flux3"
    ffn = plan(model, family, gradseam.CheckpointConfig.coerce(FFN))
    assert {(r.list_path, r.seam) for r in ffn.regions} == {(p, ("ff",)) for p in (*MODE_LISTS, SINGLE)}
    assert len(ffn.regions) == 3 * 2 + 4
    chunks = plan(model, family, gradseam.CheckpointConfig.coerce({**CHUNKED,
                                                                   "gradient_checkpointing_segment_stride": 4}))
    assert [(r.list_path, r.blocks) for r in chunks.regions] == [
        *((p, (0, 1)) for p in MODE_LISTS), (SINGLE, (0, 1))
    ]


def test_references_and_the_target_timestep_reach_the_output() -> None:
    # The reference tokens get a gradient through the chunked lists, and dropping them (or the flow
    # map's target timestep) changes the image tokens' output: the variant cases test something.
    report = check_strategy(FLUX3_FLOW_MAP, CHUNKED)
    assert report.patched.input_grads["image_cond_hidden_states"].abs().sum() > 0
    model = FLUX3_FLOW_MAP.fresh()

    def out(**change) -> torch.Tensor:
        inputs = {**flux3_flow_map_inputs(torch.Generator().manual_seed(1)), **change}
        with torch.no_grad():
            return model(**{k: v for k, v in inputs.items() if v is not None}).sample

    full = out()
    assert not torch.equal(full, out(target_timestep=torch.tensor([0.5, 0.5])))
    assert not torch.equal(full, out(image_cond_hidden_states=None, image_cond_ids=None))


# -- Presets: the real-size config builds (on the meta device) and plans at full size -------------
def _meta_model(config: dict):
    from diffusers import Flux3Transformer2DModel

    with torch.device("meta"):
        return Flux3Transformer2DModel(**config)


def test_presets_plan_at_full_size() -> None:
    family = next(f for f in gradseam.families() if f.name == "flux3")
    assert set(family.presets) == {"1024", "edit-1024"}
    expected = {"txt_mode_blocks": 5, "mode_blocks.image": 5, "mode_blocks.image_cond": 5, SINGLE: 28}
    for preset in family.presets.values():
        model = _meta_model(preset.config)
        assert family_for(model) is family
        assert (model.single_transformer_blocks[0].attn.heads, model.inner_dim) == (24, 3072)
        for config, regions in (({"gradient_checkpointing": True}, 43), (FFN, 43), (CHUNKED, 3 * 3 + 14)):
            the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
            counts: dict[str, int] = {}
            for region in the_plan.regions:
                counts[region.list_path] = counts.get(region.list_path, 0) + len(region.blocks)
            assert counts == expected and len(the_plan.regions) == regions


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    family = next(f for f in gradseam.families() if f.name == "flux3")
    model = _meta_model({})
    t2i = family.presets["1024"]
    x = t2i.make_inputs(model, "meta", torch.bfloat16, None, **t2i.inputs)
    assert x["hidden_states"].shape == (1, 4096, 128) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 480, 20480)
    assert x["img_ids"].shape == (4096, 4) and x["txt_ids"].shape == (480, 4)
    assert "image_cond_hidden_states" not in x and "target_timestep" not in x
    edit = family.presets["edit-1024"]
    x = edit.make_inputs(model, "meta", torch.bfloat16, 1024, **edit.inputs)
    assert x["hidden_states"].shape == (1, 1024, 128)
    assert x["image_cond_hidden_states"].shape == (1, 1024, 128) and x["image_cond_ids"].shape == (1024, 4)


def test_preset_ids_are_the_pipelines() -> None:
    ids = image_ids(3, "cpu", layer=-1)
    assert ids[:, 0].eq(0).all() and ids[:, 3].eq(-1).all()
    assert ids[4, 1:3].tolist() == [0.5, 0.5] and ids[-1, 1:3].tolist() == [1.0, 1.0]  # rows/cols x 0.5
    assert text_ids(3, "cpu")[:, 3].tolist() == [0, 1, 2]


@pytest.mark.parametrize("flow_map", [False, True])
def test_preset_input_builder_runs_the_model(flow_map: bool) -> None:
    family = next(f for f in gradseam.families() if f.name == "flux3")
    torch.manual_seed(0)
    model = flux3_model(flow_map=flow_map)
    x = family.presets["edit-1024"].make_inputs(model, "cpu", torch.float32, 9, text_tokens=4, images=1)
    assert ("target_timestep" in x) is flow_map
    out = model(**x).sample
    assert out.shape == (1, 9, 4)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_steps_and_patches_exactly() -> None:
    """`gradseam bench --family flux3 --layers 2` on a tiny preset with the real input builder: the kit's check."""
    check_bench_workload("flux3", TINY, {"image_tokens": 4, "text_tokens": 3, "images": 1})
