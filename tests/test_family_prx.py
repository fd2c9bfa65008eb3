"""PRX (PRXTransformer2DModel) through the conformance kit, plus its presets.

The plain case (one image, no mask) runs the kit's whole matrix: exact outputs and every parameter and
input gradient for ``torch`` x interval x stride, kept attention, the offload backends through the
engine's CPU test mode, quantized bases, ``no_grad``, and the refusals (no ``-ffn`` backend: the family
declares no FFN seam). Two variants run a reduced matrix: a batch of two as the pipelines and ai-toolkit
call the model (a padded text mask, per-sample flow times, a non-square latent, ``return_dict=False``),
and PRXPixel's configuration (RGB patches through the bottleneck ``img_in``, the resolution embedding
added to the timestep vector, a masked batch). Then: the chunks run whole, the loop hands every block
the same conditioning, a copy of the class from another module (as ai-toolkit vendors it) is patched
through the bare class names, why there is no FFN seam (and that ``-ffn`` is refused with a message
that says so), diffusers' own checkpointing flag under a patch, and the presets at full size on the
meta device.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

import pytest
import torch
from family_checks import (
    assert_ffn_backends_refused,
    check_chunks_run_whole,
    declare_ffn_seam,
    record_block_calls,
    record_first_calls,
)

import gradseam
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.registry import REGISTRY
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_bench_workload,
    check_builtin_flag,
    check_strategy,
    preset_model,
    randn,
)

TORCH = {"gradient_checkpointing": True}
CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
DEPTH, LATENT, TEXT, TEXT_DIM = 4, 4, 5, 12

# A 16-wide trunk (2 heads x 8, RoPE 4 + 4 over rows and columns), the real 3.5x MLP (56), 4 blocks so
# interval 2 forms two chunks. PRXPixel's tiny twin: RGB in 4x4 patches through an 8-wide bottleneck,
# with the resolution embedder.
TINY = {
    "in_channels": LATENT, "patch_size": 2, "context_in_dim": TEXT_DIM, "hidden_size": 16, "mlp_ratio": 3.5,
    "num_heads": 2, "depth": DEPTH, "axes_dim": [4, 4],
}
TINY_PIXEL = {**TINY, "in_channels": 3, "patch_size": 4, "bottleneck_size": 8, "resolution_embeds": True}


def _model(config: dict, cls: Any = None) -> Any:
    from diffusers import PRXTransformer2DModel

    model = (cls or PRXTransformer2DModel)(**config)
    # Modulation zero-initialises its projection: every gate would be 0 and every block the identity, so
    # attention and the MLP would get no gradient. Trained weights are not zero; give them values.
    for block in model.blocks:
        torch.nn.init.normal_(block.modulation.lin.weight, std=0.3)
        torch.nn.init.normal_(block.modulation.lin.bias, std=0.3)
    return model


def _mask(batch: int) -> torch.Tensor:
    # the tokenizer pads to max_length on the right: the last sample's last two text tokens are padding
    mask = torch.ones(batch, TEXT, dtype=torch.bool)
    mask[-1, -2:] = False
    return mask


def prx_inputs(g: torch.Generator) -> dict:
    # a 4x4 latent: 2x2 patches, 4 image tokens
    return {
        "hidden_states": randn(g, 1, LATENT, 4, 4, grad=True),
        "timestep": torch.tensor([0.4]),
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM, grad=True),
    }


def prx_batch_inputs(g: torch.Generator) -> dict:
    # as PRXPipeline and ai-toolkit call it: the tokenizer's bool mask, flow times in [0, 1] per sample, a
    # 4x8 latent (2x4 patches: a non-square RoPE grid) and a plain tuple back
    return {
        "hidden_states": randn(g, 2, LATENT, 4, 8, grad=True),
        "timestep": torch.tensor([0.15, 0.85]),
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
        "attention_mask": _mask(2),
        "return_dict": False,
    }


def pixel_inputs(g: torch.Generator) -> dict:
    # RGB 8x12 pixels: 2x3 patches of 4x4; the resolution embedder sees (8, 12)
    return {
        "hidden_states": randn(g, 2, 3, 8, 12, grad=True),
        "timestep": torch.tensor([0.3, 0.7]),
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
        "attention_mask": _mask(2),
    }


PRX = Case("prx", lambda: _model(TINY), prx_inputs)
PRX_BATCH = Case("prx-masked-batch", lambda: _model(TINY), prx_batch_inputs)
PRX_PIXEL = Case("prxpixel", lambda: _model(TINY_PIXEL), pixel_inputs)


class TestPRX(ConformanceSuite):
    case = PRX


class TestPRXMaskedBatch(ConformanceSuite):
    case = PRX_BATCH
    reduced = True


class TestPRXPixel(ConformanceSuite):
    case = PRX_PIXEL
    reduced = True


# -- the carry ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [PRX_BATCH, PRX_PIXEL], ids=lambda c: c.name)
def test_chunks_run_whole(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back), so parity alone cannot tell: both chunks
    # must be served whole, and the text states, read by every block, still get their gradient.
    report = check_chunks_run_whole(case, CHUNKED, ["blocks[0, 1]", "blocks[2, 3]"])
    assert report.saved_ratio < 1
    assert report.patched.input_grads["encoder_hidden_states"].abs().sum() > 0


@pytest.mark.parametrize("case", [PRX_BATCH, PRX_PIXEL], ids=lambda c: c.name)
def test_the_loop_hands_every_block_the_same_conditioning(case: Case) -> None:
    # What the carry relies on: the text states, the timestep vector, the RoPE table and the mask are one
    # object each for every block (the caller's mask itself); hidden_states is what the last block returned.
    model = case.fresh()
    inputs = case.inputs(torch.Generator().manual_seed(1))
    seen, returned = record_block_calls(model.blocks)
    with torch.no_grad():
        model(**inputs)
    assert len(seen) == DEPTH
    for name in ("encoder_hidden_states", "temb", "image_rotary_emb", "attention_mask"):
        assert all(kw[name] is seen[0][name] for kw in seen), (case.name, name)
    assert seen[0]["attention_mask"] is inputs["attention_mask"]
    assert seen[0]["temb"].shape == (2, 16) and not torch.equal(seen[0]["temb"][0], seen[0]["temb"][1])
    for before, kw in zip(returned, seen[1:]):
        assert kw["hidden_states"] is before


def _output(case: Case, **changes: Any) -> torch.Tensor:
    model = case.fresh()
    with torch.no_grad():
        out = model(**{**case.inputs(torch.Generator().manual_seed(1)), **changes})
    return out[0]


def test_variant_inputs_change_the_output() -> None:
    # The variants exercise their paths: the mask, the per-sample flow times and PRXPixel's resolution
    # embedding (another picture size changes the timestep vector, not only the token count) all matter.
    batch = _output(PRX_BATCH)
    assert not torch.equal(batch, _output(PRX_BATCH, attention_mask=None))
    assert not torch.equal(batch, _output(PRX_BATCH, timestep=torch.tensor([0.15, 0.15])))
    model = PRX_PIXEL.fresh()
    x = torch.zeros(1, 3, 8, 12)
    vec: list[torch.Tensor] = []
    model.blocks[0].register_forward_pre_hook(lambda _m, _a, kw: vec.append(kw["temb"]), with_kwargs=True)
    with torch.no_grad():
        model(x, torch.tensor([0.5]), torch.zeros(1, TEXT, TEXT_DIM))
        model(x.transpose(2, 3), torch.tensor([0.5]), torch.zeros(1, TEXT, TEXT_DIM))
    assert len(vec) == 2 and not torch.equal(vec[0], vec[1])


# -- a copy of the class from another module (ai-toolkit's vendored PRX) ----------------------


@cache
def _vendored() -> Any:
    # diffusers' module executed a second time under another name: classes of the same names that are
    # not diffusers' nor subclasses of them, as ai-toolkit's vendored transformer_prx.py defines
    import importlib.util

    import diffusers.models.transformers.transformer_prx as upstream

    spec = importlib.util.spec_from_file_location("diffusers.models.transformers._prx_copy", upstream.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_vendored_copy_of_the_class_is_patched_too() -> None:
    # The family names PRXTransformer2DModel and PRXBlock bare, so ai-toolkit's copy (another module,
    # the same code) resolves to it and patches exactly, chunks whole.
    from diffusers import PRXTransformer2DModel

    copy = _vendored()
    case = Case("prx-vendored", lambda: _model(TINY, copy.PRXTransformer2DModel), prx_batch_inputs)
    model = case.fresh()
    assert not isinstance(model, PRXTransformer2DModel)
    assert type(model.blocks[0]).__module__ == "diffusers.models.transformers._prx_copy"
    assert family_for(model) is REGISTRY.get("prx")
    check_chunks_run_whole(case, CHUNKED, ["blocks[0, 1]", "blocks[2, 3]"])


# -- no FFN seam --------------------------------------------------------------------------------


def test_the_gated_mlp_is_inline_between_bare_linears() -> None:
    # Why no seam spans the MLP: gate_proj and up_proj are both called on x, and down_proj on the
    # product the block forms, never on a submodule's return value. gate_proj -> mlp_act is the only
    # strict chain, and post_attention_layernorm's output is modulated before the projections see it.
    model = PRX.fresh()
    block = model.blocks[0]
    calls = record_first_calls(block, ("post_attention_layernorm", "gate_proj", "up_proj", "mlp_act", "down_proj"))
    with torch.no_grad():
        model(**prx_inputs(torch.Generator().manual_seed(1)))
    assert calls["up_proj"][0][0] is calls["gate_proj"][0][0]
    assert calls["gate_proj"][0][0] is not calls["post_attention_layernorm"][1]
    assert calls["mlp_act"][0][0] is calls["gate_proj"][1]
    assert calls["down_proj"][0][0] is not calls["mlp_act"][1]
    assert calls["down_proj"][0][0].shape[-1] == block.mlp_hidden_dim == 56


def test_ffn_backends_are_refused_and_leave_the_model_untouched() -> None:
    assert_ffn_backends_refused(PRX, "prx")


def test_a_gate_proj_act_seam_would_be_exact_but_keep_most(monkeypatch: pytest.MonkeyPatch) -> None:
    # The one strict chain, declared for this test only: exact and whole, but the GELU output, up_proj's
    # output and the product stay saved outside it, so a step keeps most of what it keeps unpatched,
    # while whole blocks keep far less.
    declare_ffn_seam(monkeypatch, "prx", ("gate_proj", "mlp_act"))
    seam = check_strategy(PRX, {**TORCH, "gradient_checkpointing_backend": "torch-ffn"}, whole=True)
    assert [r.label for r in seam.regions] == [f"blocks[{i}].gate_proj→mlp_act" for i in range(DEPTH)]
    assert seam.saved_ratio > 0.85
    assert check_strategy(PRX, TORCH).saved_ratio < 0.5


# -- diffusers' own checkpointing flag ----------------------------------------------------------


def test_builtin_flag_is_exact_and_suspended_while_patched() -> None:
    # the model's own path: _gradient_checkpointing_func(block.__call__, img, txt, vec, pe, mask), positional
    check_builtin_flag(PRX_BATCH, CHUNKED)


# -- presets at full size -----------------------------------------------------------------------

# name: (in_channels, latent side, depth, heads x head_dim, MLP, text width, parameters in billions)
PRESETS = {
    "prx-512": (16, 64, 16, (28, 64), 6272, 2304, 1.17),
    "prx-1024": (16, 128, 16, (28, 64), 6272, 2304, 1.17),
    "prx-dc-ae-512": (32, 16, 16, (28, 64), 6272, 2304, 1.17),
    "prxpixel-1024": (3, 1024, 24, (28, 128), 12544, 2048, 7.0),
}
IMAGE_TOKENS = {"prx-512": 1024, "prx-1024": 4096, "prx-dc-ae-512": 256, "prxpixel-1024": 4096}


def test_preset_configs_are_the_published_ones() -> None:
    from diffusers import PRXTransformer2DModel

    family = REGISTRY.get("prx")
    assert set(family.presets) == set(PRESETS)
    defaults = {k: p.default for k, p in inspect.signature(PRXTransformer2DModel.__init__).parameters.items()}
    flux = family.presets["prx-512"].config
    # the Flux-VAE variant is the class defaults (axes_dim's default None stands for [32, 32])
    assert {k: v for k, v in flux.items() if k != "axes_dim"} == {
        k: defaults[k] for k in flux if k != "axes_dim"}
    assert flux["axes_dim"] == [32, 32] and family.presets["prx-1024"].config == flux


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_plans_at_full_size(name: str) -> None:
    channels, _, depth, heads, mlp, text, billions = PRESETS[name]
    family, _, model = preset_model("prx", name)
    assert family_for(model) is family
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - billions) < 0.01
    block = model.blocks[0]
    assert (len(model.blocks), (block.attention.heads, block.attention.head_dim), block.mlp_hidden_dim,
            model.txt_in.in_features, model.in_channels) == (depth, heads, mlp, text, channels)
    assert (model.resolution_embedder is not None) == (name == "prxpixel-1024")
    for config, regions in ((TORCH, depth), (CHUNKED, depth // 2),
                            ({**TORCH, "gradient_checkpointing_keep_attention": True}, depth)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert {b for r in the_plan.regions for b in r.blocks} == set(range(depth))
        assert len(the_plan.regions) == regions


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_inputs_have_the_pipelines_sizes(name: str) -> None:
    channels, side, *_ = PRESETS[name]
    _, preset, model = preset_model("prx", name)
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, channels, side, side) and x["hidden_states"].requires_grad
    assert x["hidden_states"].dtype == torch.bfloat16
    p = model.config.patch_size
    assert (side // p) ** 2 == IMAGE_TOKENS[name]
    assert x["encoder_hidden_states"].shape == (1, 256, model.config.context_in_dim)
    assert x["attention_mask"].shape == (1, 256) and x["attention_mask"].dtype == torch.bool
    assert x["timestep"].shape == (1,) and x["timestep"].dtype == torch.float32
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 100, **preset.inputs)
    assert fewer["hidden_states"].shape == (1, channels, 10 * p, 10 * p)


def test_preset_input_builder_runs_the_model() -> None:
    preset = REGISTRY.get("prx").presets["prx-512"]
    model = PRX.fresh()
    x = preset.make_inputs(model, "cpu", torch.float32, None, height=32, width=48, text_tokens=TEXT,
                           prompt_tokens=3)
    assert x["attention_mask"].tolist() == [[True] * 3 + [False] * 2]
    out = model(**x).sample
    assert out.shape == (1, LATENT, 4, 6)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


@pytest.mark.parametrize(("config", "preset", "sizes", "tokens"), [
    (TINY, "prx-512", {"height": 32, "width": 32, "downscale": 8, "text_tokens": TEXT}, 4),
    (TINY_PIXEL, "prxpixel-1024", {"height": 8, "width": 12, "downscale": 1, "text_tokens": TEXT}, 6),
], ids=["prx", "prxpixel"])
def test_bench_workload_truncates_and_patches_exactly(config: dict, preset: str, sizes: dict, tokens: int) -> None:
    """`gradseam bench --family prx --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload("prx", config, sizes, preset=preset, sequence=tokens)
