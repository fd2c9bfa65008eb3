"""Mochi 1 (MochiTransformer3DModel) through the conformance kit, plus its presets.

The plain case (one right-padded prompt) runs the kit's whole matrix: exact outputs and every
parameter and input gradient for ``torch`` / ``torch-ffn`` x interval x stride, kept attention, the
offload backends through the engine's CPU test mode, ``no_grad``, refusals. A batch of two prompts
padded to different lengths (the attention processor then runs one SDPA per sample, each over its
own valid text tokens) runs a reduced matrix. Then: the chunks run whole, the last
(``context_pre_only``) block has one seam fewer, the mask and RoPE really reach the blocks, and the
presets build on the meta device and plan at full size.
"""

from __future__ import annotations

import pytest
import torch
from family_checks import check_chunks_run_whole

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

CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}

# Video stream 2 x 8 = 16 wide, text stream 8 wide (the asymmetry of the real model, 3072 vs 1536);
# T5 states 16 wide (the caption pooler's 8 heads of 2). Four blocks: blocks 0-2 full, block 3
# context_pre_only; at interval 2 the second chunk ends in it.
TEXT = 6
TINY = {
    "patch_size": 2, "num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 4,
    "pooled_projection_dim": 8, "in_channels": 4, "text_embed_dim": 16, "time_embed_dim": 8,
    "max_sequence_length": TEXT,
}


def mochi_model():
    from diffusers import MochiTransformer3DModel

    model = MochiTransformer3DModel(**TINY)
    # upstream initialises the RoPE frequencies to zero (cos 1, sin 0: no rotation at all); random
    # ones (drawn under the kit's seed, so deterministic) make the blocks' rotary path compute
    with torch.no_grad():
        model.pos_frequencies.normal_()
    return model


def mochi_inputs(g: torch.Generator) -> dict:
    # 2 latent frames x 4 x 4 (2 x 2 patches of 2): 8 video tokens; 6 prompt tokens, the last two padding
    return {
        "hidden_states": randn(g, 1, 4, 2, 4, 4, grad=True),
        "encoder_hidden_states": randn(g, 1, TEXT, 16, grad=True),
        "timestep": torch.tensor([500.0]),
        "encoder_attention_mask": torch.tensor([[True, True, True, True, False, False]]),
    }


def mochi_batch_inputs(g: torch.Generator) -> dict:
    # two prompts, right-padded as the T5 tokenizer pads them: the first uses all six tokens, the second three
    mask = torch.ones(2, TEXT, dtype=torch.bool)
    mask[1, 3:] = False
    return {
        "hidden_states": randn(g, 2, 4, 2, 4, 4, grad=True),
        "encoder_hidden_states": randn(g, 2, TEXT, 16, grad=True),
        "timestep": torch.tensor([300.0, 800.0]),
        "encoder_attention_mask": mask,
    }


MOCHI = Case("mochi", mochi_model, mochi_inputs)
MOCHI_BATCH = Case("mochi-padded-batch", mochi_model, mochi_batch_inputs)


class TestMochi(ConformanceSuite):
    case = MOCHI


class TestMochiPaddedBatch(ConformanceSuite):
    case = MOCHI_BATCH
    reduced = True


# -- the cuts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [MOCHI, MOCHI_BATCH], ids=lambda c: c.name)
def test_chunks_run_whole_through_the_context_pre_only_block(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back), so parity alone cannot tell: both chunks
    # must be served whole, the second one ending in the last block, which returns its text input as is.
    report = check_chunks_run_whole(case, CHUNKED, ["transformer_blocks[0, 1]", "transformer_blocks[2, 3]"])
    assert report.saved_ratio < 1


def test_seams_are_planned_as_declared() -> None:
    model = MOCHI.fresh()
    family = family_for(model)
    assert family.name == "mochi"
    last = model.transformer_blocks[-1]
    assert last.context_pre_only and last.ff_context is None and last.norm3_context is None
    assert all(b.ff_context is not None for b in model.transformer_blocks[:-1])
    ffn = plan(model, family, gradseam.CheckpointConfig.coerce(FFN))
    seams = [(r.blocks, r.seam) for r in ffn.regions]
    full = [((i,), s) for i in range(3) for s in (("norm3", "ff"), ("norm3_context", "ff_context"))]
    assert seams == [*full, ((3,), ("norm3", "ff"))]  # the last block: one seam fewer


def test_ffn_seams_run_whole_and_keep_less() -> None:
    # norm3 takes the modulation as its own argument and ff is called on its output alone: the seam
    # must run as one region in every block (the text seam in the first three), not fall apart.
    report = check_strategy(MOCHI, FFN, whole=True)
    ffn = [r.label for r in report.regions if r.shape == "ffn"]
    assert len(ffn) == 7 and report.saved_ratio < 1


# -- the inputs reach the blocks ----------------------------------------------------------------


def test_mask_and_rope_are_shared_and_reach_the_blocks() -> None:
    # The loop hands every block the same mask, temb and RoPE objects (what makes the carry right),
    # and the padding and the rotary frequencies both change the output (so the cases test them).
    model = MOCHI_BATCH.fresh()
    seen: list[dict] = []
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(lambda _m, _a, kwargs: seen.append(kwargs), with_kwargs=True)
    inputs = mochi_batch_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        padded = model(**inputs).sample
        unpadded = model(**{**inputs, "encoder_attention_mask": torch.ones(2, TEXT, dtype=torch.bool)}).sample
    first = seen[0]
    assert first["encoder_attention_mask"] is inputs["encoder_attention_mask"]
    for name in ("temb", "encoder_attention_mask", "image_rotary_emb"):
        assert all(call[name] is first[name] for call in seen[:4]), name
    assert torch.equal(padded[0], unpadded[0]) and not torch.equal(padded[1], unpadded[1])
    with torch.no_grad():
        model.pos_frequencies.zero_()
        assert not torch.equal(model(**inputs).sample, padded)


def test_padded_prompt_tokens_get_no_gradient_through_chunks() -> None:
    report = check_strategy(MOCHI_BATCH, CHUNKED)
    grads = report.patched.input_grads["encoder_hidden_states"]
    assert grads[0].abs().sum() > 0 and grads[1, :3].abs().sum() > 0
    assert torch.equal(grads[1, 3:], torch.zeros_like(grads[1, 3:]))  # padding reaches nothing


# -- presets at full size -----------------------------------------------------------------------

PRESETS = {"10b-480p": 28, "10b-480p-85f": 15}  # latent frames: (163 - 1) / 6 + 1, (85 - 1) / 6 + 1


def _meta_model(preset):
    from diffusers import MochiTransformer3DModel

    with torch.device("meta"):
        return MochiTransformer3DModel(**preset.config)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_plan_at_full_size(name: str) -> None:
    family = gradseam.registry.REGISTRY.get("mochi")
    assert set(family.presets) == set(PRESETS)
    model = _meta_model(family.presets[name])
    assert family_for(model) is family
    block = model.transformer_blocks[0]
    # the published config: 48 blocks, 24 x 128 heads (3072 wide), text stream 1536, SwiGLU 8192 / 4096
    assert (len(model.transformer_blocks), block.attn1.heads, block.ff.net[0].proj.out_features,
            block.ff_context.net[0].proj.out_features, model.config.text_embed_dim) == (48, 24, 2 * 8192, 2 * 4096, 4096)
    assert model.transformer_blocks[-1].ff_context is None
    for config, regions in (({"gradient_checkpointing": True}, 48), (CHUNKED, 24), (FFN, 2 * 47 + 1)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert {b for r in the_plan.regions for b in r.blocks} == set(range(48))
        assert len(the_plan.regions) == regions


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_inputs_have_the_pipelines_sizes(name: str) -> None:
    preset = gradseam.registry.REGISTRY.get("mochi").presets[name]
    model = _meta_model(preset)
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    # 480x848 through the 8x spatial AsymmVAE: 60 x 106 latents, 30 x 53 patches of 2
    assert x["hidden_states"].shape == (1, 12, PRESETS[name], 60, 106) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 256, 4096)
    assert x["encoder_attention_mask"].shape == (1, 256) and x["encoder_attention_mask"].dtype == torch.bool
    assert x["timestep"].shape == (1,)
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 4 * 30 * 53, **preset.inputs)
    assert fewer["hidden_states"].shape == (1, 12, 4, 60, 106)


def test_preset_input_builder_runs_the_model() -> None:
    # the builder's inputs must be ones the model takes: the tiny model, at a tiny size, a short prompt
    preset = gradseam.registry.REGISTRY.get("mochi").presets["10b-480p"]
    model = MOCHI.fresh()
    x = preset.make_inputs(model, "cpu", torch.float32, frames=7, height=32, width=32, text_tokens=TEXT,
                           prompt_tokens=4)
    assert x["hidden_states"].shape == (1, 4, 2, 4, 4) and int(x["encoder_attention_mask"].sum()) == 4
    out = model(**x).sample
    assert out.shape == (1, 4, 2, 4, 4)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_and_patches_exactly() -> None:
    """`gradseam bench --family mochi --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload("mochi", TINY, {"frames": 7, "height": 32, "width": 32, "text_tokens": TEXT},
                         preset="10b-480p", sequence=2 * 2 * 2)
