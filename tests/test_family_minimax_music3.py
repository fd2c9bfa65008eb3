"""MiniMax Music 3 (MiniMaxMusic3Transformer1DModel) through the conformance kit, plus its presets.

The plain case (one clip) runs the kit's whole matrix: exact outputs and every parameter and input
gradient for ``torch`` x interval x stride, kept attention, the offload backends through the engine's
CPU test mode, quantized bases, ``no_grad``, and the refusals (no ``-ffn`` backend: the family declares
no FFN seam). A batch of two clips at their own flow times, one of them with the all-zero condition the
unconditional (CFG-dropout) branch gets, on an odd length and called with ``return_dict=False``, runs a
reduced matrix. Then: the chunks run whole, every block gets the same RoPE tuple, why there is no FFN
seam (and that ``-ffn`` is refused with a message that says so), diffusers' own checkpointing flag
under a patch, and the presets at full size on the meta device.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from family_checks import (
    assert_ffn_backends_refused,
    check_chunks_run_whole,
    declare_ffn_seam,
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
LAYERS, LATENT, COND, INNER = 4, 4, 8, 64

# A 16-wide trunk (2 heads x 8, RoPE on the first 4 dims of each head), a GLU 4x as wide as the trunk
# (the real 8192 / 2048), a condition of its own width; four blocks, so interval 2 forms two chunks.
TINY = {
    "in_channels": LATENT, "condition_dim": COND, "num_layers": LAYERS, "num_attention_heads": 2,
    "attention_head_dim": 8, "ff_inner_dim": INNER, "rotary_dim": 4, "fourier_embedding_dim": 8,
}


def music3_model() -> Any:
    from diffusers import MiniMaxMusic3Transformer1DModel

    return MiniMaxMusic3Transformer1DModel(**TINY)


def music3_inputs(g: torch.Generator) -> dict:
    # 6 latent frames: the blocks see 7 tokens (the timestep token first)
    return {
        "hidden_states": randn(g, 1, LATENT, 6, grad=True),
        "timestep": torch.tensor([0.4]),
        "encoder_hidden_states": randn(g, 1, 6, COND, grad=True),
    }


def music3_batch_inputs(g: torch.Generator) -> dict:
    # two clips at their own flow times; the second gets the all-zero condition of the unconditional
    # branch (what the pipeline passes for CFG and trainers drop captions to); 5 frames; a plain tuple back
    condition = randn(g, 2, 5, COND)
    condition[1] = 0.0
    return {
        "hidden_states": randn(g, 2, LATENT, 5, grad=True),
        "timestep": torch.tensor([0.2, 0.9]),
        "encoder_hidden_states": condition.requires_grad_(),
        "return_dict": False,
    }


MUSIC3 = Case("minimax-music3", music3_model, music3_inputs)
MUSIC3_BATCH = Case("minimax-music3-batch", music3_model, music3_batch_inputs)


class TestMiniMaxMusic3(ConformanceSuite):
    case = MUSIC3


class TestMiniMaxMusic3Batch(ConformanceSuite):
    case = MUSIC3_BATCH
    reduced = True


# -- the carry ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [MUSIC3, MUSIC3_BATCH], ids=lambda c: c.name)
def test_chunks_run_whole(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back), so parity alone cannot tell: both chunks
    # must be served whole.
    report = check_chunks_run_whole(case, CHUNKED, ["transformer_blocks[0, 1]", "transformer_blocks[2, 3]"])
    assert report.saved_ratio < 1


def test_every_block_gets_the_same_rope_tuple() -> None:
    # What makes the carry right: the loop calls block(hidden_states, rotary_emb) positionally with one
    # RoPE tuple for all blocks (lru-cached, so the same one in the next step too), over frames + 1 tokens.
    model = MUSIC3_BATCH.fresh()
    seen: list[tuple] = []
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(lambda _m, args: seen.append(args))
    inputs = music3_batch_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(**inputs)
        model(**inputs)
    assert len(seen) == 2 * LAYERS and all(len(args) == 2 for args in seen)
    rope = seen[0][1]
    assert all(args[1] is rope for args in seen)
    assert seen[0][0].shape == (2, 5 + 1, 16) and rope[0].shape == (5 + 1, 4)
    for earlier, later in zip(seen[:LAYERS - 1], seen[1:LAYERS]):
        assert later[0] is not earlier[0]  # each block hands the next a fresh tensor


# -- no FFN seam --------------------------------------------------------------------------------


def test_the_glu_product_is_computed_between_ff_in_and_ff_out() -> None:
    # Why no seam spans the MLP: ff_out is called on a * silu(b), made by the block from ff_in's output,
    # never on ff_in's output itself. norm2 -> ff_in is the only strict chain.
    model = MUSIC3.fresh()
    block = model.transformer_blocks[0]
    calls = record_first_calls(block, ("norm2", "ff_in", "ff_out"))
    with torch.no_grad():
        model(**music3_inputs(torch.Generator().manual_seed(1)))
    assert calls["ff_in"][0][0] is calls["norm2"][1]
    assert calls["ff_in"][1].shape[-1] == 2 * INNER and calls["ff_out"][0][0].shape[-1] == INNER
    assert calls["ff_out"][0][0] is not calls["ff_in"][1]


def test_ffn_backends_are_refused_and_leave_the_model_untouched() -> None:
    assert_ffn_backends_refused(MUSIC3, "minimax-music3")


def test_a_norm2_ff_in_seam_would_be_exact_but_keep_almost_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    # The one strict chain, declared for this test only: exact and whole, but the GLU's wide tensors are
    # saved outside it, so a step keeps nearly what it keeps unpatched (whole blocks keep far less).
    declare_ffn_seam(monkeypatch, "minimax-music3", ("norm2", "ff_in"))
    seam = check_strategy(MUSIC3, {**TORCH, "gradient_checkpointing_backend": "torch-ffn"}, whole=True)
    assert [r.label for r in seam.regions] == [f"transformer_blocks[{i}].norm2→ff_in" for i in range(LAYERS)]
    assert seam.saved_ratio > 0.85
    assert check_strategy(MUSIC3, TORCH).saved_ratio < 0.5


# -- diffusers' own checkpointing flag ----------------------------------------------------------


def test_builtin_flag_is_exact_and_suspended_while_patched() -> None:
    # the model's own path: _gradient_checkpointing_func(block, hidden_states, rotary_emb)
    check_builtin_flag(MUSIC3, CHUNKED)


# -- presets at full size -----------------------------------------------------------------------

PRESETS = {"2.4b-30s": 2584, "2.4b-60s": 5168, "2.4b-180s": 15504}  # ceil(s * 44100 / 512) latent frames


def test_latent_frames_follow_the_flow_vae() -> None:
    from gradseam.adapters.minimax_music3 import latent_frames

    assert {name: latent_frames(int(name.split("-")[1][:-1])) for name in PRESETS} == PRESETS
    assert [latent_frames(s) for s in (1, 8, 0.5)] == [87, 690, 44]


def test_preset_config_is_the_class_defaults() -> None:
    from diffusers import MiniMaxMusic3Transformer1DModel

    params = inspect.signature(MiniMaxMusic3Transformer1DModel.__init__).parameters
    family = REGISTRY.get("minimax-music3")
    assert set(family.presets) == set(PRESETS)
    for preset in family.presets.values():
        assert preset.config == {k: p.default for k, p in params.items() if k != "self"}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_plans_at_full_size(name: str) -> None:
    family, _, model = preset_model("minimax-music3", name)
    assert family_for(model) is family
    assert 2.4e9 < sum(p.numel() for p in model.parameters()) < 2.5e9
    block = model.transformer_blocks[0]
    assert (len(model.transformer_blocks), block.attn.heads, block.attn.head_dim, block.ff_in.out_features,
            model.rotary_emb.rotary_dim) == (36, 32, 64, 2 * 8192, 32)
    for config, regions in ((TORCH, 36), (CHUNKED, 18), ({**TORCH, "gradient_checkpointing_keep_attention": True}, 36)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert {b for r in the_plan.regions for b in r.blocks} == set(range(36))
        assert len(the_plan.regions) == regions


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_inputs_have_the_trainers_sizes(name: str) -> None:
    _, preset, model = preset_model("minimax-music3", name)
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    frames = PRESETS[name]
    assert x["hidden_states"].shape == (1, 128, frames) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, frames, 2048) and not x["encoder_hidden_states"].requires_grad
    assert x["timestep"].shape == (1,) and x["hidden_states"].dtype == torch.bfloat16
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 100, **preset.inputs)
    assert fewer["hidden_states"].shape == (1, 128, 100) and fewer["encoder_hidden_states"].shape == (1, 100, 2048)


def test_preset_input_builder_runs_the_model() -> None:
    preset = REGISTRY.get("minimax-music3").presets["2.4b-30s"]
    model = MUSIC3.fresh()
    x = preset.make_inputs(model, "cpu", torch.float32, None, seconds=0.05)  # 5 latent frames
    out = model(**x).sample
    assert out.shape == (1, LATENT, 5)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_and_patches_exactly() -> None:
    """`gradseam bench --family minimax-music3 --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload("minimax-music3", TINY, {"seconds": 0.05}, preset="2.4b-30s", sequence=5 + 1)
