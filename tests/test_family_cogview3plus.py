"""CogView3-Plus: a tiny deterministic model through the conformance kit (text and image as two streams of
one block, the one ``ff`` called on both streams concatenated), input variants (a batch of two at their own
timesteps and size conditions on a non-square latent; the float16 path, where every block clips its
outputs), interval chunks that chain both streams, the loop handing every block the same ``emb``,
diffusers' own checkpointing flag, and the presets at full size with their real input builder."""

from __future__ import annotations

import inspect

import pytest
import torch
from family_checks import (
    assert_plans_cover_every_block,
    check_chunks_run_whole,
    record_block_calls,
    sample_output,
)

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

TEXT, TEXT_DIM, SIDE = 6, 12, 4  # T5 tokens, T5 width, latent side (2x2 patches: 4 image tokens)
CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}

# 2 heads x 8 = 16 wide (the sin-cos position table needs a multiple of 4), 4 blocks, an 8x8 position
# table (latents up to 32 wide in 2x2 patches).
TINY = dict(
    patch_size=2, in_channels=4, out_channels=4, num_layers=4, attention_head_dim=8, num_attention_heads=2,
    text_embed_dim=TEXT_DIM, time_embed_dim=8, condition_dim=4, pos_embed_max_size=8, sample_size=8,
)


def cogview3plus_model(half: bool = False) -> torch.nn.Module:
    from diffusers import CogView3PlusTransformer2DModel

    model = CogView3PlusTransformer2DModel(**TINY)
    return model.half() if half else model  # .half(): diffusers' .to(dtype) warns about fp32 modules it has none of


def _sizes(batch: int, height: int, width: int, dtype: torch.dtype = torch.float32) -> dict:
    # original_size / target_size / crop_coords as the pipeline passes them: (batch, 2), the text dtype
    size = torch.tensor([[height, width]], dtype=dtype).repeat(batch, 1)
    return {"original_size": size, "target_size": size.clone(), "crop_coords": torch.zeros(batch, 2, dtype=dtype)}


def cogview3plus_inputs(g: torch.Generator) -> dict:
    # the pipeline's timestep is the DDIM scheduler's integer step
    return {
        "hidden_states": randn(g, 1, 4, SIDE, SIDE, grad=True),
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM, grad=True),
        "timestep": torch.tensor([500]),
        **_sizes(1, 32, 32),
    }


def cogview3plus_batch_inputs(g: torch.Generator) -> dict:
    # Two samples at their own timesteps and size conditions (emb differs per sample) on a 4x8 latent
    # (2x4 patches: a non-square slice of the position table).
    sizes = _sizes(2, 32, 64)
    sizes["original_size"] = torch.tensor([[32.0, 64.0], [48.0, 96.0]])
    sizes["crop_coords"] = torch.tensor([[0.0, 0.0], [8.0, 16.0]])
    return {
        "hidden_states": randn(g, 2, 4, SIDE, 2 * SIDE, grad=True),
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
        "timestep": torch.tensor([120, 870]),
        **sizes,
    }


def cogview3plus_fp16_inputs(g: torch.Generator) -> dict:
    # float16, one of the model card's precisions: each block then clips both streams to the fp16 range,
    # so what the next block (and a chunk's carry) gets is that clipped copy
    half = torch.float16
    return {
        "hidden_states": randn(g, 1, 4, SIDE, SIDE).to(half).requires_grad_(),
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM).to(half).requires_grad_(),
        "timestep": torch.tensor([500]),
        **_sizes(1, 32, 32, half),
    }


COGVIEW3PLUS = Case("cogview3plus", cogview3plus_model, cogview3plus_inputs)
COGVIEW3PLUS_BATCH = Case("cogview3plus-batch", cogview3plus_model, cogview3plus_batch_inputs)
COGVIEW3PLUS_FP16 = Case("cogview3plus-fp16", lambda: cogview3plus_model(half=True), cogview3plus_fp16_inputs)
CASES = [COGVIEW3PLUS, COGVIEW3PLUS_BATCH, COGVIEW3PLUS_FP16]


class TestCogView3Plus(ConformanceSuite):
    case = COGVIEW3PLUS


class TestCogView3PlusBatch(ConformanceSuite):
    case = COGVIEW3PLUS_BATCH
    reduced = True


class TestCogView3PlusFp16(ConformanceSuite):
    case = COGVIEW3PLUS_FP16
    reduced = True


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_interval_chunks_chain_both_streams(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back): both chunks must be served whole, and the
    # text stream, which leaves the last block unused, must still get its gradient through them.
    report = check_chunks_run_whole(case, CHUNKED, ["transformer_blocks[0, 1]", "transformer_blocks[2, 3]"])
    assert report.saved_ratio < 1
    assert report.patched.input_grads["encoder_hidden_states"].abs().sum() > 0


def test_the_loop_hands_every_block_the_same_emb() -> None:
    # What the carry relies on: emb is one object for every block (the loop passes it by keyword, and
    # takes no mask, RoPE or attention_kwargs); the streams are what the previous block returned.
    model = COGVIEW3PLUS_BATCH.fresh()
    seen, returned = record_block_calls(model.transformer_blocks)
    with torch.no_grad():
        model(**COGVIEW3PLUS_BATCH.inputs(torch.Generator().manual_seed(1)))
    assert len(seen) == 4 and set(seen[0]) == {"hidden_states", "encoder_hidden_states", "emb"}
    assert all(kw["emb"] is seen[0]["emb"] for kw in seen)
    assert seen[0]["emb"].shape[0] == 2 and not torch.equal(seen[0]["emb"][0], seen[0]["emb"][1])
    for before, kw in zip(returned, seen[1:]):
        assert kw["hidden_states"] is before[0] and kw["encoder_hidden_states"] is before[1]


def test_variant_inputs_change_the_output() -> None:
    # The batch case exercises its paths: the per-sample timesteps and the size conditions both matter.
    batch = sample_output(COGVIEW3PLUS_BATCH)
    assert not torch.equal(batch, sample_output(COGVIEW3PLUS_BATCH, timestep=torch.tensor([120, 120])))
    assert not torch.equal(batch, sample_output(COGVIEW3PLUS_BATCH, crop_coords=torch.zeros(2, 2)))


def test_ff_is_one_region_over_both_streams() -> None:
    # The seam's module is called once per block, on the concatenated [text, image] norms: one region per
    # block, run whole, and the -ffn step is exact and keeps less.
    family = family_for(COGVIEW3PLUS.fresh())
    assert family.name == "cogview3plus"
    the_plan = plan(COGVIEW3PLUS.fresh(), family, gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.blocks, r.seam) for r in the_plan.regions] == [((i,), ("ff",)) for i in range(4)]
    report = check_strategy(COGVIEW3PLUS, FFN, whole=True)
    ff = [r for r in report.regions if r.shape == "ffn"]
    assert len(ff) == 4 and all(r.calls == (1,) and r.runs == 1 and r.whole for r in ff), ff
    assert report.saved_ratio < 1


def test_builtin_flag_is_exact_and_owned_by_gradseam() -> None:
    # diffusers' flag calls the blocks positionally with (hidden_states, encoder_hidden_states, emb)
    check_builtin_flag(COGVIEW3PLUS_BATCH, CHUNKED)


# -- the presets at full size ----------------------------------------------------------------------
PRESETS = {"3b-1024": (128, 128), "3b-2048x1024": (256, 128)}  # latent (height, width)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_plan_at_full_size(name: str) -> None:
    from diffusers import CogView3PlusTransformer2DModel

    family, preset, model = preset_model("cogview3plus", name)
    assert set(family.presets) == set(PRESETS)
    assert family_for(model) is family
    params = set(inspect.signature(CogView3PlusTransformer2DModel.__init__).parameters) - {"self"}
    assert set(preset.config) == params  # every constructor argument, spelled out
    assert 2.8e9 < sum(p.numel() for p in model.parameters()) < 2.9e9
    block = model.transformer_blocks[0]
    assert (len(model.transformer_blocks), block.attn1.heads, block.ff.net[0].proj.out_features) == (30, 64, 10240)
    assert_plans_cover_every_block(model, family, 30, (
        ({"gradient_checkpointing": True}, 30), (CHUNKED, 15), (FFN, 30)
    ))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_inputs_have_the_pipelines_sizes(name: str) -> None:
    _, preset, model = preset_model("cogview3plus", name)
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 16, *PRESETS[name]) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 224, 4096)
    assert x["timestep"].shape == (1,) and x["timestep"].dtype == torch.int64
    assert [x[k].shape for k in ("original_size", "target_size", "crop_coords")] == [(1, 2)] * 3
    assert all(x[k].dtype == torch.bfloat16 for k in ("original_size", "target_size", "crop_coords"))
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 1024, **preset.inputs)
    assert fewer["hidden_states"].shape == (1, 16, 64, 64)


def test_preset_sizes_and_the_position_table_limit() -> None:
    # original_size / target_size carry the picture's size, as CogView3PlusPipeline passes them; a grid past
    # the 128x128 position table is refused with the limit, not sliced short inside patch_embed.
    _, preset, model = preset_model("cogview3plus", "3b-1024")
    x = preset.make_inputs(model, "cpu", torch.float32, None, height=768, width=1344, text_tokens=4)
    assert x["hidden_states"].shape == (1, 16, 96, 168)
    assert x["original_size"].tolist() == x["target_size"].tolist() == [[768.0, 1344.0]]
    assert x["crop_coords"].tolist() == [[0.0, 0.0]]
    assert preset.make_inputs(model, "meta", torch.float32, 128 * 128)["hidden_states"].shape == (1, 16, 256, 256)
    with pytest.raises(ValueError, match=r"129x129 patch grid exceeds the position table \(128x128"):
        preset.make_inputs(model, "meta", torch.float32, 129 * 129)
    with pytest.raises(ValueError, match="at most 2048 pixels a side"):
        preset.make_inputs(model, "meta", torch.float32, None, height=2560, width=1024)


def test_preset_input_builder_runs_the_model() -> None:
    family = gradseam.registry.REGISTRY.get("cogview3plus")
    model = COGVIEW3PLUS.fresh()
    x = family.presets["3b-1024"].make_inputs(model, "cpu", torch.float32, None, height=32, width=64,
                                               text_tokens=TEXT)
    assert x["encoder_hidden_states"].shape == (1, TEXT, TEXT_DIM)
    out = model(**x).sample
    assert out.shape == (1, 4, SIDE, 2 * SIDE)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_steps_and_patches_exactly() -> None:
    """`gradseam bench --family cogview3plus --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload("cogview3plus", TINY, {"height": 32, "width": 32, "text_tokens": TEXT},
                         preset="3b-1024", sequence=SIDE * SIDE // 4)
