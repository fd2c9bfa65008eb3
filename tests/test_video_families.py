"""LTX-2 and MageFlow beyond the conformance suite (tests/test_conformance.py runs every strategy on
them): audio inputs reach the patched path, chunks really carry both streams, the presets' sizes."""

from __future__ import annotations

import pytest
import torch
from cases_video import LTX2, LTX2_MASKED, LTX2_STG, MAGEFLOW

import gradseam
from gradseam.config import CheckpointConfig
from gradseam.patcher import family_for, plan
from gradseam.registry import REGISTRY
from gradseam.testing import Case, assert_same_step, check_strategy, run_step

CHUNKED = {
    "gradient_checkpointing": True,
    "gradient_checkpointing_backend": "torch",
    "gradient_checkpointing_interval": 2,
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # The tiny models gain nothing from intra-op threads, while on a busy two-core machine the
    # thread pool's waits made every step four to five times slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_ltx2_audio_inputs_reach_the_patched_path():
    # Exactness alone would pass if the audio inputs or masks were dead weight in the case; make
    # sure they are not: each audio input gets a gradient through the chunked blocks, and dropping
    # the masks and the separate audio timestep changes both outputs.
    report = check_strategy(LTX2_MASKED, CHUNKED)
    for name in ("audio_hidden_states", "audio_encoder_hidden_states"):
        assert report.patched.input_grads[name].abs().sum() > 0, name

    extras = ("encoder_attention_mask", "audio_encoder_attention_mask", "audio_timestep", "video_self_attention_mask")
    plain = Case(
        "ltx2-masks-dropped",
        LTX2_MASKED.build,
        lambda g: {k: v for k, v in LTX2_MASKED.inputs(g).items() if k not in extras},
        output=LTX2_MASKED.output,
    )
    torch.manual_seed(LTX2_MASKED.seed)
    dropped = run_step(plain.build(), plain)
    for video_or_audio in (0, 1):
        assert not torch.equal(dropped.outputs[video_or_audio], report.reference.outputs[video_or_audio])


def _chunk_fallbacks(model: torch.nn.Module) -> dict[str, bool]:
    handle = gradseam.handle_of(model)
    assert handle is not None
    return {f"{r.list_path}{list(r.blocks)}": bool(r.fallbacks) for r in handle.regions() if r.kind == "chunk"}


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (LTX2, {"transformer_blocks[0, 1]": False, "transformer_blocks[2, 3]": False}),
        (LTX2_MASKED, {"transformer_blocks[0, 1]": False, "transformer_blocks[2, 3]": False}),
        (MAGEFLOW, {"transformer_blocks[0, 1]": False, "transformer_blocks[2, 3]": False}),
        # STG gives blocks 1 and 2 their own perturbation mask, so both chunks must see the
        # arguments change and fall back to per-block regions.
        (LTX2_STG, {"transformer_blocks[0, 1]": True, "transformer_blocks[2, 3]": True}),
    ],
    ids=["ltx2", "ltx2-masked", "mageflow", "ltx2-stg"],
)
def test_chunks_really_carry_both_streams(case, expected):
    # A wrong Carry would still be exact (the chunk falls back when its prediction misses), so
    # parity alone cannot tell; the chunk must run whole whenever the model's loop allows it.
    torch.manual_seed(case.seed)
    model = case.build()
    with gradseam.patch(model, CHUNKED):
        run_step(model, case)
        assert _chunk_fallbacks(model) == expected


def test_ltx2_regions():
    torch.manual_seed(0)
    model = LTX2.build()
    family = family_for(model)
    assert family.name == "ltx2"
    ffn_config = CheckpointConfig.coerce({"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"})
    ffn = plan(model, family, ffn_config)
    assert [r.seam for r in ffn.regions if r.blocks == (0,)] == [("ff",), ("audio_ff",)]
    chunks = plan(model, family, CheckpointConfig.coerce(CHUNKED))
    assert [r.blocks for r in chunks.regions] == [(0, 1), (2, 3), (4,)]


def test_mageflow_matches_by_bare_class_name():
    torch.manual_seed(0)
    model = MAGEFLOW.build()
    assert type(model).__module__ == "mageflow_reference"  # not a diffusers module
    family = family_for(model)
    assert family.name == "mageflow"
    assert family.block_class_for(type(model.transformer_blocks[0])).ffn == (("img_mlp",), ("txt_mlp",))


def test_mageflow_builtin_flag_is_owned_by_gradseam():
    # The reference model, like diffusers models, has its own checkpointing flag; with it set before
    # patching, gradseam must still be the only checkpointing layer and stay exact.
    torch.manual_seed(MAGEFLOW.seed)
    model = MAGEFLOW.build()
    reference = run_step(model, MAGEFLOW)
    model.enable_gradient_checkpointing()
    with gradseam.patch(model, CHUNKED):
        assert model.gradient_checkpointing is False
        patched = run_step(model, MAGEFLOW)
    assert model.gradient_checkpointing is True
    assert_same_step(reference, patched, what="built-in flag set before patching")
    assert patched.saved_bytes < reference.saved_bytes


def test_presets_build_the_published_sizes():
    from diffusers import LTX2VideoTransformer3DModel
    from mageflow_reference import MageFlowTransformer2DModel

    ltx2 = REGISTRY.get("ltx2").presets["19b-768x512"]
    with torch.device("meta"):
        model = LTX2VideoTransformer3DModel(**ltx2.config)
    block = model.transformer_blocks[0]
    assert len(model.transformer_blocks) == 48
    assert (block.attn1.heads, block.attn1.head_dim) == (32, 128)
    assert (block.audio_attn1.heads, block.audio_attn1.head_dim) == (32, 64)

    mageflow = REGISTRY.get("mageflow").presets["base-1024"]
    with torch.device("meta"):
        model = MageFlowTransformer2DModel(**mageflow.config)
    assert len(model.transformer_blocks) == 12
    assert model.transformer_blocks[0].img_mlp.net[0].proj.in_features == 3072

