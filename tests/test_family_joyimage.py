"""JoyAI-Image Edit and Edit Plus: tiny deterministic models through the conformance kit, one family each.

``joyimage`` (JoyImageEditTransformer3DModel): the plain case is an edit as the pipeline feeds it, a
reference and a noisy target stacked as a 6-D batch of two items, and runs the kit's whole matrix; a
batch of two text-to-image calls (5-D latents, non-square, each sample at its own timestep) with
``rope_type="mrope"`` (RoPE on the text tokens too) runs the reduced one. ``joyimage-edit-plus``
(JoyImageEditPlusTransformer3DModel): the plain case is one reference of another size than the target,
patchified apart and concatenated, with the text mask the pipeline passes (whole checkpointing matrix,
one offload row per mechanism: the offload engine sees the Edit block's modules again); a padded batch
of two (a smaller reference, so padding patches, and a padded prompt) and a call without a text mask run
reduced ones. Then: the chunks run whole, the loops hand every block the same conditioning, the seams are
the two MLPs and nothing more, diffusers' own checkpointing flag, and the presets at full size.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

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
    check_builtin_flag,
    check_strategy,
    preset_model,
    randn,
)

CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}

# 2 heads x 8 = 16 wide (the RoPE splits a head 2 + 2 + 4 over frames, rows and columns), MLP 64,
# Qwen3-VL states 12 wide, 4 latent channels, four blocks.
TEXT, TEXT_DIM, CH = 6, 12, 4
TINY: dict[str, Any] = dict(
    patch_size=[1, 2, 2], in_channels=CH, out_channels=CH, hidden_size=16, num_attention_heads=2, text_dim=TEXT_DIM,
    mlp_width_ratio=4.0, num_layers=4, rope_dim_list=[2, 2, 4], theta=256,
)


def edit_model(**changes: Any) -> torch.nn.Module:
    from diffusers import JoyImageEditTransformer3DModel

    return JoyImageEditTransformer3DModel(**{**TINY, **changes})


def plus_model() -> torch.nn.Module:
    from diffusers import JoyImageEditPlusTransformer3DModel

    return JoyImageEditPlusTransformer3DModel(**TINY)


# -- joyimage: the Edit model -------------------------------------------------------------------


def edit_inputs(g: torch.Generator) -> dict:
    # JoyImageEditPipeline editing: (B, items, C, T, H, W), the reference first and the noisy target last;
    # a 4x4 latent (2x2 patches) each, so 8 image tokens in the loop
    return {
        "hidden_states": randn(g, 1, 2, CH, 1, 4, 4, grad=True),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM, grad=True),
    }


def edit_batch_inputs(g: torch.Generator) -> dict:
    # two samples at their own timesteps (temb differs per sample), each one 5-D latent (B, C, T, H, W) as
    # a direct text-to-image call passes it, 4x6 (2x3 patches: a non-square RoPE grid)
    return {
        "hidden_states": randn(g, 2, CH, 1, 4, 6, grad=True),
        "timestep": torch.tensor([120.0, 870.0]),
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
    }


EDIT = Case("joyimage-edit", edit_model, edit_inputs)
# rope_type="mrope": the text tokens get a RoPE too, positioned after the image grid
EDIT_BATCH = Case("joyimage-t2i-batch-mrope", lambda: edit_model(rope_type="mrope"), edit_batch_inputs)


class TestJoyImageEdit(ConformanceSuite):
    case = EDIT


class TestJoyImageTextToImageBatchMRoPE(ConformanceSuite):
    case = EDIT_BATCH
    reduced = True


# -- joyimage-edit-plus: the Edit Plus model --------------------------------------------------------


def _patches(g: torch.Generator, batch: int, count: int) -> torch.Tensor:
    return randn(g, batch, count, CH, 1, 2, 2, grad=True)  # pre-patchified: (B, patches, C, pt, ph, pw)


def plus_inputs(g: torch.Generator) -> dict:
    # the target (2x2 patches) and one reference of another size (1x3), concatenated: 7 image tokens
    return {
        "hidden_states": _patches(g, 1, 4 + 3),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM, grad=True),
        "encoder_hidden_states_mask": torch.ones(1, TEXT, dtype=torch.long),  # the Qwen processor's mask
        "shape_list": [[(1, 2, 2), (1, 1, 3)]],
    }


def plus_batch_inputs(g: torch.Generator) -> dict:
    # two samples padded to one patch count: the second's reference is smaller (1x1), so its last two
    # patches are padding the mask hides; its prompt is padded too (the last two text tokens)
    mask = torch.ones(2, TEXT, dtype=torch.long)
    mask[1, -2:] = 0
    return {
        "hidden_states": _patches(g, 2, 4 + 3),
        "timestep": torch.tensor([300.0, 700.0]),
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
        "encoder_hidden_states_mask": mask,
        "shape_list": [[(1, 2, 2), (1, 1, 3)], [(1, 2, 2), (1, 1, 1)]],
    }


def plus_unmasked_inputs(g: torch.Generator) -> dict:
    # a direct call without the text mask: the blocks get attention_mask=None
    return {**plus_inputs(g), "encoder_hidden_states_mask": None}


PLUS = Case("joyimage-edit-plus", plus_model, plus_inputs)
PLUS_BATCH = Case("joyimage-edit-plus-padded-batch", plus_model, plus_batch_inputs)
PLUS_UNMASKED = Case("joyimage-edit-plus-unmasked", plus_model, plus_unmasked_inputs)


class TestJoyImageEditPlus(ConformanceSuite):
    case = PLUS
    # The quantized bases act on the blocks' modules, which are the Edit block's (the same Linear layers,
    # norms and MLPs): the Edit suite runs every base, this one a base.
    quantized_bases = ("torchao-int8",)


class TestJoyImageEditPlusPaddedBatch(ConformanceSuite):
    case = PLUS_BATCH
    reduced = True


class TestJoyImageEditPlusUnmasked(ConformanceSuite):
    case = PLUS_UNMASKED
    reduced = True


FAMILIES = {EDIT.name: "joyimage", PLUS.name: "joyimage-edit-plus"}


# -- the cuts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [EDIT_BATCH, PLUS_BATCH], ids=lambda c: c.name)
def test_interval_chunks_chain_both_streams(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back): both chunks must be served whole, and the
    # text stream, which the last block returns to nobody, must still get its gradient through them.
    report = check_chunks_run_whole(case, CHUNKED, ["double_blocks[0, 1]", "double_blocks[2, 3]"])
    assert report.saved_ratio < 1
    assert report.patched.input_grads["encoder_hidden_states"].abs().sum() > 0


@pytest.mark.parametrize("case", [EDIT_BATCH, PLUS_BATCH], ids=lambda c: c.name)
def test_the_loop_hands_every_block_the_same_conditioning(case: Case) -> None:
    # What the carry relies on. The Edit loop builds the RoPE tuple afresh for every block, but from the
    # same tensors (gradseam compares tuples item by item); the Plus loop passes one RoPE tuple and one
    # mask object. temb is one tensor; the streams are what the previous block returned, image first.
    model = case.fresh()
    seen, returned = record_block_calls(model.double_blocks)
    with torch.no_grad():
        model(**case.inputs(torch.Generator().manual_seed(1)))
    assert len(seen) == 4
    first = seen[0]
    assert all(kw["temb"] is first["temb"] for kw in seen)
    assert first["temb"].shape == (2, 6, 16) and not torch.equal(first["temb"][0], first["temb"][1])
    if case is EDIT_BATCH:
        vis, txt = first["image_rotary_emb"]
        assert txt is not None  # mrope: the text tokens get a RoPE of their own
        for kw in seen:
            assert kw["image_rotary_emb"][0] is vis and kw["image_rotary_emb"][1] is txt
    else:
        assert first["attention_mask"].dtype == torch.bool and first["attention_mask"].shape == (2, 1, 1, 7 + TEXT)
        assert first["image_rotary_emb"][0].shape == (2, 7, 8)  # one RoPE table per sample
        for name in ("image_rotary_emb", "attention_mask"):
            assert all(kw[name] is first[name] for kw in seen), name
    for before, kw in zip(returned, seen[1:]):
        assert kw["hidden_states"] is before[0] and kw["encoder_hidden_states"] is before[1]


def test_variant_inputs_change_the_output() -> None:
    # The variants exercise their paths: the text RoPE, the masks and the per-sample timesteps all matter.
    batch = sample_output(EDIT_BATCH)
    plain_rope = Case("joyimage-rope", edit_model, edit_batch_inputs).fresh()  # the same weights, rope_type="rope"
    assert not torch.equal(batch, sample_output(EDIT_BATCH, model=plain_rope))
    assert not torch.equal(batch, sample_output(EDIT_BATCH, timestep=torch.tensor([120.0, 120.0])))
    padded = sample_output(PLUS_BATCH)
    unmasked = sample_output(PLUS_BATCH, encoder_hidden_states_mask=None)
    assert not torch.equal(padded[1], unmasked[1])  # the second sample's padding is hidden only by the mask


@pytest.mark.parametrize("case", [EDIT, PLUS], ids=lambda c: c.name)
def test_ffn_seams_are_the_two_mlps(case: Case) -> None:
    # One region per stream's MLP in every block, nothing around them.
    model = case.fresh()
    family = family_for(model)
    assert family.name == FAMILIES[case.name] and family.has_ffn and family.has_attention and family.supports_interval
    the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.blocks, r.seam) for r in the_plan.regions] == [
        ((i,), seam) for i in range(4) for seam in (("img_mlp",), ("txt_mlp",))
    ]


def test_ffn_seams_run_whole_and_keep_less() -> None:
    # Each MLP runs once per step as its own region, whole, the last block's text MLP too (its output
    # feeds nothing, so it gets no gradient, as unpatched); the -ffn step is exact and keeps less.
    report = check_strategy(EDIT, FFN, whole=True)
    ffn = [r for r in report.regions if r.shape == "ffn"]
    assert len(ffn) == 8 and all(r.runs == 1 and r.whole for r in ffn), ffn
    assert report.saved_ratio < 1
    last_text_mlp = "double_blocks.3.txt_mlp.net.0.proj.weight"
    assert last_text_mlp not in report.reference.param_grads and last_text_mlp not in report.patched.param_grads
    assert "double_blocks.2.txt_mlp.net.0.proj.weight" in report.patched.param_grads


@pytest.mark.parametrize("case", [EDIT, PLUS], ids=lambda c: c.name)
def test_norm2_cannot_join_the_seam(case: Case) -> None:
    # Why the seam is the MLP alone: each MLP is called on norm2's output after the modulation, another
    # tensor, so norm2 -> mlp is not a strict chain and norm2 stays outside the region.
    model = case.fresh()
    block = model.double_blocks[0]
    got: dict[str, Any] = {}
    for name in ("img_norm2", "txt_norm2"):
        getattr(block, name).register_forward_hook(lambda _m, _a, out, _n=name: got.__setitem__(_n, out))
    for name in ("img_mlp", "txt_mlp"):
        getattr(block, name).register_forward_hook(lambda _m, a, _o, _n=name: got.__setitem__(_n, a[0]))
    with torch.no_grad():
        model(**case.inputs(torch.Generator().manual_seed(1)))
    for stream in ("img", "txt"):
        normed, fed = got[f"{stream}_norm2"], got[f"{stream}_mlp"]
        assert fed is not normed and not torch.equal(fed, normed)


# -- diffusers' own checkpointing flag ----------------------------------------------------------


@pytest.mark.parametrize("case", [EDIT, PLUS_BATCH], ids=lambda c: c.name)
def test_builtin_flag_is_exact_and_owned_by_gradseam(case: Case) -> None:
    # diffusers' flag calls the blocks positionally with every argument (the Plus loop's mask included)
    check_builtin_flag(case, CHUNKED)


# -- the presets at full size ----------------------------------------------------------------------

PRESETS = {
    "joyimage": {"edit-1024": (2, 128 + 1024), "t2i-1024": (1, 128)},  # items, text tokens
    "joyimage-edit-plus": {"1024": (2, 128 + 1024), "1024-3refs": (4, 128 + 3 * 1024)},  # images, text tokens
}
ALL_PRESETS = [(f, p) for f, presets in PRESETS.items() for p in presets]


@functools.cache
def _preset_model(name: str, preset: str) -> tuple[Any, Any, Any]:
    return preset_model(name, preset)  # a 16B model on meta: built once per preset for the tests below


@pytest.mark.parametrize(("name", "preset"), ALL_PRESETS)
def test_presets_plan_at_full_size(name: str, preset: str) -> None:
    family, chosen, model = _preset_model(name, preset)
    assert set(family.presets) == set(PRESETS[name])
    assert family_for(model) is family
    params = set(inspect.signature(type(model).__init__).parameters) - {"self"}
    assert set(chosen.config) == params  # every constructor argument, spelled out
    assert 15.5e9 < sum(p.numel() for p in model.parameters()) < 16.5e9
    block = model.double_blocks[0]
    assert (len(model.double_blocks), block.attn.heads, block.attn.head_dim, block.img_mlp.net[0].proj.out_features,
            block.txt_mlp.net[0].proj.out_features) == (40, 32, 128, 16384, 16384)
    assert_plans_cover_every_block(model, family, 40, (
        ({"gradient_checkpointing": True}, 40), (CHUNKED, 20), (FFN, 80)
    ))


@pytest.mark.parametrize(("name", "preset"), ALL_PRESETS)
def test_preset_inputs_have_the_pipelines_sizes(name: str, preset: str) -> None:
    _, chosen, model = _preset_model(name, preset)
    images, text = PRESETS[name][preset]
    x = chosen.make_inputs(model, "meta", torch.bfloat16, None, **chosen.inputs)
    assert x["encoder_hidden_states"].shape == (1, text, 4096) and x["timestep"].shape == (1,)
    assert x["hidden_states"].requires_grad
    # 1024² through the Wan VAE (8x): 128 x 128 latents, 64 x 64 patches of 2, 4096 tokens per image
    if name == "joyimage":
        assert x["hidden_states"].shape == (1, images, 16, 1, 128, 128)
        fewer = chosen.make_inputs(model, "meta", torch.bfloat16, 1024, **chosen.inputs)
        assert fewer["hidden_states"].shape == (1, images, 16, 1, 64, 64)
    else:
        assert x["hidden_states"].shape == (1, images * 4096, 16, 1, 2, 2)
        assert x["shape_list"] == [[(1, 64, 64)] * images]
        assert x["encoder_hidden_states_mask"].shape == (1, text)
        fewer = chosen.make_inputs(model, "meta", torch.bfloat16, 1024, **chosen.inputs)
        assert fewer["hidden_states"].shape[1] == images * 1024 and fewer["shape_list"] == [[(1, 32, 32)] * images]


@pytest.mark.parametrize(("case", "preset"), [(EDIT, "edit-1024"), (EDIT, "t2i-1024"), (PLUS, "1024-3refs")],
                         ids=lambda v: getattr(v, "name", v))
def test_preset_input_builder_runs_the_model(case: Case, preset: str) -> None:
    # the builder's inputs must be ones the model takes: the tiny model, a 32x48 picture, a short prompt
    family = gradseam.registry.REGISTRY.get(FAMILIES[case.name])
    chosen = family.presets[preset]
    model = case.fresh()
    x = chosen.make_inputs(model, "cpu", torch.float32, None, **{**chosen.inputs, "height": 32, "width": 48,
                                                                 "text_tokens": TEXT})
    out = model(**x).sample
    assert out.shape == x["hidden_states"].shape
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


PRESETS_INPUTS = {"edit-1024": {"items": 2}, "1024-3refs": {"references": 3}}


@pytest.mark.parametrize(("name", "preset", "sequence"),
                         [("joyimage", "edit-1024", 2 * 4), ("joyimage-edit-plus", "1024-3refs", 4 * 4)])
def test_bench_workload_truncates_and_patches_exactly(name: str, preset: str, sequence: int) -> None:
    """`gradseam bench --family NAME --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload(name, TINY, {**PRESETS_INPUTS[preset], "image_tokens": 4, "text_tokens": TEXT},
                         preset=preset, sequence=sequence)

