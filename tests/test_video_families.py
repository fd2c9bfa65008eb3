"""LTX-2 and MageFlow beyond the conformance suite (tests/test_conformance.py runs every strategy on
them): audio inputs reach the patched path, chunks really carry both streams, the presets' sizes."""

from __future__ import annotations

import pytest
import torch
from cases_video import (
    LTX2,
    LTX2_MASKED,
    LTX2_STG,
    MAGEFLOW,
    MAGEFLOW_TINY,
    mageflow_class,
    mageflow_img_ids,
)

import gradseam
from gradseam.config import CheckpointConfig
from gradseam.patcher import family_for
from gradseam.planning import plan
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
    return {f"{r.list_path}{list(r.blocks)}": bool(r.fallbacks) for r in handle.regions() if r.shape == "chunk"}


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
    if not _mageflow_shipped():
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


def test_presets_build_the_published_sizes(monkeypatch):
    from diffusers import LTX2VideoTransformer3DModel

    from gradseam.tools.workloads import build

    ltx2 = REGISTRY.get("ltx2").presets["19b-768x512"]
    with torch.device("meta"):
        model = LTX2VideoTransformer3DModel(**ltx2.config)
    block = model.transformer_blocks[0]
    assert len(model.transformer_blocks) == 48
    assert (block.attn1.heads, block.attn1.head_dim) == (32, 128)
    assert (block.audio_attn1.heads, block.audio_attn1.head_dim) == (32, 64)

    # built the way `gradseam bench --family mageflow` builds it: the class found in diffusers by name
    _ship_mageflow(monkeypatch)
    model = build("mageflow", "base-1024", device="meta").model
    block = model.transformer_blocks[0]
    assert len(model.transformer_blocks) == 12
    assert block.img_mlp.net[0].proj.in_features == 3072 and block.txt_mlp.net[0].proj.out_features == 4 * 3072
    assert block.attn.to_q.out_features == 3072 and block.attn.heads == 24  # 24 heads of 128
    assert (model.x_embedder.in_features, model.context_embedder.in_features) == (128, 2560)
    assert sum(model.config.axes_dim) == 128  # every channel of a head is rotated
    assert model.proj_out.out_features == 128


# -- MageFlow against its upstream class ------------------------------------------------------------
# The upstream class (huggingface/diffusers#14295) is not in a diffusers release yet. These pin the
# public surface the adapter's preset and input builder rely on, so that they work unchanged with it.

UPSTREAM_INIT = {"in_channels", "out_channels", "context_in_dim", "hidden_size", "num_attention_heads",
                 "num_layers", "axes_dim", "patch_size"}
UPSTREAM_FORWARD = {"hidden_states", "encoder_hidden_states", "timestep", "img_ids"}


def _mageflow_shipped() -> bool:
    import diffusers

    return hasattr(diffusers, "MageFlowTransformer2DModel")


def _ship_mageflow(monkeypatch) -> None:
    """Make ``diffusers.MageFlowTransformer2DModel`` resolve, as it will once a release exports it."""
    import diffusers

    if not _mageflow_shipped():
        monkeypatch.setattr(diffusers, "MageFlowTransformer2DModel", mageflow_class(), raising=False)


def test_mageflow_preset_and_inputs_use_the_upstream_signature():
    import inspect

    cls = mageflow_class()
    preset = REGISTRY.get("mageflow").presets["base-1024"]
    assert set(preset.config) <= UPSTREAM_INIT <= set(inspect.signature(cls.__init__).parameters)
    forward = inspect.signature(cls.forward).parameters
    assert set(forward) >= UPSTREAM_FORWARD
    torch.manual_seed(0)
    model = MAGEFLOW.build()
    inputs = preset.make_inputs(model, torch.device("cpu"), torch.float32, 9, text_tokens=5)
    assert set(inputs) == UPSTREAM_FORWARD  # nothing the upstream forward might not take
    assert inputs["img_ids"].tolist() == [[0, r, c] for r in range(3) for c in range(3)]
    assert inputs["hidden_states"].shape == (1, 9, MAGEFLOW_TINY["in_channels"])
    assert inputs["hidden_states"].requires_grad
    assert inputs["encoder_hidden_states"].shape == (1, 5, MAGEFLOW_TINY["context_in_dim"])
    assert model(**inputs).sample.shape == (1, 9, MAGEFLOW_TINY["out_channels"])


def test_mageflow_positions_reach_the_attention():
    # img_ids drive the rotary embedding: permuting them must change the output, or the cases above
    # would not exercise the (complex-valued) rotary path that attention offload has to carry.
    torch.manual_seed(0)
    model = MAGEFLOW.build()
    inputs = MAGEFLOW.inputs(torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(**inputs).sample
        inputs["img_ids"] = mageflow_img_ids(4, 4)[:, [0, 2, 1]]  # transposed grid
        moved = model(**inputs).sample
    assert not torch.equal(plain, moved)


def test_mageflow_bench_workload_runs_and_patches_exactly(monkeypatch):
    """What `gradseam bench --family mageflow` does, on a tiny preset: find the class in diffusers,
    build it truncated, build its inputs, step; then the same step patched is bit-identical."""
    from dataclasses import replace

    from gradseam import Preset
    from gradseam.tools.checks import find_family
    from gradseam.tools.measure import forward_backward, grad_leaves
    from gradseam.tools.workloads import build, sequence_length

    _ship_mageflow(monkeypatch)
    family = find_family("mageflow")
    real = family.presets["base-1024"]
    tiny = replace(family, presets={"tiny": Preset("tiny", MAGEFLOW_TINY, {"image_tokens": 16, "text_tokens": 6},
                                                   real.make_inputs)})
    workload = build(tiny, "tiny", layers=4, device="cpu", dtype=torch.float32)
    assert workload.truncated == {"transformer_blocks": (4, 5)}
    inputs = workload.inputs()
    assert sequence_length(workload.model, workload.family, inputs) == 16
    leaves = grad_leaves(inputs)
    forward_backward(workload.model, inputs)()
    reference = [t.grad.clone() for t in leaves]
    with gradseam.patch(workload.model, CHUNKED) as handle:
        assert handle.family.name == "mageflow"
        forward_backward(workload.model, inputs)()
    assert all(torch.equal(t.grad, r) for t, r in zip(leaves, reference))
    assert workload.inputs(tokens=64)["img_ids"].shape == (64, 3)

