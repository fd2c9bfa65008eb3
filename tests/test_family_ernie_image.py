"""ERNIE-Image: a tiny deterministic model through the conformance kit, a batch of two prompts of
different lengths (the text mask) on a non-square image, interval chunks that really chain although
the loop builds a new modulation list per block, and the preset at full size."""

from __future__ import annotations

import torch
from family_checks import assert_plans_cover_every_block

import gradseam
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_bench_workload,
    check_strategy,
    randn,
)

LAYERS, CHANNELS, TEXT_DIM = 4, 4, 12
CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}


TINY = dict(
    hidden_size=16, num_attention_heads=2, num_layers=LAYERS, ffn_hidden_size=32, in_channels=CHANNELS,
    out_channels=CHANNELS, patch_size=1, text_in_dim=TEXT_DIM, rope_axes_dim=(2, 2, 4),
)


def ernie_model():
    from diffusers import ErnieImageTransformer2DModel

    model = ErnieImageTransformer2DModel(**TINY)
    # upstream zero-initialises the AdaLN projection and the output layer (so a fresh model's gates
    # are 0 and its output is 0): every gradient would vanish and the parity checks would be vacuous
    for layer in (model.adaLN_modulation[-1], model.final_linear):
        torch.nn.init.normal_(layer.weight, std=0.3)
        torch.nn.init.normal_(layer.bias, std=0.3)
    return model


def ernie_inputs(g: torch.Generator) -> dict:
    # 2 x 2 image tokens, 3 text tokens
    return {
        "hidden_states": randn(g, 1, CHANNELS, 2, 2, grad=True),
        "timestep": torch.tensor([500.0]),
        "text_bth": randn(g, 1, 3, TEXT_DIM, grad=True),
        "text_lens": torch.tensor([3]),
    }


def ernie_padded_inputs(g: torch.Generator) -> dict:
    # two prompts padded to the longer one (the pipeline's _pad_text), a 2 x 3 image, a timestep each
    text = randn(g, 2, 4, TEXT_DIM, grad=True)
    with torch.no_grad():
        text[1, 2:] = 0  # what the pipeline writes into the padding
    return {
        "hidden_states": randn(g, 2, CHANNELS, 2, 3, grad=True),
        "timestep": torch.tensor([700.0, 300.0]),
        "text_bth": text,
        "text_lens": torch.tensor([4, 2]),
    }


ERNIE = Case("ernie-image", ernie_model, ernie_inputs)
ERNIE_PADDED = Case("ernie-image-padded", ernie_model, ernie_padded_inputs)


# -- The conformance kit ------------------------------------------------------------------------
BACKEND = "gradient_checkpointing_backend"


class TestErnieImage(ConformanceSuite):
    case = ERNIE


class TestErnieImagePadded(ConformanceSuite):
    case = ERNIE_PADDED
    reduced = True


# -- What the suites cannot see -------------------------------------------------------------------

def test_the_loop_hands_each_block_a_new_list_of_the_same_tensors() -> None:
    # What the carry relies on: the temb list is a new object per block, its six tensors are not.
    model = ERNIE.fresh()
    seen: list[list] = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda _m, args: seen.append(args[2]))
    with torch.no_grad():
        model(**ernie_inputs(torch.Generator().manual_seed(1)))
    assert len(seen) == LAYERS and len({id(t) for t in seen}) == LAYERS
    assert all(len(t) == 6 and all(a is b for a, b in zip(t, seen[0])) for t in seen)


def test_interval_chunks_chain_with_the_rebuilt_list() -> None:
    for case in (ERNIE, ERNIE_PADDED):
        report = check_strategy(case, CHUNKED, whole=True)
        chunks = [r for r in report.regions if r.shape == "chunk"]
        assert [r.label for r in chunks] == ["layers[0, 1]", "layers[2, 3]"]
        assert all(not r.fallbacks for r in chunks)
        # not vacuous: every block parameter gets a gradient (the upstream zero init would give none)
        grads = {n: g for n, g in report.reference.param_grads.items() if n.startswith("layers.")}
        assert grads and all(g.abs().sum() > 0 for g in grads.values()), case.name


def test_ffn_seam_in_every_block() -> None:
    model = ERNIE.fresh()
    family = family_for(model)
    assert family.name == "ernie-image"
    the_plan = plan(model, family, gradseam.CheckpointConfig.coerce({"gradient_checkpointing": True,
                                                                     BACKEND: "torch-ffn"}))
    assert [(r.blocks, r.seam) for r in the_plan.regions] == [((i,), ("mlp",)) for i in range(LAYERS)]


def test_the_text_mask_reaches_the_blocks() -> None:
    # The padded prompt's masked tokens get no gradient from the image; the valid ones do; treating
    # the padding as text changes the output.
    report = check_strategy(ERNIE_PADDED, CHUNKED)
    grad = report.patched.input_grads["text_bth"]
    assert grad[1, :2].abs().sum() > 0 and grad[1, 2:].eq(0).all() and grad[0].abs().sum(-1).gt(0).all()
    model = ERNIE_PADDED.fresh()

    def out(**change) -> torch.Tensor:
        with torch.no_grad():
            return model(**{**ernie_padded_inputs(torch.Generator().manual_seed(1)), **change}).sample

    assert not torch.equal(out(), out(text_lens=torch.tensor([4, 4])))


# -- Presets: the real-size config builds (on the meta device) and plans at full size -------------
def _meta():
    from diffusers import ErnieImageTransformer2DModel

    family = next(f for f in gradseam.families() if f.name == "ernie-image")
    preset = family.presets["1024"]
    with torch.device("meta"):
        return family, preset, ErnieImageTransformer2DModel(**preset.config)


def test_preset_plans_at_full_size() -> None:
    family, _, model = _meta()
    assert family_for(model) is family
    block = model.layers[0]
    assert (block.self_attention.heads, block.self_attention.head_dim, block.mlp.gate_proj.out_features) == (
        32, 128, 12288)
    assert 7.9e9 < sum(p.numel() for p in model.parameters()) < 8.1e9
    assert_plans_cover_every_block(model, family, 36, (
        ({"gradient_checkpointing": True}, 36), (CHUNKED, 18),
        ({"gradient_checkpointing": True, BACKEND: "torch-ffn"}, 36)
    ))


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    _, preset, model = _meta()
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 128, 64, 64) and x["hidden_states"].requires_grad
    assert x["text_bth"].shape == (1, 512, 3072) and x["text_lens"].shape == (1,)
    assert preset.make_inputs(model, "meta", torch.bfloat16, 1024)["hidden_states"].shape == (1, 128, 32, 32)


def test_preset_input_builder_runs_the_model() -> None:
    _, preset, _ = _meta()
    model = ERNIE.fresh()
    x = preset.make_inputs(model, "cpu", torch.float32, 9, text_tokens=3)
    out = model(**x).sample
    assert out.shape == (1, CHANNELS, 3, 3)
    out.square().mean().backward()
    assert x["hidden_states"].grad.abs().sum() > 0


def test_bench_workload_truncates_steps_and_patches_exactly() -> None:
    """`gradseam bench --family ernie-image --layers 2` on a tiny preset with the real input builder: the kit's check."""
    check_bench_workload("ernie-image", TINY, {"image_tokens": 4, "text_tokens": 3}, sequence=4 + 3)
