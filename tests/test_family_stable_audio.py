"""Stable Audio Open 1.0 (StableAudioDiTModel) through the conformance kit, plus its preset.

The plain case (one clip with the pipeline's RoPE) runs the kit's whole matrix: exact outputs and every
parameter and input gradient for ``torch`` / ``torch-ffn`` x interval x stride, kept attention, the
offload backends through the engine's CPU test mode, quantized bases, ``no_grad``, the refusals. Two
input variants run the reduced matrix: a batch of two clips at their own timesteps as the pipeline
builds it for classifier-free guidance (the unconditional sample's prompt states zeroed) called with
``return_dict=False``, and the model's two optional boolean padding masks (self-attention over latent
frames, cross-attention over prompt tokens) without RoPE. Then: chunks run whole, every block gets the
same arguments, the ``norm3 → ff`` seam is a strict chain and runs whole, diffusers' own checkpointing
flag under a patch, and the preset at full size on the meta device.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from family_checks import check_chunks_run_whole

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
LAYERS, LATENT, FRAMES, PROMPT, TEXT_DIM, GLOBAL_DIM = 4, 4, 6, 5, 10, 6

# A 16-wide trunk (2 heads x 8, RoPE on the first 4 dims of each head), a cross-attention with one KV
# head for the two query heads (the real 24 over 12), prompt and global inputs of their own widths that
# the model projects; four blocks, so interval 2 forms two chunks.
TINY = {
    "sample_size": FRAMES, "in_channels": LATENT, "num_layers": LAYERS, "attention_head_dim": 8,
    "num_attention_heads": 2, "num_key_value_attention_heads": 1, "out_channels": LATENT, "cross_attention_dim": 12,
    "time_proj_dim": 8, "global_states_input_dim": GLOBAL_DIM, "cross_attention_input_dim": TEXT_DIM,
}


def stable_audio_model() -> Any:
    from diffusers import StableAudioDiTModel

    return StableAudioDiTModel(**TINY)


def _rope(frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    # as StableAudioPipeline makes it: half of each head, over the latent frames + the global token
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    return get_1d_rotary_pos_embed(8 // 2, frames + 1, use_real=True, repeat_interleave_real=False)


def stable_audio_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": randn(g, 1, LATENT, FRAMES, grad=True),
        "timestep": torch.tensor([0.4]),
        "encoder_hidden_states": randn(g, 1, PROMPT, TEXT_DIM, grad=True),
        "global_hidden_states": randn(g, 1, 1, GLOBAL_DIM, grad=True),
        "rotary_embedding": _rope(FRAMES),
    }


def stable_audio_batch_inputs(g: torch.Generator) -> dict:
    # the pipeline's CFG batch: the unconditional sample gets all-zero prompt + duration states, both share
    # the global duration vector; own timesteps here (training draws one per sample); a plain tuple back
    prompt = randn(g, 2, PROMPT, TEXT_DIM)
    prompt[0] = 0.0
    duration = randn(g, 1, 1, GLOBAL_DIM)
    return {
        "hidden_states": randn(g, 2, LATENT, FRAMES, grad=True),
        "timestep": torch.tensor([0.2, 0.9]),
        "encoder_hidden_states": prompt.requires_grad_(),
        "global_hidden_states": duration.repeat(2, 1, 1).requires_grad_(),
        "rotary_embedding": _rope(FRAMES),
        "return_dict": False,
    }


def _masks() -> tuple[torch.Tensor, torch.Tensor]:
    # boolean, True = attend (the model's LongTensor hints fail inside SDPA, unpatched too): the second
    # clip's last two latent frames and last two prompt tokens are padding
    frames = torch.ones(2, FRAMES, dtype=torch.bool)
    frames[1, -2:] = False
    prompt = torch.ones(2, PROMPT, dtype=torch.bool)
    prompt[1, -2:] = False
    return frames, prompt


def stable_audio_mask_inputs(g: torch.Generator) -> dict:
    frames, prompt = _masks()
    return {
        "hidden_states": randn(g, 2, LATENT, FRAMES, grad=True),
        "timestep": torch.tensor([0.3, 0.6]),
        "encoder_hidden_states": randn(g, 2, PROMPT, TEXT_DIM, grad=True),
        "global_hidden_states": randn(g, 2, 1, GLOBAL_DIM, grad=True),
        "attention_mask": frames,
        "encoder_attention_mask": prompt,
    }


STABLE_AUDIO = Case("stable-audio", stable_audio_model, stable_audio_inputs)
STABLE_AUDIO_BATCH = Case("stable-audio-cfg-batch", stable_audio_model, stable_audio_batch_inputs)
STABLE_AUDIO_MASK = Case("stable-audio-masks", stable_audio_model, stable_audio_mask_inputs)


class TestStableAudio(ConformanceSuite):
    case = STABLE_AUDIO


class TestStableAudioBatch(ConformanceSuite):
    case = STABLE_AUDIO_BATCH
    reduced = True


class TestStableAudioMasks(ConformanceSuite):
    case = STABLE_AUDIO_MASK
    reduced = True


# -- the carry ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [STABLE_AUDIO, STABLE_AUDIO_MASK], ids=lambda c: c.name)
def test_chunks_run_whole(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back), so parity alone cannot tell: both chunks
    # must be served whole, the masks included.
    report = check_chunks_run_whole(case, CHUNKED, ["transformer_blocks[0, 1]", "transformer_blocks[2, 3]"])
    assert report.saved_ratio < 1


def test_every_block_gets_the_same_arguments_and_the_inputs_reach_them() -> None:
    # What makes the carry right: the loop hands every block the same prompt, masks and RoPE objects,
    # over frames + 1 tokens; and the masks and the RoPE both change the output (so the cases test them).
    model = STABLE_AUDIO_MASK.fresh()
    seen: list[dict] = []
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(lambda _m, _a, kw: seen.append(dict(kw)), with_kwargs=True)
    inputs = stable_audio_mask_inputs(torch.Generator().manual_seed(1))
    rope = _rope(FRAMES)
    with torch.no_grad():
        masked = model(**inputs).sample
        model(**inputs, rotary_embedding=rope)
    first = seen[0]
    assert len(seen) == 2 * LAYERS and first["hidden_states"].shape == (2, FRAMES + 1, 16)
    for call in seen[:LAYERS]:
        for name in ("attention_mask", "encoder_hidden_states", "encoder_attention_mask", "rotary_embedding"):
            assert call[name] is first[name], name
    assert first["encoder_attention_mask"] is inputs["encoder_attention_mask"]
    assert first["attention_mask"].shape == (2, FRAMES + 1) and first["attention_mask"][:, 0].all()  # global token
    assert all(call["rotary_embedding"] is rope for call in seen[LAYERS:])
    for earlier, later in zip(seen[:LAYERS - 1], seen[1:LAYERS]):
        assert later["hidden_states"] is not earlier["hidden_states"]  # each block hands the next a fresh tensor
    with torch.no_grad():
        plain = model(**{**inputs, "attention_mask": None, "encoder_attention_mask": None}).sample
        roped = model(**inputs, rotary_embedding=rope).sample
    assert torch.equal(masked[0], plain[0]) and not torch.equal(masked[1], plain[1])
    assert not torch.equal(roped, masked)


def test_padded_frames_and_prompt_tokens_get_no_gradient_through_chunks() -> None:
    report = check_strategy(STABLE_AUDIO_MASK, CHUNKED)
    prompt = report.patched.input_grads["encoder_hidden_states"]
    assert prompt[0].abs().sum() > 0 and prompt[1, :-2].abs().sum() > 0
    assert torch.equal(prompt[1, -2:], torch.zeros_like(prompt[1, -2:]))  # padding reaches nothing


# -- the FFN seam -------------------------------------------------------------------------------


def test_norm3_ff_is_a_strict_chain_into_the_residual() -> None:
    # norm3 is called on the residual sum alone, ff on norm3's output alone, and ff's output only meets
    # the residual: the seam's one input is the block's residual stream after cross-attention.
    model = STABLE_AUDIO.fresh()
    block = model.transformer_blocks[1]
    calls: dict[str, tuple] = {}

    def record(name: str) -> Any:
        def hook(_module: torch.nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
            calls.setdefault(name, (args, kwargs, out))

        return hook

    for name in ("attn2", "norm3", "ff"):
        getattr(block, name).register_forward_hook(record(name), with_kwargs=True)
    outputs: list[torch.Tensor] = []
    block.register_forward_hook(lambda _m, _a, out: outputs.append(out))
    with torch.no_grad():
        model(**stable_audio_inputs(torch.Generator().manual_seed(1)))
    (ff_in,), ff_kwargs, ff_out = calls["ff"]
    (norm_in,), norm_kwargs, norm_out = calls["norm3"]
    assert ff_in is norm_out and not ff_kwargs and not norm_kwargs
    assert ff_out.shape[-1] == 16 and block.ff.net[0].proj.out_features == 2 * 4 * 16
    assert torch.equal(outputs[0], ff_out + norm_in)  # nothing but the residual addition after ff
    assert [type(m).__name__ for m in block.ff.net] == ["SwiGLU", "Dropout", "Linear"]
    assert all(m.p == 0.0 for m in block.ff.modules() if isinstance(m, torch.nn.Dropout))


def test_ffn_seams_are_planned_as_declared_and_run_whole() -> None:
    model = STABLE_AUDIO.fresh()
    the_plan = plan(model, family_for(model), gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.blocks, r.seam) for r in the_plan.regions] == [((i,), ("norm3", "ff")) for i in range(LAYERS)]
    report = check_strategy(STABLE_AUDIO, FFN, whole=True)
    assert [r.label for r in report.regions if r.shape == "ffn"] == [
        f"transformer_blocks[{i}].norm3→ff" for i in range(LAYERS)]
    assert report.saved_ratio < 1


# -- diffusers' own checkpointing flag ----------------------------------------------------------


def test_builtin_flag_is_exact_and_suspended_while_patched() -> None:
    # the model's own path passes the five block arguments positionally, in the block's order
    check_builtin_flag(STABLE_AUDIO, CHUNKED)


# -- the preset at full size --------------------------------------------------------------------

PRESET = "open-1.0-47s"


def test_preset_config_is_the_class_defaults() -> None:
    from diffusers import StableAudioDiTModel

    params = inspect.signature(StableAudioDiTModel.__init__).parameters
    family = REGISTRY.get("stable-audio")
    assert list(family.presets) == [PRESET]
    assert family.presets[PRESET].config == {k: p.default for k, p in params.items() if k != "self"}


def test_preset_plans_at_full_size() -> None:
    family, _, model = preset_model("stable-audio", PRESET)
    assert family_for(model) is family
    assert 1.0e9 < sum(p.numel() for p in model.parameters()) < 1.1e9
    block = model.transformer_blocks[0]
    assert (len(model.transformer_blocks), block.attn1.heads, block.attn2.to_k.out_features,
            block.ff.net[0].proj.out_features) == (24, 24, 12 * 64, 2 * 6144)
    for config, regions in ((TORCH, 24), (CHUNKED, 12), (FFN, 24),
                            ({**TORCH, "gradient_checkpointing_keep_attention": True}, 24)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert {b for r in the_plan.regions for b in r.blocks} == set(range(24))
        assert len(the_plan.regions) == regions


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    from gradseam.adapters.stable_audio import latent_frames

    _, preset, model = preset_model("stable-audio", PRESET)
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 64, 1024) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 128 + 2, 768)
    assert x["global_hidden_states"].shape == (1, 1, 1536)
    assert x["timestep"].shape == (1,) and x["hidden_states"].dtype == torch.bfloat16
    cos, sin = x["rotary_embedding"]
    assert cos.shape == sin.shape == (1024 + 1, 32) and cos.dtype == torch.float32
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 100, **preset.inputs)
    assert fewer["hidden_states"].shape == (1, 64, 100) and fewer["rotary_embedding"][0].shape == (101, 32)
    assert [latent_frames(s) for s in (47.55, 10, 1)] == [1024, 216, 22]
    assert preset.make_inputs(model, "meta", torch.bfloat16, None, seconds=10)["hidden_states"].shape[-1] == 216


def test_preset_input_builder_runs_the_model() -> None:
    preset = REGISTRY.get("stable-audio").presets[PRESET]
    model = STABLE_AUDIO.fresh()
    x = preset.make_inputs(model, "cpu", torch.float32, None, prompt_tokens=3)  # sample_size: 6 frames
    assert x["encoder_hidden_states"].shape == (1, 3 + 2, TEXT_DIM)
    out = model(**x).sample
    assert out.shape == (1, LATENT, FRAMES)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_and_patches_exactly() -> None:
    """`gradseam bench --family stable-audio --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload("stable-audio", TINY, {"prompt_tokens": 3}, preset=PRESET, sequence=FRAMES + 1)
