"""Qwen-Image 2.1: a tiny deterministic model through the conformance kit, its optional inputs
(condition images, text masks, causal_condition off, the prefix KV cache in extract and cached
mode), the per-block layer cache that interval chunks must not share, and the presets at full size."""

from __future__ import annotations

import pytest
import torch
from family_checks import assert_plans_cover_every_block

import gradseam
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.run.links import PER_BLOCK
from gradseam.testing import (
    Case,
    ConformanceSuite,
    Step,
    assert_same_step,
    cpu_configs,
    pick,
    randn,
    record_regions,
    reduced_configs,
    run_step,
)
from gradseam.tools.named_strategies import BACKEND, INTERVAL, STRIDE

LAYERS, HEADS, HEAD_DIM, CONTEXT = 4, 2, 8, 16
GRID = 4  # every image is GRID x GRID latent tokens: GRID * GRID // 4 vision slots of 2x2 tokens
LEAD, TAIL = 2, 4  # text tokens before each condition image, and after the last one


def qwen21_model(**overrides):
    from diffusers import QwenImage21Transformer2DModel

    config = dict(
        patch_size=1, in_channels=4, out_channels=4, num_layers=LAYERS, attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS, context_in_dim=CONTEXT, mlp_ratio=3, axes_dims_rope=(2, 2, 4),
    )
    return QwenImage21Transformer2DModel(**{**config, **overrides})


def _layout(images: int) -> list[bool]:
    """The Qwen3-VL sequence as the pipeline lays it out: a few text tokens, then each condition
    image's vision slots, the rest of the prompt after the last one."""
    slots = GRID * GRID // 4
    return [flag for _ in range(images) for flag in [False] * LEAD + [True] * slots] + [False] * TAIL


def qwen21_inputs(g: torch.Generator, images: int = 0) -> dict:
    layout = _layout(images)
    return {
        "hidden_states": randn(g, 1, (images + 1) * GRID * GRID, 4, grad=True),
        "encoder_hidden_states": randn(g, 1, len(layout), CONTEXT, grad=True),
        "timestep": torch.tensor([0.6]),
        "img_shapes": [[(1, GRID, GRID)] * (images + 1)],
        "img_mask": torch.tensor([layout + [True] * (GRID * GRID // 4)]),
    }


def _prefix_tokens(images: int) -> int:
    """Text and condition-image tokens of the joint sequence: what the KV cache holds."""
    return LEAD * images + TAIL + images * GRID * GRID


def qwen21_edit_inputs(g: torch.Generator) -> dict:
    return qwen21_inputs(g, images=1)


def qwen21_masked_inputs(g: torch.Generator) -> dict:
    # two condition images and a right-padded prompt (the mask spans the Qwen3-VL sequence)
    inputs = qwen21_inputs(g, images=2)
    mask = torch.ones(inputs["encoder_hidden_states"].shape[:2], dtype=torch.bool)
    mask[:, -2:] = False
    return {**inputs, "encoder_hidden_states_mask": mask}


def _kv_cache():
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    return QwenImage21KVCache(LAYERS)


def qwen21_extract_inputs(g: torch.Generator) -> dict:
    # the first denoising step with use_kv_cache: prefill a fresh cache while denoising
    return {**qwen21_edit_inputs(g), "kv_cache": _kv_cache(), "kv_cache_mode": "extract"}


def qwen21_cached_inputs(g: torch.Generator) -> dict:
    # a later step: only the target's tokens run, attending to each layer's cached prefix K/V
    inputs = qwen21_edit_inputs(g)
    cache = _kv_cache()
    for layer in cache.layer_caches:
        layer.store(randn(g, 1, _prefix_tokens(1), HEADS, HEAD_DIM), randn(g, 1, _prefix_tokens(1), HEADS, HEAD_DIM))
    return {**inputs, "kv_cache": cache, "kv_cache_mode": "cached"}


QWEN21 = Case("qwenimage21", qwen21_model, qwen21_inputs)
QWEN21_EDIT = Case("qwenimage21-edit", qwen21_model, qwen21_edit_inputs)
QWEN21_MASKED = Case("qwenimage21-masked", qwen21_model, qwen21_masked_inputs)
QWEN21_UNCAUSAL = Case("qwenimage21-no-causal-condition", lambda: qwen21_model(causal_condition=False),
                       qwen21_edit_inputs)
QWEN21_EXTRACT = Case("qwenimage21-kv-extract", qwen21_model, qwen21_extract_inputs)
QWEN21_CACHED = Case("qwenimage21-kv-cached", qwen21_model, qwen21_cached_inputs)


# -- The conformance kit ------------------------------------------------------------------------
# With a KV cache the chunks compute block by block on purpose: the reduced rows, and chunks of two
# with a stride on top.
KV_CPU = [*reduced_configs(), *pick(cpu_configs(), {BACKEND: "torch", INTERVAL: 2, STRIDE: 4})]


class TestQwenImage21(ConformanceSuite):
    case = QWEN21


class TestQwenImage21Edit(ConformanceSuite):
    case = QWEN21_EDIT
    reduced = True


class TestQwenImage21Masked(ConformanceSuite):
    case = QWEN21_MASKED
    reduced = True


class TestQwenImage21WithoutCausalCondition(ConformanceSuite):
    case = QWEN21_UNCAUSAL
    reduced = True


class TestQwenImage21KVExtract(ConformanceSuite):
    case = QWEN21_EXTRACT
    configs = KV_CPU
    reduced_offload = True
    whole_regions = False  # chunks compute block by block while a cache is passed (per_block)


class TestQwenImage21KVCached(ConformanceSuite):
    case = QWEN21_CACHED
    configs = KV_CPU
    reduced_offload = True
    whole_regions = False


# -- The optional inputs really change what the blocks compute ---------------------------------

def _target(model: torch.nn.Module, case: Case) -> torch.Tensor:
    """The target image's output tokens (the last ones, as the pipeline reads them)."""
    with torch.no_grad():
        return case.output(model(**case.inputs(torch.Generator().manual_seed(1))))[:, -GRID * GRID:]


def test_condition_images_and_masks_reach_the_target() -> None:
    model = QWEN21.fresh()
    plain = _target(model, QWEN21)
    edit = _target(model, QWEN21_EDIT)
    masked = _target(model, QWEN21_MASKED)
    unmasked = _target(model, Case("unmasked", qwen21_model, lambda g: qwen21_inputs(g, images=2)))
    assert not torch.equal(plain, edit)
    assert not torch.equal(masked, unmasked)


def test_each_block_gets_its_own_layer_cache() -> None:
    # What per_block=("layer_cache",) guards: a different state object per block, written in extract mode.
    model = QWEN21_EXTRACT.fresh()
    seen = []
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(lambda _m, _a, kwargs: seen.append(kwargs["layer_cache"]), with_kwargs=True)
    inputs = qwen21_extract_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(**inputs)
    assert seen == inputs["kv_cache"].layer_caches
    assert all(layer.k.shape[1] == _prefix_tokens(1) for layer in seen)


# -- The KV cache with interval chunks: outputs, gradients and the cache itself exact ---------------
_KV_CONFIGS = {
    "interval2": {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2},
    "interval2+stride4": {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2,
                          "gradient_checkpointing_segment_stride": 4},
    "unsloth+interval2": {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth",
                          "gradient_checkpointing_interval": 2},
    "keep-attention+interval2": {"gradient_checkpointing": True, "gradient_checkpointing_keep_attention": True,
                                 "gradient_checkpointing_interval": 2},
}


def _step_keeping_cache(model: torch.nn.Module, case: Case, caches: list) -> Step:
    """One training step; the inputs' cache is kept (it is filled in place, and returned by no one)."""
    def build(g: torch.Generator) -> dict:
        inputs = case.inputs(g)
        caches.append(inputs["kv_cache"])
        return inputs

    return run_step(model, Case(case.name, case.build, build, case.output))


def _assert_same_cache(expected, got) -> None:
    for i, (a, b) in enumerate(zip(expected.layer_caches, got.layer_caches, strict=True)):
        assert a.k is not None and torch.equal(a.k, b.k) and torch.equal(a.v, b.v), f"layer {i} of the KV cache differs"


def _patched_kv_step(model, case: Case, config: dict, caches: list):
    from gradseam.offload import cpu_test_mode

    with cpu_test_mode():  # lets the unsloth rows run on the CPU, through host buffers
        handle = gradseam.patch(model, config)
        try:
            with record_regions(handle) as regions:
                step = _step_keeping_cache(model, case, caches)
            return step, regions, str(handle.summary())
        finally:
            handle.remove()


@pytest.mark.parametrize("config", list(_KV_CONFIGS.values()), ids=list(_KV_CONFIGS))
def test_extract_mode_with_interval_chunks_fills_the_cache_exactly(config: dict) -> None:
    model = QWEN21_EXTRACT.fresh()
    caches: list = []
    reference = _step_keeping_cache(model, QWEN21_EXTRACT, caches)
    patched, regions, summary = _patched_kv_step(model, QWEN21_EXTRACT, config, caches)
    assert_same_step(reference, patched, what="extract mode, interval 2")
    _assert_same_cache(*caches)
    chunks = [r for r in regions if r.shape == "chunk"]
    assert chunks, "the config formed no chunk"
    for r in chunks:  # every chunk call was refused up front, and each block ran once as its own region
        assert r.fallbacks == {PER_BLOCK: 1} and r.calls == (1, 1) and r.runs == 2, r
    assert PER_BLOCK in summary and "ran as one chunk 0 of 1 calls" in summary


def test_cached_mode_with_interval_chunks_reads_each_blocks_cache() -> None:
    # The pipeline's sequence: prefill (extract) on the first step, decode (cached) on the next one.
    model = QWEN21_EXTRACT.fresh()
    prefill = qwen21_extract_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(**prefill, return_dict=False)[0]

    def decode(g: torch.Generator) -> dict:
        return {**qwen21_edit_inputs(g), "kv_cache": prefill["kv_cache"], "kv_cache_mode": "cached"}

    case = Case("qwenimage21-decode", qwen21_model, decode)
    expected = run_step(model, case)
    assert expected.outputs[0].shape[1] == GRID * GRID  # only the target's tokens ran
    handle = gradseam.patch(model, _KV_CONFIGS["interval2"])
    try:
        with record_regions(handle) as regions:
            got = run_step(model, case)
    finally:
        handle.remove()
    assert_same_step(expected, got, what="cached mode, interval 2")
    chunks = [r for r in regions if r.shape == "chunk"]
    assert len(chunks) == 2 and all(r.fallbacks == {PER_BLOCK: 1} for r in chunks)
    # each block read its own layer's prefix: the decode reproduces the prefill's target tokens
    # (up to rounding: the two attend in a different layout)
    torch.testing.assert_close(got.outputs[0], full[:, -GRID * GRID:], rtol=1e-5, atol=1e-5)


def test_without_per_block_a_chunk_would_fill_the_wrong_cache(monkeypatch) -> None:
    """The declaration is what keeps the cache right: the same chunks without it still give exact
    outputs (the later blocks fall back), but leave the later blocks' K/V in the first block's cache."""
    from dataclasses import replace

    import gradseam.patcher as patcher

    model = QWEN21_EXTRACT.fresh()
    family = family_for(model)
    blind = replace(family, block_lists=tuple(replace(bl, per_block=()) for bl in family.block_lists))
    monkeypatch.setattr(patcher, "family_for", lambda m: blind)
    caches: list = []
    reference = _step_keeping_cache(model, QWEN21_EXTRACT, caches)
    patched, regions, _ = _patched_kv_step(model, QWEN21_EXTRACT, _KV_CONFIGS["interval2"], caches)
    assert_same_step(reference, patched, what="extract mode, no per_block")
    expected, got = caches
    assert not torch.equal(expected.layer_caches[0].k, got.layer_caches[0].k)  # the chunk's head, overwritten
    assert torch.equal(expected.layer_caches[1].k, got.layer_caches[1].k)  # the follower, computed alone
    assert all(PER_BLOCK not in r.fallbacks for r in regions)


def test_a_per_block_name_the_block_does_not_take_is_refused() -> None:
    from dataclasses import replace

    from gradseam.errors import UnsupportedModelError

    model = QWEN21.fresh()
    family = family_for(model)
    wrong = replace(family, block_lists=(replace(family.block_lists[0], per_block=("kv_layer",)),))
    config = gradseam.CheckpointConfig.coerce(_KV_CONFIGS["interval2"])
    with pytest.raises(UnsupportedModelError, match="declares per_block 'kv_layer', but QwenImage21TransformerBlock"):
        plan(model, wrong, config)
    plan(model, wrong, gradseam.CheckpointConfig.coerce({"gradient_checkpointing": True}))  # no chunk: not read


# -- Presets: the real-size config builds (on the meta device) and plans as documented -----------
def test_presets_plan_at_full_size() -> None:
    from diffusers import QwenImage21Transformer2DModel

    with torch.device("meta"):
        model = QwenImage21Transformer2DModel()
    family = family_for(model)
    assert family.name == "qwenimage21" and set(family.presets) == {"1024", "edit-1024"}
    for preset in family.presets.values():
        assert preset.config == {}
        assert_plans_cover_every_block(model, family, 32, (
            ({"gradient_checkpointing": True}, 32),
            ({"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}, 16),
            ({"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}, 32)
        ))


def test_preset_inputs_are_the_pipelines_layout() -> None:
    from diffusers import QwenImage21Transformer2DModel

    family = next(f for f in gradseam.families() if f.name == "qwenimage21")
    with torch.device("meta"):
        model = QwenImage21Transformer2DModel()
    t2i = family.presets["1024"]
    inputs = t2i.make_inputs(model, "meta", torch.bfloat16, None, **t2i.inputs)
    assert inputs["hidden_states"].shape == (1, 4096, 64) and inputs["hidden_states"].requires_grad
    assert inputs["encoder_hidden_states"].shape == (1, 512, 4096)
    assert inputs["img_mask"].shape == (1, 512 + 4096 // 4) and inputs["img_shapes"] == [[(1, 64, 64)]]
    edit = family.presets["edit-1024"]
    inputs = edit.make_inputs(model, "meta", torch.bfloat16, None, **edit.inputs)
    assert inputs["hidden_states"].shape == (1, 2 * 4096, 64)
    assert inputs["encoder_hidden_states"].shape == (1, 512 + 1024, 4096)  # the condition's vision slots
    small = edit.make_inputs(model, "meta", torch.bfloat16, 1024, **edit.inputs)
    assert small["hidden_states"].shape == (1, 2 * 1024, 64)


@pytest.mark.parametrize("images", [0, 1, 2])
def test_preset_input_builder_runs_the_model(images: int) -> None:
    # the builder's sequence layout must be one the model accepts (it checks image tokens against img_shapes)
    family = next(f for f in gradseam.families() if f.name == "qwenimage21")
    model = QWEN21.fresh()
    inputs = family.presets["edit-1024"].make_inputs(model, "cpu", torch.float32, 36, text_tokens=9, images=images)
    out = model(**inputs, return_dict=False)[0]
    assert out.shape == (1, 9 + (images + 1) * 36, 4)
    out.square().mean().backward()
    assert inputs["hidden_states"].grad is not None
