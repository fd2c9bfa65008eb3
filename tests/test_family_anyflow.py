"""AnyFlow (AnyFlowTransformer3DModel, family ``anyflow``; AnyFlowFARTransformer3DModel, ``anyflow-far``).

The bidirectional model runs the conformance kit's whole matrix on a tiny instance; a batch of two
samples (per-frame source and target times, a clean context frame at source time 0, as the pipeline's
video-to-video conditioning passes it) runs the reduced one. Then the loop's shared
arguments, the FFN seam, diffusers' own checkpointing flag and the presets.

The FAR model attends through flex attention, which the kit cannot run its checks through: its
kernel locator is a dispatch mode without a rule for the ``flex_attention`` higher-order op, and torch
refuses flex attention's backward on the CPU by a device check (lifted here: the unfused eager path is
plain autograd, the same for the unpatched and the patched model). Eager flex attention also costs tens
of milliseconds per call on this CPU. So the FAR tests are few and direct, on a two-block model
whose unpatched training step is computed once: the training path (compressed context, noisy chunks
and their clean copy, the FAR block mask) exact for chunks, the FFN seam and the offload engine; the
KV-cache prefill and decoding trained as one step through the cache, exact, chunks falling back block
by block and the cache left as unpatched; and kept attention refused, saying what to change (flex
attention compiles its own call, which cannot run under gradseam's attention gate). ``-m compiled`` adds the kit's compiled rows for the bidirectional model and,
for the FAR model, ``unsloth-compile`` on the training path and ``compile`` through the KV cache.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator

import pytest
import torch
from family_checks import assert_ffn_seam_is_one_module, assert_plans_cover_every_block

import gradseam
from gradseam.errors import UnsupportedStrategyError
from gradseam.offload import cpu_test_mode
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    Step,
    assert_regions_whole,
    assert_same_step,
    check_bench_workload,
    check_builtin_flag,
    config_id,
    preset_model,
    randn,
    record_regions,
    run_step,
)

CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}
UNSLOTH = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"}
FFN_ATTENTION_OFFLOADED = {**FFN, "gradient_checkpointing_offload_attention": True}

# 2 heads of 8 (16 wide; the RoPE splits a head's 4 complex channels 2 + 1 + 1 over frames, rows and
# columns), FFN 32, umT5 states 12 wide, 4 blocks. 2 latent frames of 4 x 4 (2 x 2 patches): 8 tokens.
TINY = {
    "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 4,
    "out_channels": 4, "text_dim": 12, "freq_dim": 16, "ffn_dim": 32, "num_layers": 4, "rope_max_seq_len": 64,
}
TEXT = 5


def anyflow_model() -> torch.nn.Module:
    from diffusers import AnyFlowTransformer3DModel

    return AnyFlowTransformer3DModel(**TINY)


def anyflow_inputs(g: torch.Generator) -> dict:
    # the model takes frames before channels; one source and one target time per latent frame
    return {
        "hidden_states": randn(g, 1, 2, 4, 4, 4, grad=True),
        "timestep": torch.tensor([[700.0, 700.0]]),
        "r_timestep": torch.tensor([[300.0, 300.0]]),
        "encoder_hidden_states": randn(g, 1, TEXT, 12, grad=True),
    }


def anyflow_batch_inputs(g: torch.Generator) -> dict:
    # two samples, each with its own times; the first frame is a clean context frame whose source time the
    # pipeline sets to 0 (its video-to-video conditioning), so the modulation differs per frame and per sample
    return {
        "hidden_states": randn(g, 2, 2, 4, 4, 4, grad=True),
        "timestep": torch.tensor([[0.0, 900.0], [0.0, 400.0]]),
        "r_timestep": torch.tensor([[500.0, 500.0], [0.0, 0.0]]),
        "encoder_hidden_states": randn(g, 2, TEXT, 12, grad=True),
    }


ANYFLOW = Case("anyflow", anyflow_model, anyflow_inputs)
ANYFLOW_BATCH = Case("anyflow-batch", anyflow_model, anyflow_batch_inputs)


class TestAnyFlow(ConformanceSuite):
    case = ANYFLOW


class TestAnyFlowBatch(ConformanceSuite):
    case = ANYFLOW_BATCH
    reduced = True


def test_the_batch_variant_exercises_per_frame_times() -> None:
    model = ANYFLOW_BATCH.fresh()
    x = anyflow_batch_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(**x).sample
        same = model(**{**x, "timestep": torch.tensor([[900.0, 900.0], [400.0, 400.0]])}).sample
    assert not torch.equal(out, same)


def test_the_loop_hands_every_block_the_same_conditioning() -> None:
    # What the carry relies on: the modulation projection, the text states, the RoPE dict and the mask
    # (None) are one object each for every block; hidden_states is what the previous block returned.
    model = ANYFLOW_BATCH.fresh()
    seen: list[dict] = []
    returned: list[torch.Tensor] = []
    sig = inspect.signature(model.blocks[0].forward)
    for block in model.blocks:
        block.register_forward_pre_hook(lambda _m, a, kw: seen.append(sig.bind(*a, **kw).arguments), with_kwargs=True)
        block.register_forward_hook(lambda _m, _a, out: returned.append(out))
    with torch.no_grad():
        model(**anyflow_batch_inputs(torch.Generator().manual_seed(1)))
    assert len(seen) == 4 and seen[0]["attention_mask"] is None and "kv_cache" not in seen[0]
    assert seen[0]["temb"].shape == (2, 8, 6, 16)  # per token: each frame's projection over its 4 tokens
    for name in ("encoder_hidden_states", "temb", "rotary_emb"):
        assert all(kw[name] is seen[0][name] for kw in seen), name
    assert all(kw["hidden_states"] is out for out, kw in zip(returned, seen[1:]))


def test_the_ffn_seam_is_the_feedforward_alone() -> None:
    # One region per block around ffn; norm3 cannot join: ffn sees its output scaled and shifted.
    assert_ffn_seam_is_one_module(ANYFLOW, "anyflow", FFN)


def test_the_builtin_flag_is_exact_and_owned_by_gradseam() -> None:
    # diffusers' flag checkpoints every block with every argument, positionally
    check_builtin_flag(ANYFLOW, CHUNKED)


# -- anyflow-far: the causal FAR model -------------------------------------------------------------

# The bidirectional trunk with two blocks; the released FAR layout: compressed (1, 4, 4) context patches,
# three full-resolution chunks. Latents of 8 x 8: 16 tokens per full frame, 4 per compressed frame.
FAR_TINY = {**TINY, "num_layers": 2, "compressed_patch_size": (1, 4, 4), "full_chunk_limit": 3,
            "chunk_partition": (1, 1, 1, 1)}
CHUNKS = [1, 1, 1, 1]


@pytest.fixture
def flex_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Lift torch's refusal to run flex attention's backward on the CPU (a device check: the unfused eager
    path it takes anyway is plain autograd, the same ops unpatched and patched)."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *args, **kwargs: None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile", UserWarning)
        yield


def far_model() -> torch.nn.Module:
    from diffusers import AnyFlowFARTransformer3DModel

    return AnyFlowFARTransformer3DModel(**FAR_TINY)


def far_inputs(g: torch.Generator) -> dict:
    # AnyFlow's FAR training step: four one-frame chunks, the first the clean context (time 0; the model
    # patchifies it at the compressed size), the last three noisy, and their clean copy at time 0, which
    # the FAR mask lets the noisy frames attend to: 4 + 3 x 16 + 3 x 16 = 100 tokens
    return {
        "hidden_states": randn(g, 1, 4, 4, 8, 8, grad=True),
        "timestep": torch.tensor([[0.0, 700.0, 700.0, 700.0]]),
        "r_timestep": torch.tensor([[0.0, 300.0, 300.0, 300.0]]),
        "encoder_hidden_states": randn(g, 1, TEXT, 12, grad=True),
        "chunk_partition": CHUNKS,
        "clean_hidden_states": randn(g, 1, 3, 4, 8, 8, grad=True),
        "clean_timestep": torch.zeros(1, 3),
    }


FAR = Case("anyflow-far", far_model, far_inputs)
_FAR_REFERENCE: list[Step] = []  # the unpatched training step, computed once


def _far_reference() -> Step:
    if not _FAR_REFERENCE:
        _FAR_REFERENCE.append(run_step(FAR.fresh(), FAR))
    return _FAR_REFERENCE[0].copy()


def test_far_declaration() -> None:
    model = FAR.fresh()
    family = family_for(model)
    assert family.name == "anyflow-far" and family.has_ffn and family.has_attention and family.supports_interval
    (blocks,) = family.block_lists
    assert (blocks.path, blocks.per_block) == ("blocks", ("kv_cache",))
    block_class = family.block_class_for(type(model.blocks[0]))
    assert block_class.cls.startswith("diffusers.models.transformers.transformer_anyflow_far.")
    assert family_for(ANYFLOW.fresh()).name == "anyflow"  # the bidirectional block is another class
    the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.blocks, r.seam) for r in the_plan.regions] == [((0,), ("ffn",)), ((1,), ("ffn",))]


def test_far_training_loop_hands_every_block_one_block_mask(flex_on_cpu: None) -> None:
    from torch.nn.attention.flex_attention import BlockMask

    model = FAR.fresh()
    seen: list[dict] = []
    sig = inspect.signature(model.blocks[0].forward)
    for block in model.blocks:
        block.register_forward_pre_hook(lambda _m, a, kw: seen.append(sig.bind(*a, **kw).arguments), with_kwargs=True)
    with torch.no_grad():
        model(**far_inputs(torch.Generator().manual_seed(1)))
    first, second = seen
    assert isinstance(first["attention_mask"], BlockMask) and "kv_cache" not in first
    assert first["hidden_states"].shape == (1, 4 + 3 * 16 + 3 * 16, 16)
    for name in ("encoder_hidden_states", "temb", "rotary_emb", "attention_mask"):
        assert second[name] is first[name], name


@pytest.mark.parametrize("config", [CHUNKED, FFN, UNSLOTH, FFN_ATTENTION_OFFLOADED], ids=config_id)
def test_far_training_step_is_exact(config: dict, flex_on_cpu: None) -> None:
    # Chunks run whole (one BlockMask for every block), the seam and the offload engine are exact, and so is
    # attention offload outside whole-block regions (beside the -ffn backend), flex self-attention included.
    expected = _far_reference()
    model = FAR.fresh()
    with cpu_test_mode(), gradseam.patch(model, config) as handle, record_regions(handle) as regions:
        got = run_step(model, FAR)
    assert_same_step(expected, got, what=config_id(config))
    assert_regions_whole(regions, what=config_id(config))
    assert got.saved_bytes < expected.saved_bytes
    if config is CHUNKED:
        assert [r.label for r in regions] == ["blocks[0, 1]"]


def test_far_kept_attention_is_refused_saying_what_to_change(flex_on_cpu: None) -> None:
    # Kept (and offloaded) attention inside whole-block regions cannot run flex attention, which compiles its own
    # call even in eager mode (so does gradient_checkpointing_offload_attention with a whole-block backend, the
    # same gate): refused in forward with what to change, not dynamo's internal error.
    model = FAR.fresh()
    with (gradseam.patch(model, gradient_checkpointing=True, gradient_checkpointing_keep_attention=True),
          pytest.raises(UnsupportedStrategyError, match="calls torch.compile inside its forward")):
        run_step(model, FAR)


def _cache(batch: int = 1) -> dict[int, dict[str, torch.Tensor]]:
    # as AnyFlowFARPipeline allocates it: room for full_chunk_limit full chunks and the compressed rest
    full, compressed = 3 * 16, (4 - 3 + 1) * 4
    return {i: {"full_cache": torch.zeros(2, batch, 2, full, 8), "compressed_cache": torch.zeros(2, batch, 2, compressed, 8)}
            for i in range(2)}


def _prefill_then_decode(model: torch.nn.Module) -> tuple[Step, dict]:
    """The pipeline's two KV-cache calls as one training step: the prefill writes the first three chunks' K/V
    (the first compressed) into each block's cache, the decoding step denoises the fourth chunk against it.
    The loss is the decoding step's; the prefill's latents and weights get gradients only through the cache."""
    model.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(1)
    context = randn(g, 1, 3, 4, 8, 8, grad=True)
    text = randn(g, 1, TEXT, 12, grad=True)
    noisy = randn(g, 1, 1, 4, 8, 8, grad=True)
    cache = _cache()
    zeros = torch.zeros(1, 3)
    model(context, zeros, zeros, text, chunk_partition=CHUNKS[:3], kv_cache=cache,
          kv_cache_flag={"num_cached_chunks": 0, "is_cache_step": True})
    out = model(noisy, torch.tensor([[700.0]]), torch.tensor([[300.0]]), text, chunk_partition=CHUNKS, kv_cache=cache,
                kv_cache_flag={"num_cached_chunks": 3, "is_cache_step": False}).sample
    out.square().mean().backward()
    grads = {"context": context.grad, "text": text.grad, "noisy": noisy.grad}
    params = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return Step((out.detach(),), grads, params, 0), cache


def test_far_kv_cache_trains_exactly_and_chunks_fall_back(flex_on_cpu: None) -> None:
    # Each block gets its own layer cache (per_block): a chunk computes block by block while one is passed
    # (a counted fall-back), the step is exact, and the cache holds what the unpatched model leaves there.
    model = FAR.fresh()
    expected, cache = _prefill_then_decode(model)
    assert expected.input_grads["context"].abs().sum() > 0  # the gradient crossed the cache
    with gradseam.patch(model, CHUNKED) as handle, record_regions(handle) as regions:
        got, patched_cache = _prefill_then_decode(model)
    assert_same_step(expected, got, what="prefill + decode, interval 2")
    (chunk,) = regions  # both calls (prefill, decoding) fell back because of the cache, and only for it
    assert (chunk.chunk_calls, chunk.runs) == (0, 4) and list(chunk.fallbacks.values()) == [2], chunk
    assert "per_block" in next(iter(chunk.fallbacks)), chunk.fallbacks
    for i in range(2):
        for key in ("full_cache", "compressed_cache"):
            assert torch.equal(cache[i][key], patched_cache[i][key]), (i, key)
    assert not torch.equal(cache[0]["full_cache"], cache[1]["full_cache"])  # one cache per block


def test_far_backward_after_the_next_prefill_is_refused_naming_the_cache(flex_on_cpu: None) -> None:
    # The pipeline refills the cache for every chunk. A decoding step's backward taken after the next prefill
    # would recompute the decoding blocks against the new cache (wrong gradients, as diffusers' own flag
    # gives); the recompute finds the layer cache changed since its forward and refuses, naming it.
    model = FAR.fresh()
    g = torch.Generator().manual_seed(1)
    context, text = randn(g, 1, 3, 4, 8, 8), randn(g, 1, TEXT, 12)
    noisy = randn(g, 1, 1, 4, 8, 8, grad=True)
    cache, zeros = _cache(), torch.zeros(1, 3)
    prefill = {"chunk_partition": CHUNKS[:3], "kv_cache": cache, "kv_cache_flag": {"num_cached_chunks": 0,
                                                                                    "is_cache_step": True}}
    with gradseam.patch(model, gradient_checkpointing=True):
        with torch.no_grad():
            model(context, zeros, zeros, text, **prefill)
        out = model(noisy, torch.tensor([[700.0]]), torch.tensor([[300.0]]), text, chunk_partition=CHUNKS,
                    kv_cache=cache, kv_cache_flag={"num_cached_chunks": 3, "is_cache_step": False}).sample
        with torch.no_grad():  # the next chunk's prefill, before this step's backward
            model(context * 2, zeros, zeros, text, **prefill)
        with pytest.raises(RuntimeError, match=r"kv_cache\['(full|compressed)_cache'\] was written in place"):
            out.square().mean().backward()


# -- the compiled backends (run with -m compiled) ---------------------------------------------------


@pytest.mark.compiled
def test_far_unsloth_compile_through_the_complex_rope(flex_on_cpu: None) -> None:
    # Through the complex float64 RoPE. The table reaches every block as a shared argument, which the engine
    # leaves in place: no conjugate view is offloaded here, and the step is within the compiled tolerance.
    expected = _far_reference()
    model = FAR.fresh()
    config = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-compile"}
    with cpu_test_mode(), gradseam.patch(model, config):
        got = run_step(model, FAR)
    assert_same_step(expected, got, atol=1e-5, what="unsloth-compile")


@pytest.mark.compiled
def test_far_compile_trains_through_the_kv_cache(flex_on_cpu: None) -> None:
    # Unlike Wan-Animate-2's (whose layer caches keep the tensors a block hands them, so the compiled blocks'
    # eager reach probe leaves its own there), this cache is preallocated and written in place: the compiled
    # run writes over whatever the probe wrote, and the step trains through the cache.
    model = FAR.fresh()
    expected, cache = _prefill_then_decode(model)
    with gradseam.patch(model, gradient_checkpointing=True, gradient_checkpointing_backend="compile"):
        got, patched_cache = _prefill_then_decode(model)
    assert_same_step(expected, got, atol=1e-5, what="compile, prefill + decode")
    assert all(torch.allclose(cache[i][k], patched_cache[i][k], atol=1e-5)
               for i in range(2) for k in ("full_cache", "compressed_cache"))


# -- the presets at full size -----------------------------------------------------------------------

PRESETS = {  # family -> preset -> (blocks, heads, FFN width, parameters in billions)
    "anyflow": {"t2v-14b-480p": (40, 40, 13824, 14.3), "t2v-1.3b-480p": (30, 12, 8960, 1.4)},
    "anyflow-far": {"far-14b-480p": (40, 40, 13824, 14.3), "far-1.3b-480p": (30, 12, 8960, 1.4)},
}
ALL_PRESETS = [(f, p) for f, presets in PRESETS.items() for p in presets]


@pytest.mark.parametrize(("name", "preset"), ALL_PRESETS, ids=[p for _, p in ALL_PRESETS])
def test_presets_plan_at_full_size(name: str, preset: str) -> None:
    family, the_preset, model = preset_model(name, preset)
    assert set(family.presets) == set(PRESETS[name]) and family_for(model) is family
    params = set(inspect.signature(type(model).__init__).parameters) - {"self"}
    assert set(the_preset.config) == params  # every constructor argument, spelled out
    blocks, heads, ffn, billions = PRESETS[name][preset]
    block = model.blocks[0]
    assert (len(model.blocks), block.attn1.heads, block.ffn.net[0].proj.out_features) == (blocks, heads, ffn)
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - billions) < 0.1
    assert_plans_cover_every_block(model, family, blocks, (
        ({"gradient_checkpointing": True}, blocks), (CHUNKED, blocks // 2), (FFN, blocks)
    ))


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    family, preset, model = preset_model("anyflow", "t2v-14b-480p")
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 21, 16, 60, 104) and x["hidden_states"].requires_grad
    assert x["timestep"].shape == x["r_timestep"].shape == (1, 21)
    assert x["encoder_hidden_states"].shape == (1, 512, 4096)
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 11 * 30 * 52, **preset.inputs)
    assert fewer["hidden_states"].shape[1] == 11


def test_far_preset_inputs_are_the_training_step() -> None:
    from diffusers.models.transformers.transformer_anyflow_far import AnyFlowFARTransformer3DModel as Far

    family = gradseam.registry.REGISTRY.get("anyflow-far")
    preset = family.presets["far-14b-480p"]
    with torch.device("meta"):
        model = Far(**{**preset.config, "num_layers": 1})
    # the real sizes, but the block mask (which the builder makes eagerly) only at a small one on the CPU
    x = preset.make_inputs(model, "cpu", torch.bfloat16, None, frames=81, height=64, width=64, text_tokens=3)
    assert x["chunk_partition"] == [1, 3, 3, 3, 3, 3, 3, 2]
    assert x["hidden_states"].shape == (1, 21, 16, 8, 8) and x["clean_hidden_states"].shape == (1, 8, 16, 8, 8)
    assert x["timestep"][0].tolist() == [0.0] * 13 + [700.0] * 8 and not x["clean_timestep"].any()
    assert x["attention_mask"].shape[-2:] == (3 * 128, 3 * 128)  # 13 x 4 + 8 x 16 x 2 = 308 tokens, padded
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, text_tokens=512, **{**preset.inputs, "frames": 1})
    assert x["chunk_partition"] == [1] and x["hidden_states"].shape == (1, 1, 16, 60, 104)


def test_bench_workloads_truncate_and_patch_exactly(flex_on_cpu: None) -> None:
    """`gradseam bench --family anyflow[-far] --layers 2` on tiny presets with the real input builders."""
    sizes = {"frames": 5, "height": 32, "width": 32, "text_tokens": TEXT}
    check_bench_workload("anyflow", TINY, sizes, sequence=2 * 2 * 2)
    # 8 latent frames in chunks 1 + 3 + 3 + 1: one compressed context frame (4 x 4 latents: 1 token), seven noisy
    # frames of 4 tokens and their clean copy
    far = {k: v for k, v in FAR_TINY.items() if k != "chunk_partition"}
    check_bench_workload("anyflow-far", far, {**sizes, "frames": 29}, sequence=1 + 7 * 4 * 2)
