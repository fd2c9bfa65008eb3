"""Helios (HeliosTransformer3DModel) through the conformance kit, plus its preset.

The plain case is one chunk as ``HeliosPipeline`` denoises it and Helios' stage-1 training calls the model:
the noisy chunk behind its short, mid and long history, each with the frame indices the pipeline lays out,
under the released flags (time-0 modulation of the history, cross-attention over the chunk only); it runs
the kit's whole matrix. Two input variants run a reduced matrix: a batch of two at their own timesteps with
the chunk at half the history's resolution (a lower stage of ``HeliosPyramidPipeline``, Helios-Mid and
-Distilled), and the model with the learned history-key scale (``is_amplify_history``) under the training
ablation flags (the history modulated at the chunk's timestep, cross-attention over every token). Then: the
loop's shared arguments, the FFN seam, diffusers' own checkpointing flag, that the variants' inputs matter,
and the preset at full size with its real input builder.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from family_checks import assert_ffn_seam_is_one_module, assert_plans_cover_every_block, sample_output

import gradseam
from gradseam.patcher import family_for
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

# 2 heads of 8 (16 wide; the RoPE splits a head 4 + 2 + 2 over frames, rows and columns), FFN 32, umT5
# states 12 wide, 4 blocks. The class defaults otherwise: the released flags.
TEXT = 5
TINY = {
    "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 4,
    "out_channels": 4, "text_dim": 12, "freq_dim": 16, "ffn_dim": 32, "num_layers": 4, "rope_dim": (4, 2, 2),
}
TINY_ABLATION = {**TINY, "is_amplify_history": True, "history_scale_mode": "scalar", "guidance_cross_attn": False,
                 "zero_history_timestep": False}


def helios_model(**config: object) -> torch.nn.Module:
    from diffusers import HeliosTransformer3DModel

    return HeliosTransformer3DModel(**config)


def _history(g: torch.Generator, batch: int, side: int, window: int = 2) -> dict:
    # the pipeline's layout, [start | long (4 frames here, 16 released) | mid 2 | latest 1 | chunk], the
    # indices (1, frames) for every sample, as the pipeline passes them
    start, long, mid, latest, chunk = torch.arange(1 + 4 + 2 + 1 + window).split([1, 4, 2, 1, window])
    return {
        "indices_hidden_states": chunk[None],
        "indices_latents_history_short": torch.cat([start, latest])[None],
        "indices_latents_history_mid": mid[None],
        "indices_latents_history_long": long[None],
        "latents_history_short": randn(g, batch, 4, 2, side, side, grad=True),
        "latents_history_mid": randn(g, batch, 4, 2, side, side, grad=True),
        "latents_history_long": randn(g, batch, 4, 4, side, side, grad=True),
    }


def helios_inputs(g: torch.Generator) -> dict:
    # a chunk of 2 latent frames of 4 x 4 (2 x 2 patches): 8 tokens, behind 8 short, 1 mid and 1 long
    # history tokens
    return {
        "hidden_states": randn(g, 1, 4, 2, 4, 4, grad=True),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": randn(g, 1, TEXT, 12, grad=True),
        **_history(g, 1, 4),
    }


def helios_pyramid_inputs(g: torch.Generator) -> dict:
    # two samples at their own timesteps; the chunk at 4 x 4 latents, the history at 8 x 8 (a pyramid stage
    # below the full resolution): 8 chunk + 32 short + 4 mid + 1 long tokens per sample
    return {
        "hidden_states": randn(g, 2, 4, 2, 4, 4, grad=True),
        "timestep": torch.tensor([250.0, 750.0]),
        "encoder_hidden_states": randn(g, 2, TEXT, 12, grad=True),
        **_history(g, 2, 8),
    }


def ablation_model() -> torch.nn.Module:
    model = helios_model(**TINY_ABLATION)
    with torch.no_grad():  # the history-key scale starts at 1 (a factor of 1 + sigmoid(1) x 9): move it
        for block in model.blocks:
            block.attn1.history_key_scale.normal_()
    return model


HELIOS = Case("helios", lambda: helios_model(**TINY), helios_inputs)
HELIOS_PYRAMID = Case("helios-pyramid-batch", lambda: helios_model(**TINY), helios_pyramid_inputs)
HELIOS_ABLATION = Case("helios-amplify-ablation", ablation_model, helios_inputs)
CASES = [HELIOS, HELIOS_PYRAMID, HELIOS_ABLATION]


class TestHelios(ConformanceSuite):
    case = HELIOS


class TestHeliosPyramidBatch(ConformanceSuite):
    case = HELIOS_PYRAMID
    reduced = True


class TestHeliosAmplifyAblation(ConformanceSuite):
    case = HELIOS_ABLATION
    reduced = True


# -- the loop and the seams -------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_loop_hands_every_block_the_same_conditioning(case: Case) -> None:
    # What the carry relies on: the text states, the per-token modulation and the RoPE table are one object
    # each for every block, the chunk length one int; hidden_states is what the previous block returned.
    model = case.fresh()
    seen: list[dict] = []
    returned: list[torch.Tensor] = []
    sig = inspect.signature(model.blocks[0].forward)
    for block in model.blocks:
        block.register_forward_pre_hook(lambda _m, a, kw: seen.append(sig.bind(*a, **kw).arguments), with_kwargs=True)
        block.register_forward_hook(lambda _m, _a, out: returned.append(out))
    x = case.inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(**x)
    chunk = x["hidden_states"].shape[2] * x["hidden_states"].shape[3] * x["hidden_states"].shape[4] // 4
    history = seen[0]["hidden_states"].shape[1] - chunk
    assert len(seen) == 4 and history > 0 and all(kw["original_context_length"] == chunk for kw in seen)
    assert seen[0]["temb"].shape[:3] == (x["hidden_states"].shape[0], chunk + history, 6)  # per token
    for name in ("encoder_hidden_states", "temb", "rotary_emb"):
        assert all(kw[name] is seen[0][name] for kw in seen), (case.name, name)
    assert all(kw["hidden_states"] is out for out, kw in zip(returned, seen[1:]))


def test_the_ffn_seam_is_the_feedforward_alone() -> None:
    # One region per block around ffn; norm3 cannot join: ffn sees its output scaled and shifted per token.
    assert_ffn_seam_is_one_module(HELIOS, "helios", FFN)


def test_the_builtin_flag_is_exact_and_owned_by_gradseam() -> None:
    # diffusers' flag checkpoints every block with the same five arguments, positionally
    check_builtin_flag(HELIOS, CHUNKED)


def test_history_timesteps_and_the_history_scale_reach_the_output() -> None:
    plain = sample_output(HELIOS)
    assert not torch.equal(plain, sample_output(HELIOS, latents_history_long=torch.zeros(1, 4, 4, 4, 4)))
    pyramid = sample_output(HELIOS_PYRAMID)
    assert not torch.equal(pyramid[1], sample_output(HELIOS_PYRAMID, timestep=torch.tensor([250.0, 250.0]))[1])
    ablation = HELIOS_ABLATION.fresh()
    before = sample_output(HELIOS_ABLATION, ablation)
    with torch.no_grad():
        ablation.blocks[0].attn1.history_key_scale.add_(1.0)
    assert not torch.equal(before, sample_output(HELIOS_ABLATION, ablation))


# -- the preset at full size ------------------------------------------------------------------------


def test_preset_plans_at_full_size() -> None:
    family, preset, model = preset_model("helios", "14b-384x640")
    assert set(family.presets) == {"14b-384x640"} and family_for(model) is family
    params = set(inspect.signature(type(model).__init__).parameters) - {"self"}
    assert set(preset.config) == params  # every constructor argument, spelled out
    block = model.blocks[0]
    assert (len(model.blocks), block.attn1.heads, block.ffn.net[0].proj.out_features) == (40, 40, 13824)
    assert not block.attn1.is_amplify_history and block.guidance_cross_attn
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - 14.31) < 0.01
    assert_plans_cover_every_block(model, family, 40, (
        ({"gradient_checkpointing": True}, 40), (CHUNKED, 20), (FFN, 40)
    ))


def test_preset_inputs_have_the_pipelines_layout() -> None:
    _, preset, model = preset_model("helios", "14b-384x640")
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 16, 9, 48, 80) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 512, 4096) and x["timestep"].shape == (1,)
    assert [x[f"latents_history_{k}"].shape[2] for k in ("short", "mid", "long")] == [2, 2, 16]
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 3 * 24 * 40, **preset.inputs)
    assert fewer["hidden_states"].shape[2] == 3 and fewer["indices_hidden_states"].shape == (1, 3)


def test_preset_inputs_give_the_token_counts_it_describes() -> None:
    # The model cannot run on meta (its RoPE turns autocast off for the meta device), so the preset's inputs
    # at full size go through a tiny-width model without blocks, on the CPU: the final norm then sees the
    # trunk's sequence, 9 x 24 x 40 chunk + 2 x 24 x 40 short + 12 x 20 mid + 4 x 6 x 10 long tokens.
    preset = gradseam.registry.REGISTRY.get("helios").presets["14b-384x640"]
    model = helios_model(**{**TINY, "in_channels": 16, "out_channels": 16, "text_dim": 4096, "num_layers": 1})
    model.blocks = torch.nn.ModuleList()
    x = preset.make_inputs(model, "cpu", torch.float32, None, **preset.inputs, text_tokens=8)
    assert x["indices_latents_history_short"].tolist() == [[0, 19]]
    assert x["indices_latents_history_long"].tolist() == [list(range(1, 17))]
    assert x["indices_latents_history_mid"].tolist() == [[17, 18]]
    assert x["indices_hidden_states"].tolist() == [list(range(20, 29))]
    seen: list[tuple[int, int]] = []
    model.norm_out.register_forward_pre_hook(lambda _m, a: seen.append((a[0].shape[1], a[2])))
    with torch.no_grad():
        assert model(**x).sample.shape == x["hidden_states"].shape
    assert seen == [(8640 + 1920 + 240 + 240, 8640)]


def test_bench_workload_truncates_and_patches_exactly() -> None:
    """`gradseam bench --family helios --layers 2` on the tiny model with the real input builder: 32x32
    pixels are 4 x 4 latents; 2 chunk frames and 2 short ones of 4 tokens, 1 mid and 4 long tokens."""
    check_bench_workload("helios", TINY, {"window": 2, "height": 32, "width": 32, "text_tokens": TEXT},
                         sequence=8 + 8 + 1 + 4)
