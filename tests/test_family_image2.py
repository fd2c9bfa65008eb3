"""Flux 2 and Qwen-Image: tiny deterministic models through the conformance kit, their optional
inputs (guidance-free Klein, text masks, Edit-2511's zero-timestep reference tokens, the Layered
variant), interval chunks that really chain, and the presets planned at full size."""

from __future__ import annotations

import pytest
import torch
from family_checks import assert_chunks_chain_without_fallback

import gradseam
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import Case, ConformanceSuite, randn, run_step

# -- Flux 2 -------------------------------------------------------------------------------------
FLUX2_GRID, FLUX2_TEXT = 4, 6


def flux2_model(**overrides):
    from diffusers import Flux2Transformer2DModel

    config = dict(
        in_channels=4, num_layers=2, num_single_layers=4, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, timestep_guidance_channels=16, axes_dims_rope=(2, 2, 2, 2),
    )
    return Flux2Transformer2DModel(**{**config, **overrides})


def flux2_inputs(g: torch.Generator) -> dict:
    from gradseam.adapters.flux2 import position_ids

    img_ids, txt_ids = position_ids(FLUX2_TEXT, FLUX2_GRID * FLUX2_GRID, "cpu")
    return {
        "hidden_states": randn(g, 1, FLUX2_GRID * FLUX2_GRID, 4, grad=True),
        "encoder_hidden_states": randn(g, 1, FLUX2_TEXT, 16, grad=True),
        "timestep": torch.tensor([0.6]),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
        "guidance": torch.tensor([3.5]),
    }


def flux2_klein_inputs(g: torch.Generator) -> dict:
    # Klein: no guidance embedding; ids batched (B, S, 4) as the pipeline passes them
    inputs = flux2_inputs(g)
    del inputs["guidance"]
    return {**inputs, "img_ids": inputs["img_ids"][None], "txt_ids": inputs["txt_ids"][None]}


FLUX2 = Case("flux2", flux2_model, flux2_inputs)
FLUX2_KLEIN = Case("flux2-klein", lambda: flux2_model(guidance_embeds=False), flux2_klein_inputs)


# -- Qwen-Image ---------------------------------------------------------------------------------
QWEN_GRID, QWEN_TEXT = 4, 6


def qwen_model(**config):
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=8, out_channels=2, num_layers=4, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, axes_dims_rope=(2, 2, 4), **config,
    )


def qwen_inputs(g: torch.Generator, images: int = 1) -> dict:
    n = QWEN_GRID * QWEN_GRID
    return {
        "hidden_states": randn(g, 1, images * n, 8, grad=True),
        "encoder_hidden_states": randn(g, 1, QWEN_TEXT, 16, grad=True),
        "timestep": torch.tensor([0.7]),
        "img_shapes": [[(1, QWEN_GRID, QWEN_GRID)] * images],
    }


def qwen_masked_inputs(g: torch.Generator) -> dict:
    mask = torch.ones(1, QWEN_TEXT, dtype=torch.bool)
    mask[:, -2:] = False
    return {**qwen_inputs(g), "encoder_hidden_states_mask": mask}


def qwen_edit_inputs(g: torch.Generator) -> dict:
    # Edit-2511: target + one reference image; zero_cond_t modulates the reference tokens with t=0
    return qwen_inputs(g, images=2)


def qwen_layered_inputs(g: torch.Generator) -> dict:
    # Layered: two output layers plus the condition image, an extra (RGB / RGBA) timestep condition
    return {**qwen_inputs(g, images=3), "additional_t_cond": torch.tensor([1])}


QWEN = Case("qwenimage", qwen_model, qwen_inputs)
QWEN_MASKED = Case("qwenimage-masked", qwen_model, qwen_masked_inputs)
QWEN_EDIT = Case("qwenimage-edit-2511", lambda: qwen_model(zero_cond_t=True), qwen_edit_inputs)
QWEN_LAYERED = Case(
    "qwenimage-layered", lambda: qwen_model(use_additional_t_cond=True, use_layer3d_rope=True), qwen_layered_inputs
)


# -- The conformance kit ------------------------------------------------------------------------
class TestFlux2(ConformanceSuite):
    case = FLUX2


class TestFlux2Klein(ConformanceSuite):
    case = FLUX2_KLEIN
    reduced = True


class TestQwenImage(ConformanceSuite):
    case = QWEN


class TestQwenImageMasked(ConformanceSuite):
    case = QWEN_MASKED
    reduced = True


class TestQwenImageEdit2511(ConformanceSuite):
    case = QWEN_EDIT
    reduced = True


class TestQwenImageLayered(ConformanceSuite):
    case = QWEN_LAYERED
    reduced = True


# -- The optional inputs really change what the blocks compute ---------------------------------

def _output(model: torch.nn.Module, case: Case) -> torch.Tensor:
    with torch.no_grad():
        return case.output(model(**case.inputs(torch.Generator().manual_seed(1))))[0]


def test_qwen_mask_reaches_the_blocks() -> None:
    model = QWEN_MASKED.fresh()
    assert not torch.equal(_output(model, QWEN_MASKED), _output(model, QWEN))


def test_qwen_edit_2511_modulates_reference_tokens_per_token() -> None:
    seen = []
    model = QWEN_EDIT.fresh()
    model.transformer_blocks[0].register_forward_pre_hook(
        lambda _m, _args, kwargs: seen.append(kwargs["modulate_index"]), with_kwargs=True
    )
    _output(model, QWEN_EDIT)
    n = QWEN_GRID * QWEN_GRID
    assert seen[0].tolist() == [[0] * n + [1] * n]


def test_flux2_single_block_seam_is_the_mlp_slice() -> None:
    # The SwiGLU gets exactly the MLP slice of the fused projection (2 x mlp_hidden wide)
    model = FLUX2.fresh()
    widths = []
    attn = model.single_transformer_blocks[0].attn
    attn.mlp_act_fn.register_forward_pre_hook(lambda _m, args: widths.append(args[0].shape[-1]))
    _output(model, FLUX2)
    assert widths == [attn.mlp_hidden_dim * attn.mlp_mult_factor]


# -- Interval chunks really chain (no fallback) ---------------------------------------------------
@pytest.mark.parametrize(
    ("case", "lists"),
    [
        (FLUX2, ("transformer_blocks", "single_transformer_blocks")),
        (FLUX2_KLEIN, ("transformer_blocks", "single_transformer_blocks")),
        (QWEN_MASKED, ("transformer_blocks",)),
        (QWEN_EDIT, ("transformer_blocks",)),
    ],
    ids=["flux2", "flux2-klein", "qwenimage-masked", "qwenimage-edit-2511"],
)
def test_interval_chunks_chain_without_fallback(case: Case, lists: tuple[str, ...]) -> None:
    assert_chunks_chain_without_fallback(case, lists)


def test_qwen_controlnet_residuals_make_chunks_fall_back_exactly() -> None:
    from gradseam.testing import assert_same_step

    def with_residuals(g: torch.Generator) -> dict:
        inputs = qwen_inputs(g)
        return {**inputs, "controlnet_block_samples": [randn(g, 1, QWEN_GRID * QWEN_GRID, 16) for _ in range(2)]}

    case = Case("qwenimage-controlnet", qwen_model, with_residuals)
    model = case.fresh()
    reference = run_step(model, case)
    handle = gradseam.patch(model, gradient_checkpointing=True, gradient_checkpointing_interval=2)
    try:
        assert_same_step(reference, run_step(model, case), what="controlnet residuals, interval 2")
        assert any(r.fallbacks for r in handle.regions() if r.shape == "chunk")
    finally:
        handle.remove()


# -- Presets: the real-size configs build (on the meta device) and plan as documented ------------
@pytest.mark.parametrize(
    ("model_name", "expected"),
    [
        ("Flux2Transformer2DModel", {"transformer_blocks": 8, "single_transformer_blocks": 48}),
        ("QwenImageTransformer2DModel", {"transformer_blocks": 60}),
    ],
)
def test_presets_plan_at_full_size(model_name: str, expected: dict[str, int]) -> None:
    import diffusers

    cls = getattr(diffusers, model_name)
    with torch.device("meta"):
        probe = cls()
    family = family_for(probe)
    assert family.presets
    for preset in family.presets.values():
        with torch.device("meta"):
            model = cls(**preset.config)
        for config in ({"gradient_checkpointing": True},
                       {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}):
            the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
            blocks: dict[str, set[int]] = {}
            for region in the_plan.regions:
                blocks.setdefault(region.list_path, set()).update(region.blocks)
            assert {path: len(found) for path, found in blocks.items()} == expected
            if config.get("gradient_checkpointing_backend") == "torch-ffn":  # one region per seam and block
                seams = sum(len(bc.ffn) * expected[path] for path, bc in _classes(model, family).items())
                assert len(the_plan.regions) == seams


def _classes(model, family) -> dict:
    """The declared block class of each block list's first block."""
    names = {bc.name: bc for bc in family.block_classes}
    found = {}
    for block_list in family.block_lists:
        block = model.get_submodule(block_list.path)[0]
        found[block_list.path] = names[f"{type(block).__module__}.{type(block).__qualname__}"]
    return found


@pytest.mark.parametrize("family_name", ["flux2", "qwenimage"])
def test_preset_inputs_build_on_meta(family_name: str) -> None:
    # make_inputs builds a real-size batch on the model's device without running the model
    import diffusers

    family = next(f for f in gradseam.families() if f.name == family_name)
    for preset in family.presets.values():
        cls = getattr(diffusers, family.models[0].rsplit(".", 1)[-1])
        with torch.device("meta"):
            model = cls(**preset.config)
        inputs = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
        assert inputs["hidden_states"].requires_grad
        assert inputs["hidden_states"].shape[1] >= preset.inputs["image_tokens"]
        small = preset.make_inputs(model, "meta", torch.bfloat16, 1024, **preset.inputs)
        assert small["hidden_states"].shape[1] < inputs["hidden_states"].shape[1]


# -- Flux 2 specifics -----------------------------------------------------------------------------
def test_flux2_single_block_seam_saves_on_its_own() -> None:
    # Single blocks only: whatever torch-ffn saves comes from the attn.mlp_act_fn seam, run whole.
    from gradseam.testing import check_strategy

    case = Case("flux2-single-only", lambda: flux2_model(num_layers=0), flux2_inputs)
    report = check_strategy(case, {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"},
                            whole=True)
    assert [r.shape for r in report.regions] == ["ffn"] * 4
    assert report.saved_ratio < 0.95


def _flux2_kv_model():
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2KVAttnProcessor,
        Flux2KVParallelSelfAttnProcessor,
    )

    torch.manual_seed(0)
    model = flux2_model()
    for block in model.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
    return model


def _flux2_cached_step(model, cache, config=None):
    handle = gradseam.patch(model, config) if config else None
    try:
        inputs = flux2_inputs(torch.Generator().manual_seed(1))
        out = model(**inputs, kv_cache=cache, kv_cache_mode="cached", return_dict=False)[0]
        out.square().sum().backward()
        return out.detach(), inputs["hidden_states"].grad
    finally:
        if handle is not None:
            handle.remove()


def _flux2_kv_cache(model):
    inputs = flux2_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(**inputs, kv_cache_mode="extract", num_ref_tokens=4, return_dict=False)[1]


def test_flux2_kv_cache_with_ffn_seams_is_exact() -> None:
    model = _flux2_kv_model()
    cache = _flux2_kv_cache(model)
    out, grad = _flux2_cached_step(model, cache)
    model.zero_grad()
    config = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}
    patched_out, patched_grad = _flux2_cached_step(model, cache, config)
    assert torch.equal(out, patched_out) and torch.equal(grad, patched_grad)


@pytest.mark.parametrize("config", [
    {"gradient_checkpointing": True},
    {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2},
    {"gradient_checkpointing": True, "gradient_checkpointing_keep_attention": True},
], ids=["torch", "interval2", "attention-kept"])
def test_flux2_kv_cache_with_block_recompute_is_exact(config) -> None:
    """Flux 2 rewrites the kv_cache entry of one shared kwargs dict before every block; a block
    recomputed in backward must still read its own cache (diffusers' own flag reads the last one)."""
    model = _flux2_kv_model()
    cache = _flux2_kv_cache(model)
    out, grad = _flux2_cached_step(model, cache)
    model.zero_grad()
    patched_out, patched_grad = _flux2_cached_step(model, cache, config)
    assert torch.equal(out, patched_out)
    assert torch.equal(grad, patched_grad)


# -- Flux 2's KV cache with interval chunks: each block fills its own layer -------------------------
_FLUX2_EXTRACT_CONFIGS = {
    "interval2": {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2},
    "interval2+stride4": {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2,
                          "gradient_checkpointing_segment_stride": 4},
}


def _flux2_extract_inputs(g: torch.Generator) -> dict:
    # the Klein KV pipeline's first step: the first 4 image tokens are the reference image's
    return {**flux2_inputs(g), "kv_cache_mode": "extract", "num_ref_tokens": 4, "return_dict": False}


FLUX2_EXTRACT = Case("flux2-kv-extract", _flux2_kv_model, _flux2_extract_inputs)


def _flux2_extract_step(model, config=None):
    """A training step in extract mode; returns the step, the cache it returned, its regions and summary."""
    from gradseam.testing import record_regions

    caches = []
    hook = model.register_forward_hook(lambda _m, _args, out: caches.append(out[1]))
    handle = None
    try:
        if config is None:
            return run_step(model, FLUX2_EXTRACT), caches[0], [], ""
        handle = gradseam.patch(model, config)
        with record_regions(handle) as regions:
            step = run_step(model, FLUX2_EXTRACT)
        return step, caches[0], regions, str(handle.summary())
    finally:
        hook.remove()
        if handle is not None:
            handle.remove()


def _flux2_layers(cache) -> list:
    return [*cache.double_block_caches, *cache.single_block_caches]


@pytest.mark.parametrize("config", list(_FLUX2_EXTRACT_CONFIGS.values()), ids=list(_FLUX2_EXTRACT_CONFIGS))
def test_flux2_kv_extract_with_interval_chunks_is_exact(config) -> None:
    """Chunks must not run their later blocks ahead with the first block's cache layer (they would
    store their K/V in it): with per_block declared, every layer of the returned cache is exact."""
    from gradseam.run.links import PER_BLOCK
    from gradseam.testing import assert_same_step

    model = _flux2_kv_model()
    reference, expected, _, _ = _flux2_extract_step(model)
    patched, got, regions, summary = _flux2_extract_step(model, config)
    assert_same_step(reference, patched, what="flux2 extract mode")
    layers = list(zip(_flux2_layers(expected), _flux2_layers(got), strict=True))
    assert len(layers) == 2 + 4
    for i, (a, b) in enumerate(layers):
        assert a.k_ref is not None and torch.equal(a.k_ref, b.k_ref) and torch.equal(a.v_ref, b.v_ref), f"layer {i}"
    chunks = [r for r in regions if r.shape == "chunk"]
    expected_chunks = 2 if config.get("gradient_checkpointing_segment_stride") else 3
    assert len(chunks) == expected_chunks
    for r in chunks:  # refused up front: each block computed once, as its own region
        assert r.fallbacks == {PER_BLOCK: 1} and r.calls == (1, 1) and r.runs == 2, r
    assert summary.count(f"1 call(s) fell back to one region per block because 1x {PER_BLOCK}") == expected_chunks


def test_flux2_kv_extract_needs_the_per_block_declaration(monkeypatch) -> None:
    # Without per_block the chunks still give exact outputs (their later blocks notice the swapped
    # cache and compute again), but each chunk's first layer ends up holding its second block's K/V.
    from dataclasses import replace

    import gradseam.patcher as patcher
    from gradseam.testing import assert_same_step

    model = _flux2_kv_model()
    family = family_for(model)
    blind = replace(family, block_lists=tuple(replace(bl, per_block=()) for bl in family.block_lists))
    monkeypatch.setattr(patcher, "family_for", lambda m: blind)
    reference, expected, _, _ = _flux2_extract_step(model)
    patched, got, _, _ = _flux2_extract_step(model, _FLUX2_EXTRACT_CONFIGS["interval2"])
    assert_same_step(reference, patched, what="flux2 extract mode, no per_block")
    same = [torch.equal(a.k_ref, b.k_ref) for a, b in zip(_flux2_layers(expected), _flux2_layers(got))]
    assert same == [False, True, False, True, False, True]  # the heads of the 3 chunks, overwritten


def test_flux2_chunks_run_whole_again_without_a_cache() -> None:
    # per_block only refuses calls that carry a cache: the next plain step chunks as usual
    model = _flux2_kv_model()
    handle = gradseam.patch(model, _FLUX2_EXTRACT_CONFIGS["interval2"])
    try:
        run_step(model, FLUX2_EXTRACT)
        run_step(model, Case("flux2-kv-plain", _flux2_kv_model, flux2_inputs))
        chunks = [r for r in handle.regions() if r.shape == "chunk"]
        assert chunks and all(r.chunk_calls == 1 and sum(r.fallbacks.values()) == 1 for r in chunks)
    finally:
        handle.remove()


def test_per_block_names_find_the_state_where_the_loop_puts_it() -> None:
    # BlockLink resolves a per_block name against the head's bound arguments: a parameter, dict keys
    # (Flux 2's kwargs dict, which may be None), a **kwargs bag, or an attribute of another object.
    from types import SimpleNamespace

    from gradseam.family import Carry
    from gradseam.run.links import PER_BLOCK, BlockLink, signature_of

    class Bagged(torch.nn.Module):
        def forward(self, hidden_states, **kwargs):
            return hidden_states

    block = FLUX2.fresh().transformer_blocks[0]

    def head(joint_attention_kwargs) -> dict:
        return signature_of(type(block)).bind(block, (None, None, None, None, None, joint_attention_kwargs), {})

    carry = Carry({"encoder_hidden_states": 0, "hidden_states": 1})
    link = BlockLink(carry, per_block=("joint_attention_kwargs.kv_cache",))
    state = object()
    assert link.holds_state(block, head({"kv_cache": state, "kv_cache_mode": "extract"})) == PER_BLOCK
    assert link.holds_state(block, head(SimpleNamespace(kv_cache=state))) == PER_BLOCK
    assert link.holds_state(block, head({"kv_cache": None, "kv_cache_mode": "extract"})) is None
    assert link.holds_state(block, head({"scale": 1.0})) is None
    assert link.holds_state(block, head(None)) is None
    assert BlockLink(carry).holds_state(block, head({"kv_cache": state})) is None  # nothing declared
    bagged, bind = Bagged(), signature_of(Bagged).bind
    link = BlockLink(Carry({"hidden_states": None}), per_block=("layer_cache",))
    assert link.holds_state(bagged, bind(bagged, (None,), {"layer_cache": state})) == PER_BLOCK
    assert link.holds_state(bagged, bind(bagged, (None,), {})) is None
