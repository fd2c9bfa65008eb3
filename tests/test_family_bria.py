"""Bria 3.2 (``bria``) and Bria FIBO (``bria-fibo``): tiny deterministic models through the conformance kit,
input variants, what the suites cannot see, and the presets at full size.

bria: the plain case runs the kit's whole matrix; a CFG-style batch of two (two timesteps, the pipeline's
``attention_kwargs``) a reduced one; ControlNet residuals (out of place after double blocks, in place
after single blocks) one chunked step whose chunks must fall back, exactly, for those reasons.
bria-fibo: the plain case (one LLM layer per block, the last one repeated as the pipeline does) runs the
whole matrix, which has no interval rows since the lists declare no carry; a padded batch of two with the
pipeline's key-padding mask in ``joint_attention_kwargs`` a reduced one. Then: the seams and the plans,
why FIBO has no carry, diffusers' own checkpointing flag, and the presets with their input builders.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import pytest
import torch
from family_checks import blocks_per_list

import gradseam
from gradseam.errors import GradseamWarning
from gradseam.inputs import flux_ids
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
LISTS = ("transformer_blocks", "single_transformer_blocks")
TEXT, TEXT_DIM, SIDE, CHANNELS, WIDTH = 4, 12, 3, 8, 16  # prompt tokens and width, 3 x 3 latent tokens

# 2 heads x 8 = 16 wide, 2 double + 2 single blocks; Bria 3.2's RoPE has an empty first axis, as here.
TINY = dict(
    patch_size=1, in_channels=CHANNELS, num_layers=2, num_single_layers=2, attention_head_dim=8,
    num_attention_heads=2, joint_attention_dim=TEXT_DIM, axes_dims_rope=[0, 4, 4],
)
TINY_FIBO = dict(TINY, axes_dims_rope=[2, 2, 4], text_encoder_dim=8)


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    img_ids, txt_ids = flux_ids(TEXT, SIDE * SIDE, "cpu")
    return img_ids.float(), txt_ids.float()


def bria_model() -> Any:
    from diffusers import BriaTransformer2DModel

    return BriaTransformer2DModel(**TINY)


def bria_inputs(g: torch.Generator) -> dict:
    img_ids, txt_ids = _ids()
    return {
        "hidden_states": randn(g, 1, SIDE * SIDE, CHANNELS, grad=True),
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM, grad=True),
        "timestep": torch.tensor([500.0]),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
    }


def bria_batch_inputs(g: torch.Generator) -> dict:
    # classifier-free guidance as BriaPipeline batches it (negative and positive prompt), here at two
    # timesteps, with the pipeline's attention_kwargs (the LoRA-scale decorator pops "scale")
    img_ids, txt_ids = _ids()
    return {
        "hidden_states": randn(g, 2, SIDE * SIDE, CHANNELS, grad=True),
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
        "timestep": torch.tensor([120.0, 870.0]),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
        "attention_kwargs": {"scale": 1.0},
    }


def bria_controlnet_inputs(g: torch.Generator) -> dict:
    # one residual for both double blocks, one per single block; upstream adds the single blocks' residual
    # to the image stream from the text length on (so it has SIDE^2 - TEXT tokens)
    return {
        **bria_inputs(g),
        "controlnet_block_samples": [randn(g, 1, SIDE * SIDE, WIDTH, grad=True)],
        "controlnet_single_block_samples": [randn(g, 1, SIDE * SIDE - TEXT, WIDTH, grad=True) for _ in range(2)],
    }


def fibo_model() -> Any:
    from diffusers import BriaFiboTransformer2DModel

    return BriaFiboTransformer2DModel(**TINY_FIBO)


def _llm_layers(g: torch.Generator, batch: int) -> list[torch.Tensor]:
    # one LLM hidden state per block (2 + 2); as the pipeline pads a short stack, the last one repeated
    layers = [randn(g, batch, TEXT, 8, grad=True) for _ in range(3)]
    return [*layers, layers[-1]]


def fibo_inputs(g: torch.Generator) -> dict:
    img_ids, txt_ids = _ids()
    return {
        "hidden_states": randn(g, 1, SIDE * SIDE, CHANNELS, grad=True),
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM, grad=True),
        "text_encoder_layers": _llm_layers(g, 1),
        "timestep": torch.tensor([500.0]),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
    }


def _padding_mask() -> torch.Tensor:
    # BriaFiboPipeline: the prompts' token mask (the second prompt two tokens shorter, right-padded) then
    # the latents', as a bool key-padding mask (batch, 1, 1, seq) in joint_attention_kwargs
    text = torch.ones(2, TEXT)
    text[1, -2:] = 0
    return torch.cat([text, torch.ones(2, SIDE * SIDE)], dim=1).bool()[:, None, None, :]


def fibo_mask_inputs(g: torch.Generator) -> dict:
    img_ids, txt_ids = _ids()
    return {
        "hidden_states": randn(g, 2, SIDE * SIDE, CHANNELS, grad=True),
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
        "text_encoder_layers": _llm_layers(g, 2),
        "timestep": torch.tensor([300.0, 800.0]),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
        "joint_attention_kwargs": {"attention_mask": _padding_mask()},
    }


BRIA = Case("bria", bria_model, bria_inputs)
BRIA_BATCH = Case("bria-cfg-batch", bria_model, bria_batch_inputs)
BRIA_CONTROLNET = Case("bria-controlnet", bria_model, bria_controlnet_inputs)
FIBO = Case("bria-fibo", fibo_model, fibo_inputs)
FIBO_MASK = Case("bria-fibo-padded-batch", fibo_model, fibo_mask_inputs)


class TestBria(ConformanceSuite):
    case = BRIA


class TestBriaBatch(ConformanceSuite):
    case = BRIA_BATCH
    reduced = True


class TestBriaFibo(ConformanceSuite):
    case = FIBO
    # its blocks hold the same plain Linear layers as Bria's, whose suite runs every base
    quantized_bases = ("torchao-int8",)


class TestBriaFiboPaddedBatch(ConformanceSuite):
    case = FIBO_MASK
    reduced = True


# -- the cuts -----------------------------------------------------------------------------------------


def _plan(case: Case, config: dict) -> Any:
    model = case.fresh()
    return plan(model, family_for(model), gradseam.CheckpointConfig.coerce(config))


@pytest.mark.parametrize(("case", "family"), [(BRIA, "bria"), (FIBO, "bria-fibo")], ids=["bria", "fibo"])
def test_seams_are_the_mlps(case: Case, family: str) -> None:
    model = case.fresh()
    assert family_for(model).name == family
    seams = [(r.list_path, r.blocks, r.seam) for r in _plan(case, FFN).regions]
    assert seams == [
        *((LISTS[0], (i,), s) for i in range(2) for s in (("ff",), ("ff_context",))),
        *((LISTS[1], (i,), ("proj_mlp", "act_mlp")) for i in range(2)),
    ]


def test_bria_chunks_cover_both_lists() -> None:
    # the suite's chunked rows run whole (a wrong carry would fall back); here: they are the chunks planned
    chunks = [(r.list_path, r.blocks, r.shape) for r in _plan(BRIA, CHUNKED).regions]
    assert chunks == [(path, (0, 1), "chunk") for path in LISTS]


def test_bria_controlnet_residuals_make_chunks_fall_back_exactly() -> None:
    # After a double block the loop adds its residual out of place (a new object), after a single block in
    # place into the returned image view (a newer version): each chunk computes block by block, exactly,
    # gradients of the residuals included.
    report = check_strategy(BRIA_CONTROLNET, CHUNKED)
    reasons = {r.list_path: " ".join(r.fallbacks) for r in report.regions if r.shape == "chunk"}
    assert "replaced" in reasons[LISTS[0]] and "changed in place" in reasons[LISTS[1]], reasons
    grads = report.patched.input_grads
    assert all(grads[f"controlnet_single_block_samples[{i}]"].abs().sum() > 0 for i in range(2))


def test_fibo_takes_no_interval_and_each_block_is_a_region() -> None:
    family = TestBriaFibo.family()
    assert not family.supports_interval
    assert not any(c.get("gradient_checkpointing_interval") for c in TestBriaFibo.strategy_configs())
    with pytest.warns(GradseamWarning, match="does not support gradient_checkpointing_interval"):
        regions = _plan(FIBO, CHUNKED).regions
    assert [(r.list_path, r.blocks, r.shape) for r in regions] == [
        (path, (i,), "block") for path in LISTS for i in range(2)
    ]


def test_fibo_loop_builds_every_blocks_input_afresh() -> None:
    # Why FIBO declares no carry: the text stream a double block gets is not what the previous block
    # returned (the loop swaps half its channels for that block's own LLM layer), and a single block gets
    # a concatenation made between blocks; temb, RoPE and joint_attention_kwargs are shared objects.
    model = FIBO_MASK.fresh()
    seen: list[dict] = []
    returned: list[Any] = []
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        block.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw), with_kwargs=True)
        block.register_forward_hook(lambda _m, _a, _kw, out: returned.append(out), with_kwargs=True)
    inputs = fibo_mask_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        masked = model(**inputs).sample
        plain = model(**{**inputs, "joint_attention_kwargs": None}).sample
    seen, returned = seen[:4], returned[:4]
    assert seen[1]["encoder_hidden_states"] is not returned[0][0]
    assert torch.equal(seen[1]["encoder_hidden_states"][..., :8], returned[0][0][..., :8])
    assert not any(kw["hidden_states"] is out for kw, out in zip(seen[2:], [returned[1][1], returned[2]]))
    for name in ("temb", "image_rotary_emb", "joint_attention_kwargs"):
        assert all(kw[name] is seen[0][name] for kw in seen), name
    # the mask reaches the blocks: only the padded sample changes without it
    assert torch.equal(masked[0], plain[0]) and not torch.equal(masked[1], plain[1])


@pytest.mark.parametrize(("case", "config"), [(BRIA, CHUNKED), (FIBO_MASK, FFN)], ids=["bria", "fibo"])
def test_diffusers_flag(case: Case, config: dict) -> None:
    check_builtin_flag(case, config)


# -- the presets at full size ---------------------------------------------------------------------------
_preset = functools.cache(preset_model)  # each meta model built once; planning leaves it as it was

PRESETS = {  # family: (preset, double, single, heads x head dim, FFN width, parameters in billions)
    "bria": ("3.2-1024", 8, 28, (24, 96), 9216, 3.79),
    "bria-fibo": ("8b-1024", 8, 38, (24, 128), 12288, 8.29),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_plan_at_full_size(name: str) -> None:
    preset_name, double, single, heads, ffn, billions = PRESETS[name]
    family, preset, model = _preset(name, preset_name)
    assert set(family.presets) == {preset_name} and family_for(model) is family
    params = set(inspect.signature(type(model).__init__).parameters) - {"self"}
    assert set(preset.config) == params  # every constructor argument, spelled out
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == billions
    block = model.transformer_blocks[0]
    assert (block.attn.heads, block.attn.head_dim) == heads and block.ff.net[0].proj.out_features == ffn
    chunked = 0 if name == "bria-fibo" else double // 2 + single // 2
    for config, regions in (({"gradient_checkpointing": True}, double + single), (FFN, 2 * double + single),
                            (CHUNKED, chunked or double + single)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GradseamWarning)  # FIBO ignores the interval
            the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert len(the_plan.regions) == regions
        assert blocks_per_list(the_plan.regions) == {LISTS[0]: double, LISTS[1]: single}


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    _, preset, model = _preset("bria", "3.2-1024")
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 4096, 16) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 128, 4096)
    assert x["img_ids"].shape == (4096, 3) and x["txt_ids"].shape == (128, 3)
    assert preset.make_inputs(model, "meta", torch.bfloat16, 1024)["hidden_states"].shape == (1, 1024, 16)
    _, preset, model = _preset("bria-fibo", "8b-1024")
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 4096, 48) and x["encoder_hidden_states"].shape == (1, 1176, 4096)
    layers = x["text_encoder_layers"]
    # SmolLM3-3B's 37 hidden states, the last repeated up to one per block (46)
    assert len(layers) == 46 and len({id(t) for t in layers}) == 37 and layers[-1] is layers[36]
    assert all(t.shape == (1, 1176, 2048) for t in layers)


@pytest.mark.parametrize(("name", "case"), [("bria", BRIA), ("bria-fibo", FIBO)], ids=["bria", "fibo"])
def test_preset_input_builder_runs_the_model(name: str, case: Case) -> None:
    preset = gradseam.registry.REGISTRY.get(name).presets[PRESETS[name][0]]
    model = case.fresh()
    x = preset.make_inputs(model, "cpu", torch.float32, 9, text_tokens=TEXT)
    out = model(**x).sample
    assert out.shape == (1, 9, CHANNELS)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


@pytest.mark.parametrize(("name", "config", "sequence"), [("bria", TINY, 9), ("bria-fibo", TINY_FIBO, TEXT + 9)],
                         ids=["bria", "fibo"])
def test_bench_workload_truncates_steps_and_patches_exactly(name: str, config: dict, sequence: int) -> None:
    """`gradseam bench --family NAME --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload(name, config, {"image_tokens": 9, "text_tokens": TEXT}, sequence=sequence)
