"""Lumina Image 2.0: a tiny deterministic model through the conformance kit (all three block lists:
context refiner, noise refiner, main layers), a padded two-prompt batch whose masks reach the
context refiner and the joint layers, interval chunks that really chain, and the preset at full size."""

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

LISTS = ("context_refiner", "noise_refiner", "layers")
TEXT, SIDE, CAP = 6, 4, 12  # caption tokens, latent side (2x2 patches: 4 image tokens), caption width

# Head width 8 split 2 + 2 + 4 over (caption position, row, column) for RoPE; 2 query heads on 1 KV head (GQA).
TINY = dict(
    sample_size=SIDE, patch_size=2, in_channels=4, hidden_size=16, num_layers=4, num_refiner_layers=4,
    num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(2, 2, 4), axes_lens=(16, 8, 8),
    cap_feat_dim=CAP,
)


def lumina2_model():
    from diffusers import Lumina2Transformer2DModel

    return Lumina2Transformer2DModel(**TINY)


def lumina2_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": randn(g, 1, 4, SIDE, SIDE, grad=True),
        "timestep": torch.tensor([0.4]),
        "encoder_hidden_states": randn(g, 1, TEXT, CAP, grad=True),
        "encoder_attention_mask": torch.ones(1, TEXT, dtype=torch.bool),
    }


def lumina2_padded_inputs(g: torch.Generator) -> dict:
    # Two prompts, the second two tokens shorter (right-padded, as Gemma's tokenizer pads): the context
    # refiner masks the padding, and the joint sequences differ in length, so the main layers get a mask.
    mask = torch.ones(2, TEXT, dtype=torch.bool)
    mask[1, -2:] = False
    return {
        "hidden_states": randn(g, 2, 4, SIDE, SIDE, grad=True),
        "timestep": torch.tensor([0.3, 0.8]),
        "encoder_hidden_states": randn(g, 2, TEXT, CAP, grad=True),
        "encoder_attention_mask": mask,
    }


LUMINA2 = Case("lumina2", lumina2_model, lumina2_inputs)
LUMINA2_PADDED = Case("lumina2-padded", lumina2_model, lumina2_padded_inputs)


class TestLumina2(ConformanceSuite):
    case = LUMINA2


class TestLumina2Padded(ConformanceSuite):
    case = LUMINA2_PADDED
    reduced = True


CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}


@pytest.mark.parametrize("case", [LUMINA2, LUMINA2_PADDED], ids=lambda c: c.name)
def test_interval_chunks_chain_in_every_list(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back), so parity alone cannot tell: every chunk
    # of all three lists must be served whole, the padded batch's masks included.
    report = check_chunks_run_whole(case, CHUNKED, sorted(f"{path}[{i}, {i + 1}]" for path in LISTS for i in (0, 2)))
    assert report.saved_ratio < 1


def test_seams_and_lists_are_planned_as_declared() -> None:
    model = LUMINA2.fresh()
    family = family_for(model)
    assert family.name == "lumina2"
    ffn = plan(model, family, gradseam.CheckpointConfig.coerce(
        gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn"))
    assert {r.seam for r in ffn.regions} == {("feed_forward", "ffn_norm2")}
    assert [(r.list_path, r.blocks) for r in ffn.regions] == [(p, (i,)) for p in LISTS for i in range(4)]
    # (that the seam runs whole in both kinds of block, unmodulated context refiner and modulated
    # others, is the suite's torch-ffn rows with whole regions)


def test_padding_reaches_the_masked_blocks() -> None:
    # The padded case must exercise the mask paths: the context refiner gets the caption mask, the
    # joint layers a (shared) mask object instead of None; and the padding changes the first sample.
    model = LUMINA2_PADDED.fresh()
    seen: dict[str, list] = {path: [] for path in LISTS}
    for path in LISTS:
        for block in model.get_submodule(path):
            block.register_forward_pre_hook(lambda _m, args, _p=path: seen[_p].append(args[1]))
    inputs = lumina2_padded_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        padded = model(**inputs).sample
        unpadded = model(**{**inputs, "encoder_attention_mask": torch.ones(2, TEXT, dtype=torch.bool)}).sample
    masks = {path: seen[path][:4] for path in LISTS}
    assert all(m is inputs["encoder_attention_mask"] for m in masks["context_refiner"])
    assert all(m is None for m in masks["noise_refiner"])
    assert masks["layers"][0] is not None and all(m is masks["layers"][0] for m in masks["layers"])
    assert torch.equal(padded[0], unpadded[0]) and not torch.equal(padded[1], unpadded[1])


def test_caption_tokens_get_gradients_through_chunked_refiner() -> None:
    report = check_strategy(LUMINA2_PADDED, CHUNKED)
    grads = report.patched.input_grads["encoder_hidden_states"]
    assert grads[0].abs().sum() > 0
    assert torch.equal(grads[1, -2:], torch.zeros_like(grads[1, -2:]))  # padding reaches nothing


# -- the preset at full size -----------------------------------------------------------------------
def _preset_model():
    return preset_model("lumina2", "2b-1024")


def test_preset_plans_at_full_size() -> None:
    family, _, model = _preset_model()
    assert set(family.presets) == {"2b-1024"}
    assert family_for(model) is family
    block = model.layers[0]
    assert (block.attn.heads, block.feed_forward.linear_1.out_features, model.config.cap_feat_dim) == (24, 9216, 2304)
    expected = {"context_refiner": 2, "noise_refiner": 2, "layers": 26}
    for config, regions in (({"gradient_checkpointing": True}, 30), (CHUNKED, 15),
                            ({"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}, 30)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        counts: dict[str, int] = {}
        for region in the_plan.regions:
            counts[region.list_path] = counts.get(region.list_path, 0) + len(region.blocks)
        assert counts == expected and len(the_plan.regions) == regions


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    _, preset, model = _preset_model()
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 16, 128, 128) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 256, 2304)
    assert x["encoder_attention_mask"].shape == (1, 256)
    small = preset.make_inputs(model, "meta", torch.bfloat16, 1024, **preset.inputs)
    assert small["hidden_states"].shape == (1, 16, 64, 64)


def test_preset_input_builder_runs_the_model() -> None:
    family = gradseam.registry.REGISTRY.get("lumina2")
    model = LUMINA2.fresh()
    x = family.presets["2b-1024"].make_inputs(model, "cpu", torch.float32, 4, text_tokens=TEXT, caption_tokens=4)
    assert x["encoder_attention_mask"].sum() == 4
    out = model(**x).sample
    assert out.shape == (1, 4, SIDE, SIDE)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_steps_and_patches_exactly() -> None:
    """`gradseam bench --family lumina2 --layers 2` on a tiny preset with the real input builder: the kit's check."""
    check_bench_workload("lumina2", TINY, {"image_tokens": 4, "text_tokens": TEXT}, preset="2b-1024",
                         sequence=TEXT + 4)
