"""EasyAnimate V5 / V5.1 (EasyAnimateTransformer3DModel) through the conformance kit, plus its presets.

The plain case is a model of both kinds of block, as the 7B is built (two MMDiT blocks, then two whose
``attn1`` projects text and video with one set of weights and whose ``ff`` also runs on the text), and
runs the kit's whole matrix. Input variants run reduced matrices: a batch of two at their own timesteps
on a non-square latent, with V5's second text encoder (T5 states); the InP model (inpaint latents) with
V5.1's normed text projection, built with ``after_norm`` (one ``norm3`` after both FFNs). The Control
model's latents, like InP's, only join the video before the patch embedding, outside every block: they
are checked to reach the output and through the preset's input builder. Then: chunks and seams are planned as declared, the loop hands every block the same
conditioning, diffusers' own checkpointing flag, and the presets at full size with their input builder.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import pytest
import torch
from family_checks import assert_plans_cover_every_block, record_block_calls, sample_output

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

# 2 heads x 16 = 32 wide (the 3-D RoPE splits a head 4 + 6 + 6 over frames, rows and columns, and needs
# each part even, so 16 is the smallest head), FFN 128, 4 latent channels, text states 12 wide. Four
# blocks, the first two MMDiT: interval 2 makes one chunk of each kind.
TEXT, TEXT_DIM, CH = 6, 12, 4
TINY: dict[str, Any] = dict(
    num_attention_heads=2, attention_head_dim=16, in_channels=CH, out_channels=CH, patch_size=2, num_layers=4,
    mmdit_layers=2, text_embed_dim=TEXT_DIM, time_embed_dim=8,
)
# InP: mask + masked latents, V5.1's normed text projection, and after_norm (one norm3 after both FFNs)
TINY_INP = dict(TINY, in_channels=CH + 1 + CH, add_norm_text_encoder=True, after_norm=True)
TINY_CONTROL = dict(TINY, in_channels=3 * CH)  # control + reference latents
TINY_T5 = dict(TINY, text_embed_dim_t5=10)  # V5: a second text encoder (T5) projected apart


def easyanimate_model(**config: Any) -> torch.nn.Module:
    from diffusers import EasyAnimateTransformer3DModel

    return EasyAnimateTransformer3DModel(**config)


def plain_inputs(g: torch.Generator) -> dict:
    # 2 latent frames x 4 x 4 (2 x 2 patches of 2): 8 video tokens, 6 text tokens
    return {
        "hidden_states": randn(g, 1, CH, 2, 4, 4, grad=True),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM, grad=True),
    }


def batch_inputs(g: torch.Generator) -> dict:
    # two samples at their own timesteps (temb differs per sample) on a 4x6 latent (a 2x3 RoPE grid), with
    # V5's second text encoder: its T5 states are projected apart and appended to the first encoder's
    return {
        "hidden_states": randn(g, 2, CH, 2, 4, 6, grad=True),
        "timestep": torch.tensor([120.0, 870.0]),
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
        "encoder_hidden_states_t5": randn(g, 2, 4, 10, grad=True),
    }


def inpaint_inputs(g: torch.Generator) -> dict:
    # EasyAnimateInpaintPipeline: a one-channel mask (the scaling factor on the given first frame, 0 on the
    # frames to generate), then the masked video's latents
    mask = torch.zeros(1, 1, 2, 4, 4)
    mask[:, :, 0] = 0.7125
    return {**plain_inputs(g), "inpaint_latents": torch.cat([mask, randn(g, 1, CH, 2, 4, 4, grad=True)], 1)}


def control_inputs(g: torch.Generator) -> dict:
    # EasyAnimateControlPipeline: the control video latents, then the reference image latents
    return {**plain_inputs(g), "control_latents": randn(g, 1, 2 * CH, 2, 4, 4, grad=True)}


PLAIN = Case("easyanimate", lambda: easyanimate_model(**TINY), plain_inputs)
BATCH = Case("easyanimate-v5-t5-batch", lambda: easyanimate_model(**TINY_T5), batch_inputs)
INPAINT = Case("easyanimate-inp-after-norm", lambda: easyanimate_model(**TINY_INP), inpaint_inputs)
CONTROL = Case("easyanimate-control", lambda: easyanimate_model(**TINY_CONTROL), control_inputs)


class TestEasyAnimate(ConformanceSuite):
    case = PLAIN


class TestEasyAnimateBatch(ConformanceSuite):
    case = BATCH
    reduced = True


class TestEasyAnimateInpaintAfterNorm(ConformanceSuite):
    case = INPAINT
    reduced = True


# -- the cuts -----------------------------------------------------------------------------------


def test_chunks_and_seams_are_planned_as_declared() -> None:
    # Chunks of two: one of MMDiT blocks, one of the others. Seams: ff and txt_ff in the MMDiT blocks, ff
    # alone where the block has no txt_ff (declared optional, so the -ffn backends stay allowed).
    model = PLAIN.fresh()
    family = family_for(model)
    assert family.name == "easyanimate" and family.has_ffn and family.has_attention and family.supports_interval
    assert [b.txt_ff is not None for b in model.transformer_blocks] == [True, True, False, False]
    chunks = plan(model, family, gradseam.CheckpointConfig.coerce(CHUNKED))
    assert [r.blocks for r in chunks.regions] == [(0, 1), (2, 3)]
    seams = plan(model, family, gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.blocks, r.seam) for r in seams.regions] == [
        ((0,), ("ff",)), ((0,), ("txt_ff",)), ((1,), ("ff",)), ((1,), ("txt_ff",)), ((2,), ("ff",)), ((3,), ("ff",))
    ]


def test_ff_runs_once_per_stream_as_its_own_region() -> None:
    # Without txt_ff the block calls ff on the video, then on the text: each call is a region of its own,
    # whole, sharing ff's weights; the MMDiT blocks call each FFN once.
    report = check_strategy(PLAIN, FFN, whole=True)
    calls = {r.label: r.calls for r in report.regions if r.shape == "ffn"}
    assert calls == {
        "transformer_blocks[0].ff": (1,), "transformer_blocks[0].txt_ff": (1,),
        "transformer_blocks[1].ff": (1,), "transformer_blocks[1].txt_ff": (1,),
        "transformer_blocks[2].ff": (2,), "transformer_blocks[3].ff": (2,),
    }
    assert report.saved_ratio < 1


def test_norm3_cannot_join_a_seam() -> None:
    # With after_norm one norm3 follows both FFN calls: ff -> norm3 and txt_ff -> norm3 would put norm3 in
    # two seams, which a declaration refuses. So the seams stop at the FFNs and norm3 runs outside them.
    from gradseam import BlockClass

    with pytest.raises(ValueError, match="names 'norm3' twice"):
        BlockClass("diffusers.models.transformers.transformer_easyanimate.EasyAnimateTransformerBlock",
                   ffn=(("ff", "norm3"), ("txt_ff", "norm3")))
    model = INPAINT.fresh()
    block = model.transformer_blocks[0]
    fed: list[torch.Tensor] = []
    made: list[torch.Tensor] = []
    block.norm3.register_forward_pre_hook(lambda _m, a: fed.append(a[0]))
    for name in ("ff", "txt_ff"):
        getattr(block, name).register_forward_hook(lambda _m, _a, out: made.append(out))
    with torch.no_grad():
        model(**INPAINT.inputs(torch.Generator().manual_seed(1)))
    assert len(fed) == 2 and all(a is b for a, b in zip(fed, made))


def test_the_loop_hands_every_block_the_same_conditioning() -> None:
    # What the carry relies on: temb and the RoPE tuple are one object each for every block (the loop
    # passes them positionally); the streams are what the previous block returned.
    model = BATCH.fresh()
    seen, returned = record_block_calls(model.transformer_blocks)
    with torch.no_grad():
        model(**BATCH.inputs(torch.Generator().manual_seed(1)))
    assert len(seen) == 4
    first = seen[0]
    for name in ("temb", "image_rotary_emb"):
        assert all(kw[name] is first[name] for kw in seen), name
    assert first["temb"].shape[0] == 2 and not torch.equal(first["temb"][0], first["temb"][1])
    assert first["image_rotary_emb"][0].shape == (2 * 2 * 3, 16)  # frames x rows x columns, head dim
    assert first["encoder_hidden_states"].shape == (2, TEXT + 4, 32)  # the T5 tokens appended to the text
    for before, kw in zip(returned, seen[1:]):
        assert kw["hidden_states"] is before[0] and kw["encoder_hidden_states"] is before[1]


def test_variant_inputs_change_the_output() -> None:
    # The variants exercise their paths: the timesteps, the T5 states and the conditioning latents matter.
    batch = sample_output(BATCH)
    assert not torch.equal(batch, sample_output(BATCH, timestep=torch.tensor([120.0, 120.0])))
    assert not torch.equal(batch, sample_output(BATCH, encoder_hidden_states_t5=torch.zeros(2, 4, 10)))
    assert not torch.equal(sample_output(INPAINT), sample_output(INPAINT, inpaint_latents=torch.zeros(1, CH + 1, 2, 4, 4)))
    assert not torch.equal(sample_output(CONTROL), sample_output(CONTROL, control_latents=torch.zeros(1, 2 * CH, 2, 4, 4)))


def test_builtin_flag_is_exact_and_owned_by_gradseam() -> None:
    # diffusers' flag checkpoints every block positionally with the same four arguments
    check_builtin_flag(PLAIN, CHUNKED)


# -- the presets at full size ---------------------------------------------------------------------

# blocks, MMDiT blocks, in_channels, the conditioning latents' name and channels, latent side, params (B)
PRESETS: dict[str, tuple[int, int, int, str | None, int, int, float]] = {
    "v5.1-12b-inp-512": (48, 48, 33, "inpaint_latents", 17, 64, 11.8),
    "v5.1-12b-1024": (48, 48, 16, None, 0, 128, 11.8),
    "v5.1-7b-control-512": (36, 18, 48, "control_latents", 32, 64, 6.8),
}


@functools.cache
def _preset_model(name: str) -> tuple[Any, Any, Any]:
    return preset_model("easyanimate", name)  # a 12B model on meta: built once per preset


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_plan_at_full_size(name: str) -> None:
    family, preset, model = _preset_model(name)
    depth, mmdit, channels, _, _, _, billions = PRESETS[name]
    assert set(family.presets) == set(PRESETS)
    assert family_for(model) is family
    params = set(inspect.signature(type(model).__init__).parameters) - {"self"}
    assert set(preset.config) == params  # every constructor argument, spelled out
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - billions) < 0.2
    blocks = model.transformer_blocks
    block = blocks[0]
    assert (len(blocks), block.attn1.heads, block.ff.net[0].proj.out_features, model.proj.in_channels) == (
        depth, 48, 12288, channels)
    assert sum(b.txt_ff is not None for b in blocks) == mmdit
    assert_plans_cover_every_block(model, family, depth, (
        ({"gradient_checkpointing": True}, depth), (CHUNKED, depth // 2), (FFN, depth + mmdit)
    ))


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_inputs_have_the_pipelines_sizes(name: str) -> None:
    _, preset, model = _preset_model(name)
    _, _, _, condition, extra, side, _ = PRESETS[name]
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    # 49 frames through the MagVIT VAE (4x temporal, 8x spatial): 13 latent frames
    assert x["hidden_states"].shape == (1, 16, 13, side, side) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 256, 3584) and x["timestep"].shape == (1,)
    assert set(x) == {"hidden_states", "encoder_hidden_states", "timestep"} | ({condition} if condition else set())
    if condition:
        assert x[condition].shape == (1, extra, 13, side, side)
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 4 * (side // 2) ** 2, **preset.inputs)
    assert fewer["hidden_states"].shape == (1, 16, 4, side, side)


@pytest.mark.parametrize(("case", "preset"), [(INPAINT, "v5.1-12b-inp-512"), (CONTROL, "v5.1-7b-control-512")],
                         ids=lambda v: getattr(v, "name", v))
def test_preset_input_builder_runs_the_model(case: Case, preset: str) -> None:
    # the builder's inputs must be ones the model takes: the tiny model, 5 frames at 32x48, a short prompt
    chosen = gradseam.registry.REGISTRY.get("easyanimate").presets[preset]
    model = case.fresh()
    x = chosen.make_inputs(model, "cpu", torch.float32, None, **{**chosen.inputs, "frames": 5, "height": 32,
                                                                 "width": 48, "text_tokens": TEXT})
    if case is INPAINT:  # the mask channel: the first frame given, the second to generate
        assert torch.equal(x["inpaint_latents"][0, 0, :, 0, 0], torch.tensor([0.7125, 0.0]))
    out = model(**x).sample
    assert out.shape == x["hidden_states"].shape == (1, CH, 2, 4, 6)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None
    with pytest.raises(ValueError, match="condition=None does not fit"):
        chosen.make_inputs(model, "cpu", torch.float32, None, frames=5, height=32, width=48)


def test_bench_workload_truncates_and_patches_exactly() -> None:
    """`gradseam bench --family easyanimate --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload("easyanimate", TINY_INP, {"frames": 5, "height": 32, "width": 32, "text_tokens": TEXT,
                                                   "condition": "inpaint"}, sequence=2 * 2 * 2)
