"""LongCat-AudioDiT (LongCatAudioDiTTransformer) through the conformance kit, plus its presets.

The plain case (the published layout: global AdaLN, cross-attention, text ConvNeXt, long skip, a voice-prompt
latent condition) runs the kit's whole matrix. Reduced suites: a padded batch of two (shorter audio and
caption in the second sample, two timesteps), and the other layout the class builds (per-block AdaLN, no
cross-attention, no latent condition or frame mask). Then what the declaration rests on: the loop hands every
block the same objects, the ``ffn`` seam, ``cross_attn`` optional, diffusers' refused flag, the RoPE cache's
inference-mode trap (upstream, patched or not); and the presets at full size with their real input builder.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import pytest
import torch
from diffusers import LongCatAudioDiTTransformer
from family_checks import check_chunks_run_whole, record_block_calls, sample_output

import gradseam
from gradseam.adapters.longcat_audio import CONFIG_1B, CONFIG_3_5B, caption_tokens, latent_frames
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_bench_workload,
    preset_model,
    randn,
)

FRAMES, TEXT, LATENT, TEXT_DIM = 6, 5, 4, 8
# four blocks of 2 heads x 8, MLP 64 (ff_mult 4), a 4-channel latent and 8-wide captions
TINY: dict[str, Any] = dict(dit_dim=16, dit_depth=4, dit_heads=2, dit_text_dim=TEXT_DIM, latent_dim=LATENT)
# the other layout the class builds: each block's own AdaLN MLP, no cross-attention, no text ConvNeXt, no
# long skip, no latent condition
LOCAL = dict(TINY, adaln_type="local", cross_attn=False, text_conv=False, long_skip=False,
             use_latent_condition=False)
CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}
OFFLOAD_ATTENTION = {"gradient_checkpointing_offload_attention": True}  # attention offload alone


def longcat_model(**config: Any) -> LongCatAudioDiTTransformer:
    model = LongCatAudioDiTTransformer(**(config or TINY))
    # The class zero-initialises proj_out, norm_out, the AdaLN MLP's last layer and the GRN scales (a
    # training start): the output would be constant and every block's gradient zero, so the kit's parity
    # would compare zeros. Draw them instead (under the kit's seed).
    with torch.no_grad():
        for param in model.parameters():
            if not param.any():
                param.normal_(0.0, 0.3)
    return model


def longcat_inputs(g: torch.Generator) -> dict:
    # one clip; the voice prompt's clean latents over the first half, zeros where the model infills
    latent_cond = randn(g, 1, FRAMES, LATENT)
    latent_cond[:, FRAMES // 2:] = 0
    return {
        "hidden_states": randn(g, 1, FRAMES, LATENT, grad=True),
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM, grad=True),
        "encoder_attention_mask": torch.ones(1, TEXT, dtype=torch.bool),
        "timestep": torch.tensor([0.4]),
        "attention_mask": torch.ones(1, FRAMES, dtype=torch.bool),
        "latent_cond": latent_cond,
    }


def padded_inputs(g: torch.Generator) -> dict:
    # two clips, the second two frames and two caption tokens shorter (padded at the end), own timesteps
    frames = torch.ones(2, FRAMES, dtype=torch.bool)
    frames[1, -2:] = False
    text = torch.ones(2, TEXT, dtype=torch.bool)
    text[1, -2:] = False
    return {
        "hidden_states": randn(g, 2, FRAMES, LATENT, grad=True),
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
        "encoder_attention_mask": text,
        "timestep": torch.tensor([0.2, 0.9]),
        "attention_mask": frames,
        "latent_cond": randn(g, 2, FRAMES, LATENT),
    }


def local_inputs(g: torch.Generator) -> dict:
    # no frame mask and no latent condition: both optional in the forward
    return {
        "hidden_states": randn(g, 1, FRAMES, LATENT, grad=True),
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM, grad=True),
        "encoder_attention_mask": torch.tensor([[True, True, True, True, False]]),
        "timestep": torch.tensor([0.7]),
    }


LONGCAT = Case("longcat-audio", longcat_model, longcat_inputs, output=lambda out: out.sample)
LONGCAT_PADDED = Case("longcat-audio-padded", longcat_model, padded_inputs, output=lambda out: out.sample)
LONGCAT_LOCAL = Case("longcat-audio-local", lambda: longcat_model(**LOCAL), local_inputs,
                     output=lambda out: out.sample)


class TestLongCatAudio(ConformanceSuite):
    case = LONGCAT


class TestLongCatAudioPadded(ConformanceSuite):
    case = LONGCAT_PADDED
    reduced = True


class TestLongCatAudioLocal(ConformanceSuite):
    case = LONGCAT_LOCAL
    reduced = True


def test_variant_inputs_change_the_output() -> None:
    # the cases exercise their paths: the latent condition, the padding of the second clip (which leaves the
    # first alone), the caption mask of the local layout
    plain = sample_output(LONGCAT)
    assert not torch.equal(plain, sample_output(LONGCAT, latent_cond=None))
    padded = sample_output(LONGCAT_PADDED)
    full = sample_output(LONGCAT_PADDED, attention_mask=torch.ones(2, FRAMES, dtype=torch.bool),
                   encoder_attention_mask=torch.ones(2, TEXT, dtype=torch.bool))
    assert torch.equal(padded[0], full[0]) and not torch.equal(padded[1], full[1])
    assert torch.equal(padded[1, -2:], torch.zeros_like(padded[1, -2:]))  # padded frames come out zero
    local = sample_output(LONGCAT_LOCAL)
    assert not torch.equal(local, sample_output(LONGCAT_LOCAL, encoder_attention_mask=torch.ones(1, TEXT, dtype=torch.bool)))


@pytest.mark.parametrize("case", [LONGCAT, LONGCAT_LOCAL], ids=lambda c: c.name)
def test_interval_chunks_run_whole(case: Case) -> None:
    # a wrong carry would still be exact (chunks fall back), so parity alone cannot tell
    report = check_chunks_run_whole(case, CHUNKED, ["blocks[0, 1]", "blocks[2, 3]"])
    assert report.saved_ratio < 1


@pytest.mark.parametrize(("case", "global_adaln"), [(LONGCAT, True), (LONGCAT_LOCAL, False)],
                         ids=["global", "local"])
def test_the_loop_hands_every_block_the_same_objects(case: Case, global_adaln: bool) -> None:
    # What the carry rests on: every argument but hidden_states is one object (or None) for all four blocks,
    # and each block gets its predecessor's return value.
    model = case.fresh()
    seen, returned = record_block_calls(model.blocks)
    with torch.no_grad():
        model(**case.inputs(torch.Generator().manual_seed(1)))
    assert len(seen) == 4
    for name in ("timestep_embed", "cond", "mask", "cond_mask", "rope", "cond_rope", "adaln_global_out"):
        assert all(kw.get(name) is seen[0].get(name) for kw in seen), name
    assert (seen[0].get("adaln_global_out") is not None) is global_adaln
    assert all(kw["hidden_states"] is out for kw, out in zip(seen[1:], returned))


def test_ffn_seam_is_called_on_one_fresh_tensor() -> None:
    model = LONGCAT.fresh()
    ffn = plan(model, family_for(model), gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.blocks, r.seam) for r in ffn.regions] == [((i,), ("ffn",)) for i in range(4)]
    fed: list[tuple] = []
    for block in model.blocks:
        block.ffn.register_forward_pre_hook(lambda _m, a, kw: fed.append((a, kw)), with_kwargs=True)
    with torch.no_grad():
        model(**longcat_inputs(torch.Generator().manual_seed(1)))
    assert len(fed) == 4 and all(len(a) == 1 and not kw for a, kw in fed)


def test_cross_attention_is_optional() -> None:
    # The published layout offloads both attentions; built with cross_attn=False the blocks have no
    # cross_attn, and the family still plans (self_attn alone) instead of refusing the model.
    for case, paths in ((LONGCAT, {("self_attn",), ("cross_attn",)}), (LONGCAT_LOCAL, {("self_attn",)})):
        model = case.fresh()
        the_plan = plan(model, family_for(model), gradseam.CheckpointConfig.coerce(OFFLOAD_ATTENTION))
        assert {r.seam for r in the_plan.regions if r.shape == "attention"} == paths
        assert hasattr(model.blocks[0], "cross_attn") is (case is LONGCAT)


def test_diffusers_has_no_checkpointing_of_its_own() -> None:
    model = LONGCAT.fresh()
    with pytest.raises(ValueError, match="does not support gradient checkpointing"):
        model.enable_gradient_checkpointing()


def test_rope_cache_keeps_inference_tensors_patched_or_not() -> None:
    # Upstream: AudioDiTRotaryEmbedding._build is lru_cached per (module, length, device). A forward under
    # torch.inference_mode() (validation, say) caches inference tensors, and a later training step at the same
    # length cannot save them for backward. gradseam neither causes nor hides it.
    inputs = longcat_inputs(torch.Generator().manual_seed(1))
    for patched in (False, True):
        model = LONGCAT.fresh()
        with torch.inference_mode():
            model(**longcat_inputs(torch.Generator().manual_seed(1)))
        handle = gradseam.patch(model, CHUNKED) if patched else None
        with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
            model(**inputs).sample.sum().backward()
        if handle is not None:
            handle.remove()


# -- the presets at full size ----------------------------------------------------------------------
PRESETS = {"1b-30s": (24, 1536, 30), "3.5b-30s": (32, 2560, 30), "3.5b-60s": (32, 2560, 60)}


@functools.cache
def _preset_model(name: str) -> tuple:
    return preset_model("longcat-audio", name)  # on meta; the tests below only read and plan it


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_plan_at_full_size(name: str) -> None:
    family, preset, model = _preset_model(name)
    assert set(family.presets) == set(PRESETS)
    assert family_for(model) is family
    params = set(inspect.signature(LongCatAudioDiTTransformer.__init__).parameters) - {"self"}
    assert set(preset.config) == params  # every constructor argument, spelled out
    depth, width, _ = PRESETS[name]
    low, high = (0.97e9, 0.99e9) if depth == 24 else (3.38e9, 3.41e9)
    assert low < sum(p.numel() for p in model.parameters()) < high
    block = model.blocks[0]
    assert (len(model.blocks), block.self_attn.heads, block.ffn.ff[0].out_features) == (
        depth, depth, 6144 if depth == 24 else 9216)
    assert model.config.dit_dim == width
    for config, regions in (({"gradient_checkpointing": True}, depth), (CHUNKED, depth // 2), (FFN, depth)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert len(the_plan.regions) == regions
        assert sorted(i for r in the_plan.regions for i in r.blocks) == list(range(depth))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_inputs_have_the_pipelines_sizes(name: str) -> None:
    _, preset, model = _preset_model(name)
    seconds = PRESETS[name][2]
    frames, text = {30: (351, 143), 60: (703, 286)}[seconds]  # int(s * 24000 // 2048); s / 0.21 + 1
    assert (latent_frames(seconds), caption_tokens(seconds)) == (frames, text)
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, frames, 64) and x["hidden_states"].requires_grad
    assert x["latent_cond"].shape == (1, frames, 64) and not x["latent_cond"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, text, 768)
    assert x["attention_mask"].shape == (1, frames) and x["encoder_attention_mask"].shape == (1, text)
    assert x["attention_mask"].dtype == x["encoder_attention_mask"].dtype == torch.bool
    assert preset.make_inputs(model, "meta", torch.bfloat16, 100, **preset.inputs)["hidden_states"].shape[1] == 100


def test_preset_input_builder_runs_the_model() -> None:
    family = gradseam.registry.REGISTRY.get("longcat-audio")
    model = LONGCAT.fresh()
    x = family.presets["1b-30s"].make_inputs(model, "cpu", torch.float32, None, seconds=1.0)
    assert x["hidden_states"].shape == (1, 11, LATENT) and x["encoder_hidden_states"].shape == (1, 5, TEXT_DIM)
    assert x["latent_cond"][:, 3:].abs().sum() == 0 and x["latent_cond"][:, :3].abs().sum() > 0  # 30% prompt
    out = model(**x).sample
    assert out.shape == (1, 11, LATENT)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_steps_and_patches_exactly() -> None:
    """`gradseam bench --family longcat-audio --layers 2` on a tiny preset with the real input builder (the
    presets share it; they differ in config alone)."""
    check_bench_workload("longcat-audio", TINY, {"seconds": 1.0, "text_tokens": TEXT}, preset="1b-30s", sequence=11)


def test_configs_are_the_published_ones() -> None:
    # the 1B is the class defaults; the 3.5B differs in width, depth, heads and MLP ratio only
    defaults = {k: v.default for k, v in inspect.signature(LongCatAudioDiTTransformer.__init__).parameters.items()
                if k != "self"}
    assert defaults == CONFIG_1B
    assert {k for k in CONFIG_1B if CONFIG_1B[k] != CONFIG_3_5B[k]} == {"dit_dim", "dit_depth", "dit_heads", "ff_mult"}
