"""GLM-Image's decoder: a tiny deterministic model through the conformance kit (glyph and image tokens as
two streams of one block, the shared ``ff`` called once per stream), input variants (a batch of two at its
own timesteps and sizes on a non-square latent with one sample's prior tokens dropped, as classifier-free
guidance does; a padded glyph ``attention_mask``; the read pass of image-to-image over a filled KV cache),
interval chunks that chain both streams, each block's own cache layer (``per_block``), what recomputing a
block does to the cache in each way a condition pass can be run, and the presets at full size with their
real input builder."""

from __future__ import annotations

import inspect
from dataclasses import replace

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
from gradseam.run.links import PER_BLOCK
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_bench_workload,
    check_builtin_flag,
    check_strategy,
    preset_model,
    randn,
    record_regions,
    reduced_configs,
)

LAYERS, HEADS, HEAD_DIM = 4, 2, 8
GLYPH, GLYPH_DIM, SIDE, CODEBOOK = 6, 12, 4, 32  # glyph tokens and width, latent side (2x2 patches), prior codes
COND_TOKENS = 8  # a condition image of 4x8 latents: 2x4 patches

# 2 heads x 8 = 16 wide (the 2-D RoPE gives rows and columns half a head each), 4 blocks
TINY = dict(
    patch_size=2, in_channels=4, out_channels=4, num_layers=LAYERS, attention_head_dim=HEAD_DIM,
    num_attention_heads=HEADS, text_embed_dim=GLYPH_DIM, time_embed_dim=8, condition_dim=4,
    prior_vq_quantizer_codebook_size=CODEBOOK,
)


def glm_model(**config: object) -> torch.nn.Module:
    from diffusers import GlmImageTransformer2DModel

    return GlmImageTransformer2DModel(**{**TINY, **config})


def _kv_cache(mode: str | None = None):
    from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache

    cache = GlmImageKVCache(LAYERS)
    if mode is not None:
        cache.set_mode(mode)
    return cache


def glm_inputs(g: torch.Generator, batch: int = 1, height: int = SIDE, width: int = SIDE, glyph: int = GLYPH) -> dict:
    tokens = (height // 2) * (width // 2)
    return {
        "hidden_states": randn(g, batch, 4, height, width, grad=True),
        "encoder_hidden_states": randn(g, batch, glyph, GLYPH_DIM, grad=True),
        "prior_token_id": torch.randint(0, CODEBOOK, (batch, tokens), generator=g),
        "prior_token_drop": torch.zeros(batch, tokens, dtype=torch.bool),
        "timestep": torch.full((batch,), 999.0),
        "target_size": torch.tensor([[8.0 * height, 8.0 * width]]).repeat(batch, 1),
        "crop_coords": torch.zeros(batch, 2),
    }


def glm_batch_inputs(g: torch.Generator) -> dict:
    # two samples at their own timesteps and target sizes on a 4x8 latent (a non-square RoPE grid); the second
    # sample's prior tokens dropped (the unconditional branch of classifier-free guidance)
    inputs = glm_inputs(g, batch=2, width=2 * SIDE)
    inputs["prior_token_drop"][1] = True
    inputs["timestep"] = torch.tensor([120.0, 870.0])
    inputs["target_size"] = torch.tensor([[32.0, 64.0], [48.0, 96.0]])
    inputs["crop_coords"] = torch.tensor([[0.0, 0.0], [8.0, 16.0]])
    return inputs


def glm_mask_inputs(g: torch.Generator) -> dict:
    # the pipeline left-pads the glyph states of a batch with zeros; a trainer can mask the padding
    mask = torch.ones(2, GLYPH)
    mask[1, :2] = 0
    return {**glm_inputs(g, batch=2), "attention_mask": mask}


def _filled_cache(g: torch.Generator, mode: str = "read"):
    """A cache as a condition pass leaves it: per layer, the K/V of one condition image."""
    cache = _kv_cache("write")
    for layer in cache.caches:
        layer.store(randn(g, 1, COND_TOKENS, HEADS, HEAD_DIM), randn(g, 1, COND_TOKENS, HEADS, HEAD_DIM))
    cache.set_mode(mode)
    return cache


def glm_read_inputs(g: torch.Generator) -> dict:
    # image-to-image: the denoising pass reads each layer's cached condition K/V in front of its own
    return {**glm_inputs(g), "kv_caches": _filled_cache(g)}


def condition_inputs(g: torch.Generator) -> dict:
    """The pipeline's condition pass: one condition image, no glyph tokens, timestep 0, nothing dropped."""
    tokens = COND_TOKENS
    ids = torch.randint(0, CODEBOOK, (tokens,), generator=g)
    return {
        "hidden_states": randn(g, 1, 4, SIDE, 2 * SIDE),
        "encoder_hidden_states": torch.zeros(1, 0, GLYPH_DIM),
        "prior_token_id": ids,
        "prior_token_drop": torch.zeros_like(ids, dtype=torch.bool),
        "timestep": torch.zeros(1),
        "target_size": torch.tensor([[32.0, 64.0]]),
        "crop_coords": torch.zeros(1, 2),
    }


GLM = Case("glm-image", glm_model, glm_inputs)
GLM_BATCH = Case("glm-image-batch", glm_model, glm_batch_inputs)
GLM_MASK = Case("glm-image-mask", glm_model, glm_mask_inputs)
GLM_READ = Case("glm-image-kv-read", glm_model, glm_read_inputs)
T2I_CASES = [GLM, GLM_BATCH, GLM_MASK]

CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}


# -- The conformance kit ------------------------------------------------------------------------
class TestGlmImage(ConformanceSuite):
    case = GLM


class TestGlmImageBatch(ConformanceSuite):
    case = GLM_BATCH
    reduced = True


class TestGlmImageMask(ConformanceSuite):
    case = GLM_MASK
    reduced = True


class TestGlmImageKVRead(ConformanceSuite):
    # with a cache the chunks compute block by block on purpose (per_block): the reduced rows
    case = GLM_READ
    configs = reduced_configs()
    reduced_offload = True
    whole_regions = False


# -- Chunks, the loop's arguments, the seam -------------------------------------------------------
@pytest.mark.parametrize("case", T2I_CASES, ids=lambda c: c.name)
def test_interval_chunks_chain_both_streams(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back): both chunks must run whole, and the glyph
    # stream, which leaves the last block unused, must still get its gradient through them.
    report = check_chunks_run_whole(case, CHUNKED, ["transformer_blocks[0, 1]", "transformer_blocks[2, 3]"])
    assert report.saved_ratio < 1
    assert report.patched.input_grads["encoder_hidden_states"].abs().sum() > 0


@pytest.mark.parametrize("case", [GLM_MASK, GLM_READ], ids=lambda c: c.name)
def test_the_loop_hands_every_block_the_same_conditioning_and_its_own_cache(case: Case) -> None:
    # What the carry and per_block rely on: temb, the RoPE tuple, the mask and attention_kwargs are one object
    # each for every block; the streams are what the previous block returned; kv_cache is each block's layer.
    model = case.fresh()
    seen, returned = record_block_calls(model.transformer_blocks)
    inputs = case.inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(**inputs)
    assert len(seen) == LAYERS
    for name in ("temb", "image_rotary_emb", "attention_mask", "attention_kwargs"):
        assert all(kw[name] is seen[0][name] for kw in seen), name
    assert (seen[0]["attention_mask"] is None) == (case is GLM_READ)
    caches = inputs["kv_caches"].caches if case is GLM_READ else [None] * LAYERS
    assert [kw["kv_cache"] for kw in seen] == caches
    for before, kw in zip(returned, seen[1:]):
        assert kw["hidden_states"] is before[0] and kw["encoder_hidden_states"] is before[1]


def test_variant_inputs_change_the_output() -> None:
    # The variants exercise their paths: the glyph mask, the dropped prior tokens, the cached condition.
    assert not torch.equal(sample_output(GLM_MASK), sample_output(GLM_MASK, attention_mask=None))
    batch = sample_output(GLM_BATCH)
    assert not torch.equal(batch, sample_output(GLM_BATCH, prior_token_drop=torch.zeros(2, 8, dtype=torch.bool)))
    assert not torch.equal(batch, sample_output(GLM_BATCH, timestep=torch.tensor([120.0, 120.0])))
    read = sample_output(GLM_READ)
    assert not torch.equal(read, sample_output(GLM_READ, kv_caches=None))
    skip = _filled_cache(torch.Generator().manual_seed(5), mode="skip")
    assert torch.equal(sample_output(GLM_READ, kv_caches=skip), sample_output(GLM_READ, kv_caches=None))


def test_ff_is_one_region_per_stream() -> None:
    # The seam's module is called twice per block (image stream, then glyph stream): each call is a region
    # of its own, both run, and the -ffn step is exact.
    model = GLM.fresh()
    family = family_for(model)
    assert family.name == "glm-image"
    the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.blocks, r.seam) for r in the_plan.regions] == [((i,), ("ff",)) for i in range(LAYERS)]
    report = check_strategy(GLM, FFN, whole=True)
    ff = [r for r in report.regions if r.shape == "ffn"]
    assert len(ff) == LAYERS and all(r.calls == (2,) and r.runs == 2 and r.whole for r in ff), ff


def test_diffusers_own_checkpointing_flag() -> None:
    check_builtin_flag(GLM, CHUNKED)


# -- Image-to-image: the KV cache under recomputation ---------------------------------------------
_EDIT_CONFIGS = {
    "torch": {"gradient_checkpointing": True},
    "interval2": CHUNKED,
    "unsloth": {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"},
    "torch-ffn": FFN,
}


def _edit_step(model: torch.nn.Module, *, condition_grad: bool, mode_at_backward: str = "read") -> tuple:
    """An image-to-image training step as a trainer writes it after the pipeline: the condition pass writes
    every layer's cache (with or without gradients), then the denoising pass reads it with gradients.
    Returns the outputs, the parameter gradients and the cache's K lengths per layer after backward."""
    g = torch.Generator().manual_seed(3)
    cache = _kv_cache("write")
    condition = condition_inputs(g)
    with torch.set_grad_enabled(condition_grad):
        model(**condition, kv_caches=cache)
    cache.next_sample()
    cache.set_mode("read")
    out = model(**glm_inputs(g), kv_caches=cache).sample
    cache.set_mode(mode_at_backward)
    model.zero_grad(set_to_none=True)
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, [[k.shape[1] for k in layer.k_caches] for layer in cache.caches]


def _patched(model: torch.nn.Module, config: dict, **step: object) -> tuple:
    from gradseam.offload import cpu_test_mode

    with cpu_test_mode(), gradseam.patch(model, config) as handle, record_regions(handle) as regions:
        result = _edit_step(model, **step)
    return (*result, regions)


@pytest.mark.parametrize("config", list(_EDIT_CONFIGS.values()), ids=list(_EDIT_CONFIGS))
def test_edit_step_with_a_condition_pass_without_grad_is_exact(config: dict) -> None:
    # The supported way (the pipeline's): the condition pass writes under no_grad, where gradseam runs no
    # region; the denoising pass recomputes each block in read mode over the same cached K/V.
    model = GLM.fresh()
    out, grads, lengths = _edit_step(model, condition_grad=False)
    got, got_grads, got_lengths, regions = _patched(model, config, condition_grad=False)
    assert torch.equal(out, got) and grads.keys() == got_grads.keys()
    assert all(torch.equal(grads[k], got_grads[k]) for k in grads)
    assert lengths == got_lengths == [[COND_TOKENS]] * LAYERS
    for r in regions:
        if r.shape == "chunk":  # every chunk call refused up front: the blocks were handed their own layers
            assert r.fallbacks == {PER_BLOCK: 1} and r.runs == 2, r


@pytest.mark.parametrize("config", list(_EDIT_CONFIGS.values()), ids=list(_EDIT_CONFIGS))
def test_a_condition_pass_with_grad_trains_exactly_though_the_mode_changed_before_backward(config: dict) -> None:
    """Training through the cache: by backward the cache is in read mode, and a recompute in that mode would
    attend over more keys than the condition pass did (diffusers' own flag raises CheckpointError there). gradseam
    recomputes each block with the plain values its state object held when its forward began (the mode "write",
    the sample index), and puts back what the recompute stored: exact, cache included."""
    from torch.utils.checkpoint import CheckpointError

    model = GLM.fresh()
    out, grads, lengths = _edit_step(model, condition_grad=True)
    got, got_grads, got_lengths, _ = _patched(model, config, condition_grad=True)
    assert torch.equal(out, got) and grads.keys() == got_grads.keys()
    assert all(torch.equal(grads[k], got_grads[k]) for k in grads)
    assert lengths == got_lengths == [[COND_TOKENS]] * LAYERS  # the condition stored once, as unpatched
    model.enable_gradient_checkpointing()
    with pytest.raises(CheckpointError, match="different metadata"):
        _edit_step(model, condition_grad=True)


def test_a_condition_pass_with_grad_trains_exactly_through_the_ffn_seams() -> None:
    # -ffn regions never recompute attn1, so the cache is never touched again (the empty glyph stream of the
    # condition pass runs through its ff region too)
    model = GLM.fresh()
    out, grads, lengths = _edit_step(model, condition_grad=True)
    got, got_grads, got_lengths, regions = _patched(model, FFN, condition_grad=True)
    assert torch.equal(out, got) and all(torch.equal(grads[k], got_grads[k]) for k in grads)
    assert lengths == got_lengths == [[COND_TOKENS]] * LAYERS
    assert all(r.runs == 4 for r in regions if r.shape == "ffn")  # two passes, two streams


def _condition_step(model: torch.nn.Module) -> tuple:
    """A loss on the condition pass itself, the cache left in write mode through backward."""
    cache = _kv_cache("write")
    out = model(**condition_inputs(torch.Generator().manual_seed(3)), kv_caches=cache).sample
    model.zero_grad(set_to_none=True)
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, [[k.shape[1] for k in layer.k_caches] for layer in cache.caches]


def test_a_block_recomputed_in_write_mode_leaves_the_cache_as_the_unpatched_model_does() -> None:
    """A block recomputed while its cache is still in write mode stores its K/V again; gradseam puts back what a
    recompute does to a state object (gradseam.run.chains), so the cache holds the condition once, as unpatched
    (a read-mode block recomputed so raises, as above). Outputs and gradients exact too."""
    model = GLM.fresh()
    out, grads, lengths = _condition_step(model)
    with gradseam.patch(model, {"gradient_checkpointing": True}):
        got, got_grads, got_lengths = _condition_step(model)
    assert torch.equal(out, got) and all(torch.equal(grads[k], got_grads[k]) for k in grads)
    assert lengths == got_lengths == [[COND_TOKENS]] * LAYERS


def test_without_per_block_a_chunk_would_write_into_the_first_blocks_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    # A condition pass with gradients under interval 2, right after forward: the declaration keeps every
    # layer's cache the unpatched model's; without it, the chunk's later block appends into its head's layer.
    import gradseam.patcher as patcher

    def written(model: torch.nn.Module) -> list[int]:
        cache = _kv_cache("write")
        model(**condition_inputs(torch.Generator().manual_seed(3)), kv_caches=cache)
        return [layer.k_caches[0].shape[1] for layer in cache.caches]

    model = GLM.fresh()
    assert written(model) == [COND_TOKENS] * LAYERS
    with gradseam.patch(model, CHUNKED):
        assert written(model) == [COND_TOKENS] * LAYERS
    family = family_for(model)
    blind = replace(family, block_lists=tuple(replace(bl, per_block=()) for bl in family.block_lists))
    monkeypatch.setattr(patcher, "family_for", lambda m: blind)
    with gradseam.patch(model, CHUNKED):
        assert written(model) == [2 * COND_TOKENS, COND_TOKENS, 2 * COND_TOKENS, COND_TOKENS]


# -- Presets: the real-size config builds (on the meta device) and plans as documented -------------
PRESETS = {"t2i-1024": (128, 0), "t2i-2048": (256, 0), "edit-1024": (128, 1)}  # latent side, condition images


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_plan_at_full_size(name: str) -> None:
    from diffusers import GlmImageTransformer2DModel

    family, preset, model = preset_model("glm-image", name)
    assert set(family.presets) == set(PRESETS) and family_for(model) is family
    params = set(inspect.signature(GlmImageTransformer2DModel.__init__).parameters) - {"self"}
    assert set(preset.config) == params  # every constructor argument, spelled out
    assert 6.8e9 < sum(p.numel() for p in model.parameters()) < 7.4e9
    block = model.transformer_blocks[0]
    assert (len(model.transformer_blocks), block.attn1.heads, block.ff.net[0].proj.out_features) == (30, 32, 16384)
    assert_plans_cover_every_block(model, family, 30, (
        ({"gradient_checkpointing": True}, 30), (CHUNKED, 15), (FFN, 30)
    ))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_inputs_have_the_pipelines_sizes(name: str) -> None:
    _, preset, model = preset_model("glm-image", name)
    side, images = PRESETS[name]
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    tokens = (side // 2) ** 2
    assert x["hidden_states"].shape == (1, 16, side, side) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 256, 1472)
    assert x["prior_token_id"].shape == x["prior_token_drop"].shape == (1, tokens)
    assert x["target_size"].shape == x["crop_coords"].shape == (1, 2) and x["timestep"].shape == (1,)
    if images:
        cache = x["kv_caches"]
        assert len(cache.caches) == 30 and all(layer.mode == "read" for layer in cache.caches)
        assert cache.caches[0].k_caches[0].shape == (1, tokens, 32, 128)
    else:
        assert "kv_caches" not in x
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 1024, **preset.inputs)
    assert fewer["hidden_states"].shape == (1, 16, 64, 64) and fewer["prior_token_id"].shape == (1, 1024)


@pytest.mark.parametrize("images", [0, 1])
def test_preset_input_builder_runs_the_model(images: int) -> None:
    family = gradseam.registry.REGISTRY.get("glm-image")
    model = GLM.fresh()
    x = family.presets["edit-1024"].make_inputs(model, "cpu", torch.float32, None, height=32, width=64,
                                                glyph_tokens=GLYPH, condition_images=images)
    assert x["target_size"].tolist() == [[32.0, 64.0]]
    out = model(**x).sample
    assert out.shape == (1, 4, SIDE, 2 * SIDE)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


@pytest.mark.parametrize("preset", ["t2i-1024", "edit-1024"])
def test_bench_workload_truncates_steps_and_patches_exactly(preset: str) -> None:
    """`gradseam bench --family glm-image --layers 2` on a tiny preset with the real input builder."""
    sizes = {"height": 32, "width": 32, "glyph_tokens": GLYPH, "condition_images": int(preset == "edit-1024")}
    # bench reads the image stream's length: the glyph tokens join the sequence inside attn1
    check_bench_workload("glm-image", TINY, sizes, preset=preset, sequence=SIDE * SIDE // 4)
