"""Latte-1 (LatteTransformer3DModel) through the conformance kit, plus its presets.

The plain case (one two-frame video, one prompt) runs the kit's whole matrix over both block lists,
spatial and temporal, interleaved by the model's loop. Reduced suites: a batch of two (own timesteps,
the second prompt's padding zeroed as the pipeline does for a batch of prompts), the text mask in the
one form the model takes (an additive bias per frame), a single frame (text-to-image: temporal blocks
over one-frame sequences, no temporal position embedding), and ``enable_temporal_attentions=False``
(the temporal blocks never run). Then: the loop interleaves the lists and hands neither list one
block's output as the next block's input (why neither declares a carry, and the interval is ignored),
the seam and the attention side are what the adapter declares, the declaration is ``dit``'s, diffusers'
own checkpointing flag, weight streaming (which orders the blocks list by list) over the interleaved
lists, and the preset at full size with its real input builder.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from family_checks import sample_output

import gradseam
from gradseam.adapters import dit, latte
from gradseam.errors import GradseamWarning
from gradseam.offload import cpu_test_mode
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    assert_same_step,
    check_bench_workload,
    check_builtin_flag,
    check_declared_sides,
    check_strategy,
    preset_model,
    randn,
    record_regions,
    reduced_configs,
    reduced_offload_configs,
    run_step,
)

ON = {"gradient_checkpointing": True}
CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}

# 2 heads x 8 = 16 wide, 4 spatial + 4 temporal blocks (as long as the kit's stride-4 rows); 2 frames
# (video_length) of an 8 x 8 latent in 2 x 2 patches: 16 patches per frame; a 5-token prompt 12 wide,
# projected to the 16-wide cross-attention.
FRAMES, TEXT, CAPTION, LAYERS = 2, 5, 12, 4
LISTS = ("transformer_blocks", "temporal_transformer_blocks")  # spatial, temporal
TINY = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=LAYERS,
            cross_attention_dim=16, attention_bias=True, sample_size=8, patch_size=2,
            activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
            norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=CAPTION, video_length=FRAMES)


def latte_model() -> torch.nn.Module:
    from diffusers import LatteTransformer3DModel

    return LatteTransformer3DModel(**TINY)


def latte_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": randn(g, 1, 4, FRAMES, 8, 8, grad=True),
        "encoder_hidden_states": randn(g, 1, TEXT, CAPTION, grad=True),
        "timestep": torch.tensor([500]),
    }


def latte_batch_inputs(g: torch.Generator) -> dict:
    # LattePipeline with a batch of prompts zeroes each prompt's padded T5 states (mask_text_embeddings)
    prompts = randn(g, 2, TEXT, CAPTION)
    prompts[1, 3:] = 0
    return {
        "hidden_states": randn(g, 2, 4, FRAMES, 8, 8, grad=True),
        "encoder_hidden_states": prompts.requires_grad_(True),
        "timestep": torch.tensor([41, 877]),
    }


def latte_mask_inputs(g: torch.Generator) -> dict:
    # The model hands encoder_attention_mask to the spatial blocks' attn2 as it is, on the (B * F) batch: an
    # additive bias (B * F, 1, L), frame-major per sample (the 2-D keep-mask is never converted upstream).
    bias = torch.zeros(2 * FRAMES, 1, TEXT)
    bias[FRAMES:, :, 3:] = -10000.0  # the second sample's last two prompt tokens, in each of its frames
    return {**latte_batch_inputs(g), "encoder_attention_mask": bias}


def latte_image_inputs(g: torch.Generator) -> dict:
    # text-to-image (LattePipeline with video_length=1): one frame, no temporal position embedding
    return {**latte_inputs(g), "hidden_states": randn(g, 1, 4, 1, 8, 8, grad=True)}


def latte_spatial_inputs(g: torch.Generator) -> dict:
    return {**latte_inputs(g), "enable_temporal_attentions": False}


def _sample(out: object) -> torch.Tensor:
    return out.sample  # type: ignore[attr-defined]


LATTE = Case("latte", latte_model, latte_inputs, output=_sample)
LATTE_BATCH = Case("latte-batch", latte_model, latte_batch_inputs, output=_sample)
LATTE_MASK = Case("latte-mask", latte_model, latte_mask_inputs, output=_sample)
LATTE_IMAGE = Case("latte-image", latte_model, latte_image_inputs, output=_sample)
LATTE_SPATIAL = Case("latte-spatial-only", latte_model, latte_spatial_inputs, output=_sample)

# With temporal attention off the temporal blocks never run, and the kit fails a planned region that never
# runs: these rows leave them out (test_temporal_blocks_off_under_a_plain_config shows the plain config).
TEMPORAL_OFF = [{"blocks": "temporal_transformer_blocks", "gradient_checkpointing": False,
                 "gradient_checkpointing_keep_attention": False,
                 "gradient_checkpointing_offload_attention": False}]


class TestLatte(ConformanceSuite):
    case = LATTE


class TestLatteBatch(ConformanceSuite):
    case = LATTE_BATCH
    reduced = True


class TestLatteMask(ConformanceSuite):
    case = LATTE_MASK
    reduced = True


class TestLatteImage(ConformanceSuite):
    case = LATTE_IMAGE
    reduced = True


class TestLatteSpatialOnly(ConformanceSuite):
    case = LATTE_SPATIAL
    configs = [{**c, "gradient_checkpointing_blocks": TEMPORAL_OFF}
               for c in reduced_configs(ffn=True, interval=False)]
    offload = [{**c, "gradient_checkpointing_blocks": TEMPORAL_OFF}
               for c in reduced_offload_configs(ffn=True, interval=False, attention=True)]
    quantized_bases = ()


def test_variant_inputs_change_the_output() -> None:
    # the variants exercise their paths: the mask, the per-sample timesteps and the temporal blocks all matter
    assert not torch.equal(sample_output(LATTE_MASK), sample_output(LATTE_MASK, encoder_attention_mask=None))
    assert not torch.equal(sample_output(LATTE_BATCH), sample_output(LATTE_BATCH, timestep=torch.tensor([41, 41])))
    assert not torch.equal(sample_output(LATTE), sample_output(LATTE_SPATIAL))


# -- no carry --------------------------------------------------------------------------------------


def test_the_loop_interleaves_the_lists_and_rebuilds_every_input() -> None:
    # Why neither list declares a carry: spatial and temporal blocks alternate, and each block's input is a
    # tensor the loop made from the other list's output (a reshape and permute), never a block's return value.
    model = LATTE_BATCH.fresh()
    calls: list[tuple[str, dict]] = []
    returned: list[torch.Tensor] = []
    for kind, path in (("s", "transformer_blocks"), ("t", "temporal_transformer_blocks")):
        for i, block in enumerate(getattr(model, path)):
            sig = inspect.signature(block.forward)
            block.register_forward_pre_hook(
                lambda _m, a, kw, _s=sig, _n=f"{kind}{i}": calls.append((_n, _s.bind(*a, **kw).arguments)),
                with_kwargs=True)
            block.register_forward_hook(lambda _m, _a, out: returned.append(out))
    with torch.no_grad():
        model(**latte_batch_inputs(torch.Generator().manual_seed(1)))
    assert [name for name, _ in calls] == [f"{kind}{i}" for i in range(LAYERS) for kind in "st"]
    for before, (_, call) in zip(returned, calls[1:]):
        assert call["hidden_states"] is not before  # rebuilt by the loop between every two blocks
    spatial, temporal = [call for _, call in calls[0::2]], [call for _, call in calls[1::2]]
    # spatial blocks see (B * F, patches), temporal ones (B * N, frames)
    assert [tuple(c["hidden_states"].shape[:2]) for c in spatial] == [(2 * FRAMES, 16)] * LAYERS
    assert [tuple(c["hidden_states"].shape[:2]) for c in temporal] == [(2 * 16, FRAMES)] * LAYERS
    for group in (spatial, temporal):  # within a list the other arguments are shared objects
        assert all(c["timestep"] is group[0]["timestep"] for c in group)
        assert all(c["encoder_hidden_states"] is group[0]["encoder_hidden_states"] for c in group)
    assert temporal[0]["encoder_hidden_states"] is None and spatial[0]["encoder_hidden_states"] is not None


def test_the_interval_is_ignored_with_a_warning_and_every_block_is_a_region() -> None:
    ignored = "family 'latte' does not support gradient_checkpointing_interval"
    with pytest.warns(GradseamWarning, match=ignored):
        report = check_strategy(LATTE, CHUNKED, whole=True)
    assert [r.label for r in report.regions] == [
        f"{path}[{i}]" for path in LISTS for i in range(LAYERS)
    ]
    assert all(r.shape == "block" for r in report.regions) and report.saved_ratio < 1


def test_temporal_blocks_off_under_a_plain_config() -> None:
    # enable_temporal_attentions=False under a config that plans every block: the temporal regions stay idle,
    # the spatial ones run, the step is exact.
    model, twin = LATTE_SPATIAL.twins()
    want = run_step(twin, LATTE_SPATIAL)
    with gradseam.patch(model, ON) as handle, record_regions(handle) as regions:
        got = run_step(model, LATTE_SPATIAL)
    assert_same_step(want, got)
    ran = {r.label: r.runs for r in regions}
    assert all(ran[f"transformer_blocks[{i}]"] == 1 for i in range(LAYERS))
    assert all(ran[f"temporal_transformer_blocks[{i}]"] == 0 for i in range(LAYERS))


# -- the seams -------------------------------------------------------------------------------------


def test_the_seam_is_ff_and_the_attention_side_attn1_and_attn2_where_built() -> None:
    model = LATTE.fresh()
    family = family_for(model)
    assert family.name == "latte" and family.block_classes == (dit.BASIC_BLOCK,)  # dit's declaration
    assert latte.LATTE.block_classes[0] is dit.BASIC_BLOCK
    assert all(b.attn2 is not None for b in model.transformer_blocks)
    assert all(b.attn2 is None and b.norm2 is not None for b in model.temporal_transformer_blocks)
    the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.list_path, r.blocks, r.seam) for r in the_plan.regions] == [
        (path, (i,), ("ff",)) for path in LISTS for i in range(LAYERS)
    ]
    sites = check_declared_sides(LATTE)  # every kernel inside attn1 or attn2, none inside ff
    where = sorted((s.block.split("[")[0], s.module) for s in sites.sites)
    assert where == sorted([("transformer_blocks", "attn1"), ("transformer_blocks", "attn2"),
                            ("temporal_transformer_blocks", "attn1")] * LAYERS)


def test_the_builtin_flag_is_exact_and_owned_by_gradseam() -> None:
    # diffusers' flag passes both lists' arguments positionally, in the order of the block's parameters
    check_builtin_flag(LATTE_MASK, FFN)


# -- weight streaming over interleaved lists ---------------------------------------------------------


def _frozen_latte() -> torch.nn.Module:
    model = latte_model()
    # streaming moves frozen weights only: the output layer trains, as a LoRA would
    model.requires_grad_(False)
    model.proj_out.requires_grad_(True)
    return model


FROZEN = Case("latte-frozen", _frozen_latte, latte_inputs, output=_sample)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_streamed_weights_are_used_only_while_loaded_though_the_lists_interleave(
    prefetch: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Weight streaming plans blocks list by list (every spatial block, then every temporal one) while the model
    runs them alternately: the first step prefetches in list order (copies of blocks that do not run next, and
    in backward a spatial block's hook releases temporal blocks loaded ahead); from the second, in the order
    the blocks ran, and no load waits. A released weight is poisoned (NaN) here instead of pointing at its host
    copy, so any use outside its block's load would show in the gradients, in either step."""
    from gradseam.offload import weights as weights_module

    want = run_step(FROZEN.fresh(), FROZEN)
    real_release = weights_module.WeightStream.release

    def poisoning(self: object, index: int) -> None:
        block = self.blocks[index]  # type: ignore[attr-defined]
        was_loaded = block.loaded
        real_release(self, index)
        if was_loaded:
            for entry in block.tensors:
                entry.tensor.data = torch.full_like(entry.host, float("nan"))

    monkeypatch.setattr(weights_module.WeightStream, "release", poisoning)
    model = FROZEN.fresh()
    config = {**ON, "gradient_checkpointing_stream_weights": "all",
              "gradient_checkpointing_stream_prefetch": prefetch}
    with cpu_test_mode(), gradseam.patch(model, config) as handle:
        got = run_step(model, FROZEN, count_bytes=False)
        stream = handle.weights
        assert len(stream.blocks) == 2 * LAYERS
        # the run order, learnt in that step: spatial 0, temporal 0, spatial 1, ... (the lists are in list order)
        assert stream.order == [i for pair in zip(range(LAYERS), range(LAYERS, 2 * LAYERS)) for i in pair]
        first = stream.misses
        again = run_step(model, FROZEN, count_bytes=False)
        # prefetching by it, the second step waits for no copy (without prefetch: every load, forward and backward)
        assert stream.misses - first == (0 if prefetch else 4 * LAYERS), (first, stream.misses)
        if prefetch:
            assert first >= 1  # the first step prefetched in list order: temporal block 0 was waited for
    assert_same_step(want, got)
    assert_same_step(want, again)


# -- the preset at full size -----------------------------------------------------------------------


def test_preset_plans_at_full_size() -> None:
    from diffusers import LatteTransformer3DModel

    family, preset, model = preset_model("latte")
    assert set(family.presets) == {"1-512"}
    assert family_for(model) is family
    params = set(inspect.signature(LatteTransformer3DModel.__init__).parameters) - {"self"}
    assert set(preset.config) == params  # every constructor argument, spelled out
    assert 1.05e9 < sum(p.numel() for p in model.parameters()) < 1.07e9
    spatial, temporal = model.transformer_blocks, model.temporal_transformer_blocks
    assert (len(spatial), len(temporal), spatial[0].attn1.heads, spatial[0].ff.net[0].proj.out_features,
            spatial[0].attn2.to_k.in_features) == (28, 28, 16, 4608, 1152)
    assert temporal[0].attn2 is None and model.temp_pos_embed.shape == (1, 16, 1152)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GradseamWarning)  # the interval, ignored
        for config, regions in ((ON, 56), (CHUNKED, 56), (FFN, 56)):
            the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
            assert len(the_plan.regions) == regions


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    _, preset, model = preset_model("latte")
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 4, 16, 64, 64) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 120, 4096)
    assert x["timestep"].shape == (1,) and x["timestep"].dtype == torch.int64
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 16 * 256, **preset.inputs)
    assert fewer["hidden_states"].shape == (1, 4, 16, 32, 32)  # the frames stay: 16 x 16 x 16 tokens
    with pytest.raises(ValueError, match="Latte takes 16 frames .* or 1, got frames=8"):
        preset.make_inputs(model, "meta", torch.bfloat16, None, frames=8)
    assert preset.make_inputs(model, "meta", torch.bfloat16, None, frames=1)["hidden_states"].shape[2] == 1


def test_preset_input_builder_runs_the_model() -> None:
    preset = gradseam.registry.REGISTRY.get("latte").presets["1-512"]
    model = LATTE.fresh()
    x = preset.make_inputs(model, "cpu", torch.float32, None, frames=FRAMES, height=64, width=64,
                           text_tokens=TEXT)
    assert x["encoder_hidden_states"].shape == (1, TEXT, CAPTION)
    out = model(**x).sample
    assert out.shape == (1, 8, FRAMES, 8, 8)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_steps_and_patches_exactly() -> None:
    """`gradseam bench --family latte --layers 2` on a tiny preset with the real input builder: both lists
    truncate to two blocks (the loop zips them); the first blocks see 16 patches per frame."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GradseamWarning)
        sizes = {"frames": FRAMES, "height": 64, "width": 64, "text_tokens": TEXT}
        check_bench_workload("latte", TINY, sizes, sequence=16)
