"""Lumina-Next (LuminaNextDiT2DModel) through the conformance kit, plus its preset.

The plain case (one prompt, the pipeline's default proportional attention) runs the kit's whole matrix; a
padded two-prompt batch at two timesteps with empty ``cross_attention_kwargs`` runs the reduced one. Then
what the declaration rests on: the loop hands every block the same objects (the carry), the output
projection of both attentions runs in the block outside ``attn2`` (the attention side), the
``feed_forward → ffn_norm2`` seam, the ``None`` kwargs that fail upstream the same way patched, diffusers'
refused flag; and the preset at full size with its real input builder.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import pytest
import torch
from diffusers import LuminaNextDiT2DModel
from family_checks import check_chunks_run_whole, record_block_calls, sample_output

import gradseam
from gradseam.adapters.lumina_next import ROPE_SIDE, SFT_2B, rotary_table
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_bench_workload,
    preset_model,
    randn,
)

TEXT, SIDE, CAP = 5, 4, 8  # caption tokens, latent side (2x2 patches: 4 image tokens), caption width
# 2 query heads of 8 on 1 KV head (GQA; the 2-D RoPE needs a head width divisible by 4), four blocks,
# SwiGLU 16 -> 16 (4·2·16/3 rounded up to multiple_of), learned sigma: 8 output channels.
TINY: dict[str, Any] = dict(
    sample_size=SIDE, patch_size=2, in_channels=4, hidden_size=16, num_layers=4, num_attention_heads=2,
    num_kv_heads=1, multiple_of=16, cross_attention_dim=CAP,
)
CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}


def lumina_next_model() -> LuminaNextDiT2DModel:
    model = LuminaNextDiT2DModel(**TINY)
    # upstream leaves pad_token as torch.empty (never initialised, never read by the forward): fill it, or
    # two builds under one seed differ in that parameter's garbage
    with torch.no_grad():
        model.pad_token.zero_()
    return model


def _rope() -> torch.Tensor:
    # the pipeline's table holds 384 x 384 positions; a position's entry does not depend on the table's size
    # (checked below), so the tiny cases pass the 8 x 8 corner
    return rotary_table(8, side=8)


def lumina_next_inputs(g: torch.Generator) -> dict:
    # proportional attention on, as the pipeline's default: a base length (16) other than the 4 image tokens,
    # so the self-attention's log-scaled softmax is really exercised
    return {
        "hidden_states": randn(g, 1, 4, SIDE, SIDE, grad=True),
        "timestep": torch.tensor([0.4]),
        "encoder_hidden_states": randn(g, 1, TEXT, CAP, grad=True),
        "encoder_mask": torch.ones(1, TEXT, dtype=torch.int64),
        "image_rotary_emb": _rope(),
        "cross_attention_kwargs": {"base_sequence_length": 16},
    }


def padded_inputs(g: torch.Generator) -> dict:
    # two prompts, the second two tokens shorter (the tokenizer pads to the longest), at their own
    # timesteps; proportional attention off (an empty dict, as the pipeline passes then)
    mask = torch.ones(2, TEXT, dtype=torch.int64)
    mask[1, -2:] = 0
    return {
        "hidden_states": randn(g, 2, 4, SIDE, SIDE, grad=True),
        "timestep": torch.tensor([0.2, 0.9]),
        "encoder_hidden_states": randn(g, 2, TEXT, CAP, grad=True),
        "encoder_mask": mask,
        "image_rotary_emb": _rope(),
        "cross_attention_kwargs": {},
    }


LUMINA_NEXT = Case("lumina-next", lumina_next_model, lumina_next_inputs)
LUMINA_NEXT_PADDED = Case("lumina-next-padded", lumina_next_model, padded_inputs)


class TestLuminaNext(ConformanceSuite):
    case = LUMINA_NEXT


class TestLuminaNextPadded(ConformanceSuite):
    case = LUMINA_NEXT_PADDED
    reduced = True


def test_variant_inputs_change_the_output() -> None:
    # the cases exercise their paths: proportional attention, the caption padding (second sample only)
    plain = sample_output(LUMINA_NEXT)
    assert not torch.equal(plain, sample_output(LUMINA_NEXT, cross_attention_kwargs={}))
    padded = sample_output(LUMINA_NEXT_PADDED)
    unpadded = sample_output(LUMINA_NEXT_PADDED, encoder_mask=torch.ones(2, TEXT, dtype=torch.int64))
    assert torch.equal(padded[0], unpadded[0]) and not torch.equal(padded[1], unpadded[1])


def test_rope_entries_do_not_depend_on_the_table_size() -> None:
    assert torch.equal(rotary_table(8, side=ROPE_SIDE)[:8, :8], _rope())


@pytest.mark.parametrize("case", [LUMINA_NEXT, LUMINA_NEXT_PADDED], ids=lambda c: c.name)
def test_interval_chunks_run_whole(case: Case) -> None:
    # a wrong carry would still be exact (chunks fall back), so parity alone cannot tell
    report = check_chunks_run_whole(case, CHUNKED, ["layers[0, 1]", "layers[2, 3]"])
    assert report.saved_ratio < 1


def test_the_loop_hands_every_block_the_same_objects() -> None:
    # What the carry rests on: every argument but hidden_states is one object for all four blocks (the
    # caller's kwargs dict included), and each block gets its predecessor's return value.
    model = LUMINA_NEXT.fresh()
    seen, returned = record_block_calls(model.layers)
    inputs = lumina_next_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(**inputs)
    assert len(seen) == 4
    for name in ("attention_mask", "image_rotary_emb", "encoder_hidden_states", "encoder_mask", "temb"):
        assert all(kw[name] is seen[0][name] for kw in seen), name
    assert all(kw["cross_attention_kwargs"] is inputs["cross_attention_kwargs"] for kw in seen)
    assert all(kw["hidden_states"] is out for kw, out in zip(seen[1:], returned))


def test_output_projection_runs_in_the_block_outside_attn2() -> None:
    # The attention side's premise: attn1's to_out is an Identity that nothing calls, attn2 returns per-head
    # SDPA output, and the block calls attn2.to_out[0] itself, once, after attn2 has returned, on the mix of
    # both attentions. So attn1 / attn2 hold every kernel and projection but that one linear.
    model = LUMINA_NEXT.fresh()
    block = model.layers[0]
    assert isinstance(block.attn1.to_out, torch.nn.Identity)
    events: list[tuple[str, tuple]] = []
    block.attn1.register_forward_hook(lambda _m, _a, out: events.append(("attn1", tuple(out.shape))))
    block.attn2.register_forward_hook(lambda _m, _a, out: events.append(("attn2", tuple(out.shape))))
    block.attn2.to_out[0].register_forward_pre_hook(lambda _m, a: events.append(("to_out", tuple(a[0].shape))))
    with torch.no_grad():
        model(**lumina_next_inputs(torch.Generator().manual_seed(1)))
    tokens = (SIDE // 2) ** 2
    assert events == [("attn1", (1, tokens, 2, 8)), ("attn2", (1, tokens, 2, 8)), ("to_out", (1, tokens, 16))]


def test_ffn_seam_is_feed_forward_then_ffn_norm2_on_its_output_alone() -> None:
    model = LUMINA_NEXT.fresh()
    ffn = plan(model, family_for(model), gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.blocks, r.seam) for r in ffn.regions] == [((i,), ("feed_forward", "ffn_norm2")) for i in range(4)]
    made: list[torch.Tensor] = []
    fed: list[tuple] = []
    for block in model.layers:
        block.feed_forward.register_forward_pre_hook(lambda _m, a: fed.append(("ff", a)))
        block.feed_forward.register_forward_hook(lambda _m, _a, out: made.append(out))
        block.ffn_norm2.register_forward_pre_hook(lambda _m, a, kw: fed.append(("norm", a, kw)), with_kwargs=True)
    with torch.no_grad():
        model(**lumina_next_inputs(torch.Generator().manual_seed(1)))
    assert [f[0] for f in fed] == ["ff", "norm"] * 4
    assert all(len(f[1]) == 1 for f in fed[0::2])  # feed_forward: one tensor, the modulated norm
    assert all(f[1] == (out,) and not f[2] for f, out in zip(fed[1::2], made))


def test_none_kwargs_fail_patched_as_unpatched() -> None:
    # Upstream: the forward's default cross_attention_kwargs=None is spread with ** in the first block.
    # gradseam neither hides nor changes that error.
    inputs = {**lumina_next_inputs(torch.Generator().manual_seed(1)), "cross_attention_kwargs": None}
    model = LUMINA_NEXT.fresh()
    with pytest.raises(TypeError, match="must be a mapping"):
        model(**inputs)
    with gradseam.patch(model, CHUNKED), pytest.raises(TypeError, match="must be a mapping"):
        model(**inputs)


def test_diffusers_has_no_checkpointing_of_its_own() -> None:
    model = LUMINA_NEXT.fresh()
    with pytest.raises(ValueError, match="does not support gradient checkpointing"):
        model.enable_gradient_checkpointing()


# -- the preset at full size -----------------------------------------------------------------------
@functools.cache
def _preset_model() -> tuple:
    return preset_model("lumina-next", "sft-2b-1024")  # on meta; the tests below only read and plan it


def test_preset_plans_at_full_size() -> None:
    family, preset, model = _preset_model()
    assert set(family.presets) == {"sft-2b-1024"}
    assert family_for(model) is family
    params = set(inspect.signature(LuminaNextDiT2DModel.__init__).parameters) - {"self"}
    assert set(preset.config) == params == set(SFT_2B)  # every constructor argument, spelled out
    assert 1.75e9 < sum(p.numel() for p in model.parameters()) < 1.76e9
    block = model.layers[0]
    assert (len(model.layers), block.attn1.heads, block.feed_forward.linear_1.out_features) == (24, 32, 6144)
    assert block.attn1.to_k.out_features == 8 * 72  # 8 KV heads
    for config, regions in (({"gradient_checkpointing": True}, 24), (CHUNKED, 12), (FFN, 24)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert len(the_plan.regions) == regions
        assert sorted(i for r in the_plan.regions for i in r.blocks) == list(range(24))


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    _, preset, model = _preset_model()
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 4, 128, 128) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 256, 2048)
    assert x["encoder_mask"].shape == (1, 256)
    assert x["image_rotary_emb"].shape == (ROPE_SIDE, ROPE_SIDE, 36) and x["image_rotary_emb"].is_complex()
    assert x["cross_attention_kwargs"] == {"base_sequence_length": 4096}  # (1024 // 16) ** 2
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 1024, **preset.inputs)
    assert fewer["hidden_states"].shape == (1, 4, 64, 64)


def test_preset_input_builder_runs_the_model() -> None:
    family = gradseam.registry.REGISTRY.get("lumina-next")
    model = LUMINA_NEXT.fresh()
    x = family.presets["sft-2b-1024"].make_inputs(
        model, "cpu", torch.float32, None, height=32, width=48, text_tokens=TEXT, caption_tokens=3)
    assert x["hidden_states"].shape == (1, 4, 4, 6) and int(x["encoder_mask"].sum()) == 3
    assert x["cross_attention_kwargs"] == {"base_sequence_length": 4}  # sample_size 4: a 32-pixel default
    out = model(**x).sample
    assert out.shape == (1, 8, 4, 6)  # learned sigma: twice the channels
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_steps_and_patches_exactly() -> None:
    """`gradseam bench --family lumina-next --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload("lumina-next", TINY, {"height": 32, "width": 32, "text_tokens": TEXT},
                         preset="sft-2b-1024", sequence=4)
