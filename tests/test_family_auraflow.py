"""AuraFlow: a tiny deterministic model through the conformance kit (both block lists: joint MMDiT
blocks, then single blocks on the concatenated sequence), a batch of two with different timesteps on
a non-square latent, interval chunks that really chain in both lists, and the preset at full size."""

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
    preset_model,
    randn,
)

LISTS = ("joint_transformer_blocks", "single_transformer_blocks")
TEXT, SIDE, CTX = 6, 4, 12  # T5 tokens, latent side (2x2 patches: 4 image tokens), T5 width
REGISTERS = 8  # the model's learned register tokens, prepended to the text

# 2 heads x 8 = 16 wide (the caption projection must match: the lists concatenate text and image);
# an 8x8 learned position grid, so latents up to 16x16 fit.
TINY = dict(
    sample_size=SIDE, patch_size=2, in_channels=4, num_mmdit_layers=4, num_single_dit_layers=4,
    attention_head_dim=8, num_attention_heads=2, joint_attention_dim=CTX, caption_projection_dim=16,
    out_channels=4, pos_embed_max_size=64,
)


def auraflow_model():
    from diffusers import AuraFlowTransformer2DModel

    return AuraFlowTransformer2DModel(**TINY)


def auraflow_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": randn(g, 1, 4, SIDE, SIDE, grad=True),
        "encoder_hidden_states": randn(g, 1, TEXT, CTX, grad=True),
        "timestep": torch.tensor([0.4]),
    }


def auraflow_batch_inputs(g: torch.Generator) -> dict:
    # Two samples at different timesteps (so temb differs per sample), a 4x8 latent (2x4 patches: the
    # position table is indexed off-centre in one axis), and an attention_kwargs dict as the pipeline
    # passes it (the LoRA-scale decorator copies it once and pops "scale"; every block gets that copy).
    return {
        "hidden_states": randn(g, 2, 4, SIDE, 2 * SIDE, grad=True),
        "encoder_hidden_states": randn(g, 2, TEXT, CTX, grad=True),
        "timestep": torch.tensor([0.2, 0.9]),
        "attention_kwargs": {"scale": 1.0},
    }


AURAFLOW = Case("auraflow", auraflow_model, auraflow_inputs)
AURAFLOW_BATCH = Case("auraflow-batch", auraflow_model, auraflow_batch_inputs)


class TestAuraFlow(ConformanceSuite):
    case = AURAFLOW


class TestAuraFlowBatch(ConformanceSuite):
    case = AURAFLOW_BATCH
    reduced = True


CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}


@pytest.mark.parametrize("case", [AURAFLOW, AURAFLOW_BATCH], ids=lambda c: c.name)
def test_interval_chunks_chain_in_both_lists(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back), so parity alone cannot tell: every chunk
    # of both lists must be served whole.
    report = check_chunks_run_whole(case, CHUNKED, sorted(f"{path}[{i}, {i + 1}]" for path in LISTS for i in (0, 2)))
    assert report.saved_ratio < 1
    # the text stream (and the register tokens prepended to it) reach the loss through the chunks
    assert report.patched.input_grads["encoder_hidden_states"].abs().sum() > 0


def test_seams_and_lists_are_planned_as_declared() -> None:
    model = AURAFLOW.fresh()
    family = family_for(model)
    assert family.name == "auraflow"
    ffn = plan(model, family, gradseam.CheckpointConfig.coerce(
        gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn"))
    seams = {(r.list_path, r.seam) for r in ffn.regions}
    assert seams == {(LISTS[0], ("ff",)), (LISTS[0], ("ff_context",)), (LISTS[1], ("ff",))}
    assert sorted((r.list_path, r.blocks) for r in ffn.regions) == sorted(
        [(LISTS[0], (i,)) for i in range(4)] * 2 + [(LISTS[1], (i,)) for i in range(4)])


def test_every_block_sees_the_same_temb_and_kwargs() -> None:
    # What the carries rely on: nothing but the carried streams changes between two blocks of a list.
    model = AURAFLOW_BATCH.fresh()
    seen: dict[str, list] = {path: [] for path in LISTS}
    for path in LISTS:
        for block in model.get_submodule(path):
            block.register_forward_pre_hook(
                lambda _m, _a, kw, _p=path: seen[_p].append((kw["temb"], kw["attention_kwargs"])), with_kwargs=True)
    with torch.no_grad():
        model(**auraflow_batch_inputs(torch.Generator().manual_seed(1)))
    temb, kwargs = seen[LISTS[0]][0]
    assert temb.shape == (2, 16) and not torch.equal(temb[0], temb[1])
    assert kwargs == {}
    assert all(t is temb and k is kwargs for path in LISTS for t, k in seen[path])


# -- the preset at full size -----------------------------------------------------------------------
def _preset_model():
    return preset_model("auraflow", "6.8b-1024")


def test_preset_plans_at_full_size() -> None:
    family, preset, model = _preset_model()
    assert set(family.presets) == {"6.8b-1024"}
    assert family_for(model) is family
    assert 6.8e9 < sum(p.numel() for p in model.parameters()) < 6.9e9
    block = model.single_transformer_blocks[0]
    assert (block.attn.heads, block.ff.linear_1.out_features, model.config.joint_attention_dim) == (12, 8192, 2048)
    expected = {LISTS[0]: 4, LISTS[1]: 32}
    for config, regions in (({"gradient_checkpointing": True}, 36), (CHUNKED, 18),
                            ({"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}, 40)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        counts: dict[str, int] = {}
        for region in the_plan.regions:
            counts[region.list_path] = counts.get(region.list_path, 0) + len(region.blocks)
        assert len(the_plan.regions) == regions
        if config.get("gradient_checkpointing_backend") != "torch-ffn":
            assert counts == expected


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    _, preset, model = _preset_model()
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 4, 128, 128) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 256, 2048)
    assert x["timestep"].shape == (1,)
    assert preset.make_inputs(model, "meta", torch.bfloat16, 1024, **preset.inputs)["hidden_states"].shape == (
        1, 4, 64, 64)
    assert preset.make_inputs(model, "meta", torch.bfloat16, 9216, **preset.inputs)["hidden_states"].shape == (
        1, 4, 192, 192)
    with pytest.raises(ValueError, match="pos_embed_max_size=9216"):
        preset.make_inputs(model, "meta", torch.bfloat16, 16384, **preset.inputs)


def test_preset_input_builder_runs_the_model() -> None:
    family = gradseam.registry.REGISTRY.get("auraflow")
    model = AURAFLOW.fresh()
    x = family.presets["6.8b-1024"].make_inputs(model, "cpu", torch.float32, 4, text_tokens=TEXT)
    out = model(**x).sample
    assert out.shape == (1, 4, SIDE, SIDE)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_steps_and_patches_exactly() -> None:
    """`gradseam bench --family auraflow --layers 2` on a tiny preset with the real input builder: the kit's check."""
    check_bench_workload("auraflow", TINY, {"image_tokens": 4, "text_tokens": TEXT}, preset="6.8b-1024",
                         sequence=REGISTERS + TEXT + 4)
