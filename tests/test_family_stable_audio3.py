"""Stable Audio 3 (StableAudio3DiTModel) through the conformance kit, plus its presets.

The plain case (one clip, differential attention, memory tokens) runs the kit's whole matrix: exact
outputs and every parameter and input gradient for ``torch`` / ``torch-ffn`` x interval x stride, kept
attention, the offload backends through the engine's CPU test mode, quantized bases, ``no_grad``, the
refusals. Two variants run the reduced matrix, both a batch of two prompts right-padded to different
lengths with the pipeline's integer mask, at their own flow times, called with ``return_dict=False``:
with the inpainting pipeline's ``local_add_cond``, and on the class's other configuration (plain attention,
``patch_size=2``, no memory tokens). Then: chunks run whole, every block gets the same arguments (the
mask never reaches them), ``ff`` alone is the seam and ``ff_norm`` cannot join it, diffusers' own
checkpointing flag under a patch, and the presets at full size on the meta device.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest
import torch
from family_checks import check_chunks_run_whole, declare_ffn_seam

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
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}
LAYERS, LATENT, FRAMES, PROMPT, COND, GLOBAL, LOCAL, MEMORY = 4, 4, 6, 5, 12, 10, 5, 2

# A 16-wide trunk (2 heads x 8, RoPE on the first 4 dims of each head), differential attention and memory
# tokens as released, a SwiGLU 4x as wide, context and global inputs of their own widths; four blocks, so
# interval 2 forms two chunks.
TINY = {
    "io_channels": LATENT, "patch_size": 1, "embed_dim": 16, "depth": LAYERS, "num_heads": 2, "cond_token_dim": COND,
    "global_cond_dim": GLOBAL, "local_add_cond_dim": LOCAL, "timestep_features_dim": 8, "ff_mult": 4.0,
    "num_memory_tokens": MEMORY, "use_differential_attention": True,
}
# the class's other switches: plain attention, two latent frames per token, no memory tokens
TINY_PLAIN = dict(TINY, use_differential_attention=False, patch_size=2, num_memory_tokens=0)


def _build(config: dict) -> Any:
    from diffusers import StableAudio3DiTModel

    model = StableAudio3DiTModel(**config)
    # upstream zero-initialises the residual convs, the inpainting projection's output and the prompt
    # padding embedding (no-ops until trained); random values, drawn under the kit's seed, make them compute
    with torch.no_grad():
        for module in (model.preprocess_conv, model.postprocess_conv):
            module.weight.normal_(std=0.3)
        model.prompt_padding_embedding.normal_()
        for block in model.transformer_blocks:
            block.to_local_embed[-1].weight.normal_(std=0.3)
            block.to_local_embed[-1].bias.normal_(std=0.3)
    return model


def sa3_model() -> Any:
    return _build(TINY)


def sa3_plain_model() -> Any:
    return _build(TINY_PLAIN)


def sa3_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": randn(g, 1, LATENT, FRAMES, grad=True),
        "timestep": torch.tensor([0.4]),
        "encoder_hidden_states": randn(g, 1, PROMPT, COND, grad=True),
        "global_hidden_states": randn(g, 1, GLOBAL, grad=True),
    }


def _prompt_mask() -> torch.Tensor:
    # the pipeline's context mask: T5Gemma tokens right-padded (the second prompt uses two of four), then
    # the always-valid duration token
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[1, 2:PROMPT - 1] = 0
    return mask


def sa3_padded_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": randn(g, 2, LATENT, FRAMES, grad=True),
        "timestep": torch.tensor([0.2, 0.9]),
        "encoder_hidden_states": randn(g, 2, PROMPT, COND, grad=True),
        "global_hidden_states": randn(g, 2, GLOBAL, grad=True),
        "encoder_attention_mask": _prompt_mask(),
        "return_dict": False,
    }


def sa3_inpaint_inputs(g: torch.Generator) -> dict:
    # what the inpainting pipeline passes: the padded context and its mask, and local_add_cond, the mask
    # channel then the masked latents: (B, 1 + C, T)
    return {**sa3_padded_inputs(g), "local_add_cond": randn(g, 2, LOCAL, FRAMES, grad=True)}


SA3 = Case("stable-audio3", sa3_model, sa3_inputs)
SA3_INPAINT = Case("stable-audio3-inpaint-padded-batch", sa3_model, sa3_inpaint_inputs)
SA3_PLAIN = Case("stable-audio3-plain-attention-patch2", sa3_plain_model, sa3_padded_inputs)


class TestStableAudio3(ConformanceSuite):
    case = SA3


class TestStableAudio3Inpaint(ConformanceSuite):
    case = SA3_INPAINT
    reduced = True


class TestStableAudio3PlainAttention(ConformanceSuite):
    case = SA3_PLAIN
    reduced = True


# -- the carry ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [SA3_INPAINT, SA3_PLAIN], ids=lambda c: c.name)
def test_chunks_run_whole(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back), so parity alone cannot tell: both chunks
    # must be served whole, with the padded context and the inpainting sequence too.
    report = check_chunks_run_whole(case, CHUNKED, ["transformer_blocks[0, 1]", "transformer_blocks[2, 3]"])
    assert report.saved_ratio < 1


def test_every_block_gets_the_same_arguments_and_never_the_mask() -> None:
    # What makes the carry right: one context, modulation, RoPE table and local sequence for all blocks,
    # context_mask None (the model swaps padded prompt positions for its padding embedding, then drops the
    # mask) and the config's memory-token count; the mask and the inpainting input change the output.
    model = SA3_INPAINT.fresh()
    seen: list[tuple[tuple, dict]] = []
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(lambda _m, a, kw: seen.append((a, dict(kw))), with_kwargs=True)
    inputs = {**sa3_inpaint_inputs(torch.Generator().manual_seed(1)), "return_dict": True}
    with torch.no_grad():
        out = model(**inputs).sample
    args, first = seen[0]
    assert len(seen) == LAYERS and len(args) == 1 and args[0].shape == (2, MEMORY + FRAMES, 16)
    assert first["context_mask"] is None and first["num_memory_tokens"] == MEMORY
    assert first["rope"].shape == (MEMORY + FRAMES, 4) and first["local_seq"].shape == (2, FRAMES, LOCAL)
    for _args, kw in seen:
        assert kw.keys() == first.keys()
        for name in ("context", "global_modulation", "rope", "local_seq"):
            assert kw[name] is first[name], name
        assert kw["context_mask"] is None and kw["num_memory_tokens"] == MEMORY
    for (earlier, _), (later, _) in zip(seen[:-1], seen[1:]):
        assert later[0] is not earlier[0]  # each block hands the next a fresh tensor
    with torch.no_grad():
        unmasked = model(**{**inputs, "encoder_attention_mask": None}).sample
        no_local = model(**{**inputs, "local_add_cond": None}).sample
    assert torch.equal(out[0], unmasked[0]) and not torch.equal(out[1], unmasked[1])
    assert not torch.equal(out, no_local)


def test_padded_prompt_tokens_get_no_gradient_through_chunks() -> None:
    # the padded positions are replaced before the projection: no gradient reaches them, chunked or not
    report = check_strategy(SA3_INPAINT, CHUNKED)
    grads = report.patched.input_grads["encoder_hidden_states"]
    assert grads[0].abs().sum() > 0 and grads[1, :2].abs().sum() > 0 and grads[1, -1].abs().sum() > 0
    assert torch.equal(grads[1, 2:-1], torch.zeros_like(grads[1, 2:-1]))


# -- the FFN seam -------------------------------------------------------------------------------


def test_ff_gets_the_modulated_norm_and_feeds_only_the_gated_residual() -> None:
    # Why the seam is ff alone: ff is called on a tensor made from ff_norm's output by the AdaLN shift and
    # scale, not on ff_norm's output; ff's output is gated and added to the residual outside it.
    model = SA3.fresh()
    block = model.transformer_blocks[1]
    calls: dict[str, tuple] = {}

    def record(name: str) -> Any:
        def hook(_module: torch.nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
            calls.setdefault(name, (args, kwargs, out))

        return hook

    for name in ("ff_norm", "ff"):
        getattr(block, name).register_forward_hook(record(name), with_kwargs=True)
    with torch.no_grad():
        model(**sa3_inputs(torch.Generator().manual_seed(1)))
    (ff_in,), ff_kwargs, ff_out = calls["ff"]
    (norm_in,), _, norm_out = calls["ff_norm"]
    assert not ff_kwargs and ff_in is not norm_out and not torch.equal(ff_in, norm_out)
    assert ff_in.shape == norm_out.shape == ff_out.shape
    assert block.ff.proj_in.out_features == 2 * 4 * 16 and block.ff.proj_out.in_features == 4 * 16


def test_ffn_seams_are_planned_as_declared_and_run_whole() -> None:
    model = SA3.fresh()
    the_plan = plan(model, family_for(model), gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.blocks, r.seam) for r in the_plan.regions] == [((i,), ("ff",)) for i in range(LAYERS)]
    report = check_strategy(SA3, FFN, whole=True)
    assert [r.label for r in report.regions if r.shape == "ffn"] == [f"transformer_blocks[{i}].ff" for i in range(LAYERS)]
    assert report.saved_ratio < 1


def test_an_ff_norm_ff_seam_would_not_run_as_one_region(monkeypatch: pytest.MonkeyPatch) -> None:
    # Declared for this test only: the modulation between ff_norm and ff breaks the chain, so the region
    # falls apart (exact, but not what the seam promises). The family declares ff alone.
    declare_ffn_seam(monkeypatch, "stable-audio3", ("ff_norm", "ff"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fall-back warnings this test is about
        report = check_strategy(SA3, FFN)
    seams = [r for r in report.regions if r.shape == "ffn"]
    assert len(seams) == LAYERS and not any(r.whole for r in seams)


# -- diffusers' own checkpointing flag ----------------------------------------------------------


def test_builtin_flag_is_exact_and_suspended_while_patched() -> None:
    # the model's own path passes the seven block arguments positionally, in the block's order
    check_builtin_flag(SA3_INPAINT, CHUNKED)


# -- presets at full size -----------------------------------------------------------------------

PRESETS = {"medium-10s": 108, "medium-120s": 1292, "medium-380s": 4092}  # ceil(s * 44100 / 4096)


def test_latent_frames_follow_the_pipeline() -> None:
    from gradseam.adapters.stable_audio3 import latent_frames

    assert {name: latent_frames(int(name.split("-")[1][:-1])) for name in PRESETS} == PRESETS
    assert [latent_frames(s) for s in (1, 384, 0.05)] == [11, 4135, 1]


def test_preset_config_is_the_class_defaults() -> None:
    from diffusers import StableAudio3DiTModel

    params = inspect.signature(StableAudio3DiTModel.__init__).parameters
    family = REGISTRY.get("stable-audio3")
    assert set(family.presets) == set(PRESETS)
    for preset in family.presets.values():
        assert preset.config == {k: p.default for k, p in params.items() if k != "self"}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_plans_at_full_size(name: str) -> None:
    family, _, model = preset_model("stable-audio3", name)
    assert family_for(model) is family
    assert 1.4e9 < sum(p.numel() for p in model.parameters()) < 1.5e9
    block = model.transformer_blocks[0]
    assert (len(model.transformer_blocks), block.self_attn.heads, block.self_attn.to_qkv.out_features,
            block.ff.proj_in.out_features, model.memory_tokens.shape) == (24, 24, 5 * 1536, 2 * 6144, (64, 1536))
    for config, regions in ((TORCH, 24), (CHUNKED, 12), (FFN, 24),
                            ({**TORCH, "gradient_checkpointing_keep_attention": True}, 24)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert {b for r in the_plan.regions for b in r.blocks} == set(range(24))
        assert len(the_plan.regions) == regions


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_inputs_have_the_pipelines_sizes(name: str) -> None:
    _, preset, model = preset_model("stable-audio3", name)
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    frames = PRESETS[name]
    assert x["hidden_states"].shape == (1, 256, frames) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 256 + 1, 768) and x["global_hidden_states"].shape == (1, 768)
    assert x["encoder_attention_mask"].shape == (1, 257) and x["encoder_attention_mask"].dtype == torch.bool
    assert x["timestep"].shape == (1,) and x["hidden_states"].dtype == torch.bfloat16 and "local_add_cond" not in x
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 100, **preset.inputs, inpaint=True)
    assert fewer["hidden_states"].shape == (1, 256, 100) and fewer["local_add_cond"].shape == (1, 257, 100)


def test_preset_input_builder_runs_the_model() -> None:
    preset = REGISTRY.get("stable-audio3").presets["medium-10s"]
    for case, frames in ((SA3, 6), (SA3_PLAIN, 6)):
        model = case.fresh()
        x = preset.make_inputs(model, "cpu", torch.float32, None, seconds=0.5, prompt_tokens=3, prompt_valid=1,
                               inpaint=model.config.patch_size == 1)
        assert x["encoder_attention_mask"].tolist() == [[True, False, False, True]]
        out = model(**x).sample
        assert out.shape == (1, LATENT, frames)
        out.square().mean().backward()
        assert x["hidden_states"].grad is not None


@pytest.mark.parametrize("inpaint", [False, True])
def test_bench_workload_truncates_and_patches_exactly(inpaint: bool) -> None:
    """`gradseam bench --family stable-audio3 --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload("stable-audio3", TINY, {"seconds": 0.5, "prompt_tokens": 3, "inpaint": inpaint},
                         preset="medium-10s", sequence=6 + MEMORY)
