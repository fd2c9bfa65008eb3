"""Bria FIBO 2 (``bria-fibo2``, BriaFibo2Transformer2DModel): a tiny deterministic model through the conformance
kit, input variants, what the suites cannot see, and the presets at full size.

The plain case (one unpadded prompt, text-to-image) runs the kit's whole matrix. A batch of two prompts padded
to different lengths (so the Perceiver makes different gist counts, the gist goes last and the main blocks get
an attention mask) and an edit with two images of their own sizes (per-token modulation in the noise refiner
and the main blocks) run reduced matrices. Then: the seams and the plans, why ``layers`` has no carry (a
chunk would run an injection block with another block's text and die), the loop's arguments, diffusers' own
checkpointing flag, and the presets with their input builder.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from family_checks import blocks_per_list

import gradseam
from gradseam.family import BlockList, Carry, Family
from gradseam.hookspecs import hookimpl
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_bench_workload,
    check_builtin_flag,
    preset_model,
    randn,
)

CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}
LISTS = ("noise_refiner", "perceiver.layers", "layers")
BLOCK_SEAM, PERCEIVER_SEAM = ("feed_forward", "ffn_norm2"), ("ffn_norm", "ffn")
TEXT, CAP, CHANNELS = 6, 12, 4  # prompt tokens, text-feature width, latent channels
INJECTION = (1, 3)

# 3 heads x 8 = 24 wide (the narrowest width whose SwiGLU, (dim * 8 // 3) // 64 * 64, is not empty: 64),
# RoPE axes 2 + 2 + 4; text features 12 wide (not the model width, as at full size: 7680 vs 3584).
# Gist tokens: 2 for a 2-token prompt up to 4 for 6 tokens, in steps of 2. 2 refiner blocks and a 2-layer
# Perceiver (the real counts), 4 main blocks, blocks 1 and 3 with cross-attention.
TINY = dict(
    in_channels=CHANNELS, patch_size=2, dim=24, n_layers=4, n_refiner_layers=2, n_heads=3, cap_feat_dim=CAP,
    injection_layer_ids=INJECTION, perceiver_num_layers=2, min_num_gist_tokens=2, max_num_gist_tokens=4,
    gist_step=2, gist_min_text_len=2, gist_max_text_len=TEXT, axes_dims=(2, 2, 4), axes_lens=(16, 8, 8),
)
BUNDLES = 1 + len(INJECTION)


def fibo2_model(cls: Any = None) -> Any:
    from diffusers import BriaFibo2Transformer2DModel

    model = (cls or BriaFibo2Transformer2DModel)(**TINY)
    # upstream starts every cross-attention gate at zero (tanh(0) = 0: no text reaches the image and the
    # cross-attention gets no gradient); random gates, drawn under the kit's seed, make that path compute
    with torch.no_grad():
        for block in model.layers:
            if block.cross_attention is not None:
                block.cross_attn_gate.normal_()
    return model


def fibo2_inputs(g: torch.Generator) -> dict:
    # a 4 x 6 latent: 2 x 3 tokens of 2x2 patches; 6 prompt tokens, so 4 gist tokens
    return {
        "hidden_states": randn(g, 1, CHANNELS, 4, 6, grad=True),
        "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": randn(g, 1, BUNDLES, TEXT, CAP, grad=True),
    }


def _padding_mask() -> torch.Tensor:
    # BriaFibo2Pipeline pads the batch to its longest prompt ("longest") and passes the token mask only then
    mask = torch.ones(2, TEXT, dtype=torch.bool)
    mask[1, 2:] = False
    return mask


def fibo2_padded_inputs(g: torch.Generator) -> dict:
    # two prompts, the second 2 tokens long: gist counts 4 and 2, so the model pads the second sample's gist,
    # puts the gist last and masks the main blocks' self-attention; the text mask reaches every cross-attention
    return {
        "hidden_states": randn(g, 2, CHANNELS, 4, 4, grad=True),
        "timestep": torch.tensor([0.3, 0.8]),
        "encoder_hidden_states": randn(g, 2, BUNDLES, TEXT, CAP, grad=True),
        "encoder_attention_mask": _padding_mask(),
    }


def fibo2_edit_inputs(g: torch.Generator) -> dict:
    # editing two images of their own sizes: their tokens join the stream as clean tokens (per-token
    # modulation through the noise mask, in the refiner and the main blocks)
    return {
        **fibo2_inputs(g),
        "context_latents": [randn(g, 1, CHANNELS, 4, 4, grad=True), randn(g, 1, CHANNELS, 2, 4, grad=True)],
    }


FIBO2 = Case("bria-fibo2", fibo2_model, fibo2_inputs)
FIBO2_PADDED = Case("bria-fibo2-padded-batch", fibo2_model, fibo2_padded_inputs)
FIBO2_EDIT = Case("bria-fibo2-edit", fibo2_model, fibo2_edit_inputs)


class TestBriaFibo2(ConformanceSuite):
    case = FIBO2
    # plain Linear layers like every Z-Image-style family's; one base keeps the file quick
    quantized_bases = ("torchao-int8",)


class TestBriaFibo2PaddedBatch(ConformanceSuite):
    case = FIBO2_PADDED
    reduced = True


class TestBriaFibo2Edit(ConformanceSuite):
    case = FIBO2_EDIT
    reduced = True


# -- the cuts -------------------------------------------------------------------------------------------------


def _plan(config: dict, model: Any = None) -> Any:
    model = model if model is not None else FIBO2.fresh()
    return plan(model, family_for(model), gradseam.CheckpointConfig.coerce(config))


def test_seams_and_chunks_are_planned_as_declared() -> None:
    model = FIBO2.fresh()
    assert family_for(model).name == "bria-fibo2"
    seams = [(r.list_path, r.blocks, r.seam) for r in _plan(FFN, model).regions]
    assert seams == [
        *((LISTS[0], (i,), BLOCK_SEAM) for i in range(2)),
        *((LISTS[1], (i,), PERCEIVER_SEAM) for i in range(2)),
        *((LISTS[2], (i,), BLOCK_SEAM) for i in range(4)),
    ]
    # interval 2: the refiner and the Perceiver in one chunk each, the main blocks one region each (no carry)
    chunks = [(r.list_path, r.blocks, r.shape) for r in _plan(CHUNKED, model).regions]
    assert chunks == [(LISTS[0], (0, 1), "chunk"), (LISTS[1], (0, 1), "chunk"),
                      *((LISTS[2], (i,), "block") for i in range(4))]


def test_cross_attention_is_an_attention_side_where_the_block_has_one() -> None:
    # attention offload outside any region: one region per attention module the block really has
    model = FIBO2.fresh()
    assert [i for i, b in enumerate(model.layers) if b.cross_attention is not None] == list(INJECTION)
    regions = _plan({"gradient_checkpointing_offload_attention": True}, model).regions
    sides = [(r.list_path, r.blocks[0], r.seam[0]) for r in regions]
    assert sides == [
        *((LISTS[0], i, "attention") for i in range(2)),
        *((LISTS[1], i, side) for i in range(2) for side in ("cross_attention", "self_attention")),
        *((LISTS[2], i, side) for i in range(4) for side in ("attention", "cross_attention")[: 1 + (i in INJECTION)]),
    ]


# -- why the main blocks take no carry ------------------------------------------------------------------------


def test_a_carry_on_layers_would_run_an_injection_block_without_its_text() -> None:
    # What a carry on `layers` would do: a chunk [0, 1] runs block 1 (an injection block) ahead with block 0's
    # arguments, encoder_hidden_states=None among them, so its cross-attention attends to its own 24-wide input
    # through a to_k made for 12-wide text, and the step fails inside the checkpoint. (At full size too: 3584 vs
    # 7680.) A subclass registered with such a family shows it; the real family plans no chunk there.
    from diffusers import BriaFibo2Transformer2DModel

    class Carried(BriaFibo2Transformer2DModel):
        pass

    base = gradseam.registry.REGISTRY.get("bria-fibo2")
    carried = Family(
        name="bria-fibo2-carried-layers", models=(Carried,), block_classes=base.block_classes,
        block_lists=(*base.block_lists[:2], BlockList("layers", carry=Carry({"x": None}))),
    )

    class Plugin:
        @hookimpl
        def register_families(self, register: Any) -> None:
            register(carried)

    torch.manual_seed(0)
    model = fibo2_model(Carried)
    x = fibo2_inputs(torch.Generator().manual_seed(0))
    gradseam.register(Plugin(), name="bria-fibo2-carried-layers")
    try:
        with gradseam.patch(model, CHUNKED) as handle:
            assert handle.family is carried
            with pytest.raises(RuntimeError, match="cannot be multiplied"):
                model(**x).sample.sum().backward()
    finally:
        gradseam.unregister("bria-fibo2-carried-layers")


def test_the_loop_hands_each_injection_block_its_own_bundle() -> None:
    # The main loop: an injection block gets a fresh view of its own bundle (k-th after the Perceiver's), every
    # other block None; the masks, RoPE and timestep embeddings are one object for every block of a list (what
    # the refiner's and the Perceiver's carries rely on), and the layers get the text mask as it was passed.
    model = FIBO2_PADDED.fresh()
    seen: dict[str, list[tuple[tuple, dict]]] = {path: [] for path in LISTS}
    for path, blocks in zip(LISTS, (model.noise_refiner, model.perceiver.layers, model.layers)):
        for block in blocks:
            block.register_forward_pre_hook(lambda _m, a, kw, p=path: seen[p].append((a, kw)), with_kwargs=True)
    x = fibo2_padded_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        masked = model(**x).sample
        plain = model(**{**x, "encoder_attention_mask": None}).sample
    layers = seen["layers"][:4]
    text = x["encoder_hidden_states"]
    for i, (_, kw) in enumerate(layers):
        bundle = kw["encoder_hidden_states"]
        if i in INJECTION:
            assert torch.equal(bundle, text[:, 1 + INJECTION.index(i)])
        else:
            assert bundle is None
        assert kw["encoder_attention_mask"] is x["encoder_attention_mask"]
    for path, calls in seen.items():
        calls = calls[: len(layers) if path == "layers" else 2]
        args0, kw0 = calls[0]
        shared = [name for name in kw0 if name != "encoder_hidden_states"]
        assert all(u is v for args, _ in calls for u, v in zip(args[1:], args0[1:])), path
        assert all(kw[name] is kw0[name] for _, kw in calls for name in shared), path
    assert seen["layers"][0][0][1] is not None  # the gist mask made the main blocks' attention mask
    assert not torch.equal(masked[1], plain[1])  # and the text mask changes the padded sample


def test_diffusers_flag() -> None:
    # diffusers' path passes the refiner's and the main blocks' arguments positionally; the edit case has them all
    check_builtin_flag(FIBO2_EDIT, FFN)


# -- the presets at full size ---------------------------------------------------------------------------------
_preset = functools.cache(preset_model)  # each meta model built once; planning leaves it as it was
PRESETS = ("2.0-1024", "2.0-edit-1024")


def test_presets_plan_at_full_size() -> None:
    family, preset, model = _preset("bria-fibo2", PRESETS[0])
    assert tuple(family.presets) == PRESETS and family_for(model) is family
    assert all(p.config == {} for p in family.presets.values())  # the class defaults
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 8.13
    block = model.layers[0]
    assert (block.attention.heads, block.attention.to_q.out_features, block.feed_forward.w1.out_features) == (
        28, 3584, 9536)
    injection = [i for i, b in enumerate(model.layers) if b.cross_attention is not None]
    assert injection == [6, 14, 22, 30, 38] and block.cross_attention is None
    assert (len(model.noise_refiner), len(model.perceiver.layers), len(model.layers)) == (2, 2, 44)
    for config, regions in (({"gradient_checkpointing": True}, 48), (CHUNKED, 1 + 1 + 44), (FFN, 48)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert len(the_plan.regions) == regions
        assert blocks_per_list(the_plan.regions) == dict(zip(LISTS, (2, 2, 44)))


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    from diffusers.models.transformers.transformer_bria_fibo2 import compute_gist_count

    _, preset, model = _preset("bria-fibo2", PRESETS[0])
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    # 1024x1024 through the 8x Flux 2 VAE: 128 x 128 latents of 32 channels, 64 x 64 tokens of 2x2 patches
    assert x["hidden_states"].shape == (1, 32, 128, 128) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 6, 1176, 7680) and x["timestep"].shape == (1,)
    assert "context_latents" not in x and "encoder_attention_mask" not in x
    assert compute_gist_count([1176], 256, 512, 64, 256, 2048) == [448]
    assert preset.make_inputs(model, "meta", torch.bfloat16, 1024)["hidden_states"].shape == (1, 32, 64, 64)
    edit = gradseam.registry.REGISTRY.get("bria-fibo2").presets[PRESETS[1]]
    x = edit.make_inputs(model, "meta", torch.bfloat16, None, **edit.inputs)
    assert [t.shape for t in x["context_latents"]] == [(1, 32, 128, 128)]


def test_preset_input_builder_runs_the_model() -> None:
    preset = gradseam.registry.REGISTRY.get("bria-fibo2").presets[PRESETS[1]]
    model = FIBO2.fresh()
    x = preset.make_inputs(model, "cpu", torch.float32, 4, text_tokens=TEXT, context_images=1)
    assert x["hidden_states"].shape == (1, CHANNELS, 4, 4) and x["encoder_hidden_states"].shape == (1, 3, TEXT, CAP)
    out = model(**x).sample
    assert out.shape == (1, CHANNELS, 4, 4)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_and_patches_exactly() -> None:
    """`gradseam bench --family bria-fibo2 --layers 2` on a tiny preset with the real input builder: 4 image
    tokens, 4 gist tokens (6 prompt tokens), two main blocks (no injection block among them)."""
    check_bench_workload("bria-fibo2", TINY, {"image_tokens": 4, "text_tokens": TEXT}, sequence=4 + 4)
