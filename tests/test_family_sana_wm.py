"""SANA-WM (SanaWMTransformer3DModel, family ``sana-wm``) and its stage-2 LTX-2 refiner
(SanaWMLTX2RefinerTransformer3DModel, family ``sana-wm-refiner``) through the conformance kit.

sana-wm: the plain case (one clip with camera conditions, the Plücker map and a padded prompt; a GDN and a
softmax block, twice) runs the whole matrix; a batch of two with per-frame timesteps and a frame mask the
reduced one. The FFN seam is ``mlp``, which the block calls with the layout as a keyword; the loop hands every
block the same arguments; diffusers' own flag is exact.

sana-wm-refiner: the plain case (no KV cache, a left-padded prompt) runs the whole matrix, the pipeline's
``"inject"`` step (each layer's sink and history K/V) the KV rows, with chunks computing block by block on
purpose (``per_block``). The two capture modes write the cache exactly (compared layer by layer), and without
``per_block`` a chunk would write the wrong layer. A cache rewritten before backward is refused; a capture slot
read back before backward is filled again (the one trace a recompute leaves). Then the presets, at full size on
the meta device and through the bench workload.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gradseam
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.run.links import PER_BLOCK
from gradseam.testing import (
    Case,
    ConformanceSuite,
    Step,
    assert_same_step,
    check_bench_workload,
    check_builtin_flag,
    cpu_configs,
    pick,
    preset_model,
    randn,
    record_regions,
    reduced_configs,
    run_step,
)
from gradseam.tools.named_strategies import BACKEND, INTERVAL, STRIDE

ON = {"gradient_checkpointing": True}
CHUNKED = {**ON, "gradient_checkpointing_interval": 2}
FFN = {**ON, "gradient_checkpointing_backend": "torch-ffn"}

# -- SANA-WM: 4 blocks 16 wide (2 GDN heads of 8; 2 cross-attention heads), softmax in blocks 1 and 3 -------------
# 3 latent frames of 2 x 3 (patch 1): 18 video tokens; 5 prompt tokens (kept attention keeps a call with at least
# a quarter as many keys as queries); a 6-channel Plücker map.
TEXT, CAPTION, PLUCKER = 5, 12, 6
FRAMES, ROWS, COLS = 3, 2, 3
TINY = {
    "in_channels": 4, "num_layers": 4, "hidden_size": 16, "num_attention_heads": 2, "linear_head_dim": 8,
    "softmax_every_n": 2, "caption_channels": CAPTION, "mlp_ratio": 2.0, "chunk_plucker_channels": PLUCKER,
}


def sana_wm_model(layers: int = 4) -> torch.nn.Module:
    from diffusers import SanaWMTransformer3DModel

    model = SanaWMTransformer3DModel(**{**TINY, "num_layers": layers})
    # the Plücker embedder is zero-initialised upstream (its map would add only plucker_proj's bias): random
    # weights, drawn under the kit's seed, make every block's post-attention Plücker projection compute
    with torch.no_grad():
        model.plucker_embedder.proj.weight.normal_(std=0.2)
        model.plucker_embedder.proj.bias.normal_(std=0.2)
    return model


def _camera(batch: int) -> dict:
    from gradseam.adapters.sana_wm import camera_inputs

    return camera_inputs(batch, FRAMES, ROWS, COLS, "cpu", torch.float32)


def sana_wm_inputs(g: torch.Generator) -> dict:
    # image-to-video as the pipeline runs it: the first frame's timestep is 0; the prompt's last token is padding
    mask = torch.ones(1, TEXT, dtype=torch.long)
    mask[:, -1] = 0
    return {
        "hidden_states": randn(g, 1, 4, FRAMES, ROWS, COLS, grad=True),
        "timestep": torch.tensor([[[0.0, 600.0, 600.0]]]),
        "encoder_hidden_states": randn(g, 1, 1, TEXT, CAPTION, grad=True),
        "mask": mask,
        **_camera(1),
        "chunk_plucker": randn(g, 1, PLUCKER, FRAMES, ROWS, COLS, grad=True),
    }


def sana_wm_batch_inputs(g: torch.Generator) -> dict:
    # two clips at their own per-frame timesteps, prompts padded differently (the diffusers name of the mask),
    # the second clip's last frame marked invalid (every block zeroes its tokens, the GDN gates skip it)
    mask = torch.ones(2, TEXT, dtype=torch.long)
    mask[1, 3:] = 0
    return {
        "hidden_states": randn(g, 2, 4, FRAMES, ROWS, COLS, grad=True),
        "timestep": torch.tensor([[[0.0, 300.0, 300.0]], [[0.0, 800.0, 900.0]]]),
        "encoder_hidden_states": randn(g, 2, 1, TEXT, CAPTION, grad=True),
        "encoder_attention_mask": mask,
        **_camera(2),
        "chunk_plucker": randn(g, 2, PLUCKER, FRAMES, ROWS, COLS),
        "frame_valid_mask": torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
    }


SANA_WM = Case("sana-wm", sana_wm_model, sana_wm_inputs)
# the variant on two blocks (one GDN, one softmax): the reduced rows need one chunk, and the step costs half
SANA_WM_BATCH = Case("sana-wm-batch-frame-mask", lambda: sana_wm_model(layers=2), sana_wm_batch_inputs)


class TestSanaWM(ConformanceSuite):
    case = SANA_WM


class TestSanaWMBatch(ConformanceSuite):
    case = SANA_WM_BATCH
    reduced = True


# -- the refiner: LTX-2's block 16 wide (2 heads of 8), 3 blocks; the audio modules are built, never run ---------
# An active block of 2 latent frames of 2 x 2: 8 tokens; 6 prompt tokens; a window of 1 sink + 2 history frames.
R_LAYERS, R_HEADS, R_HEAD, R_GRID = 3, 2, 8, 2
PER_FRAME = R_GRID * R_GRID
R_TINY = {
    "in_channels": 4, "out_channels": 4, "num_attention_heads": R_HEADS, "attention_head_dim": R_HEAD,
    "cross_attention_dim": 16, "audio_in_channels": 4, "audio_out_channels": 4, "audio_num_attention_heads": 1,
    "audio_attention_head_dim": 4, "audio_cross_attention_dim": 4, "num_layers": R_LAYERS, "caption_channels": 12,
}


def refiner_model() -> torch.nn.Module:
    from diffusers import SanaWMLTX2RefinerTransformer3DModel

    return SanaWMLTX2RefinerTransformer3DModel(**R_TINY)


_ROPE = refiner_model()  # the RoPE tables depend on the config only: one instance builds the pipeline's


def _rope(first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _ROPE.build_rotary_emb_for_absolute_positions(
        batch_size=1, frame_positions=list(range(first, first + count)), height=R_GRID, width=R_GRID, device="cpu",
        fps=16.0)


def refiner_inputs(g: torch.Generator, start: int = 3) -> dict:
    # the active block at frames start, start + 1, at sigma 0.725 (x1000); the Gemma-3 prompt left-padded
    mask = torch.ones(1, 6)
    mask[:, :2] = 0
    return {
        "hidden_states": randn(g, 1, 2 * PER_FRAME, 4, grad=True),
        "encoder_hidden_states": randn(g, 1, 6, 12, grad=True),
        "timestep": torch.full((1, 2 * PER_FRAME), 725.0),
        "video_rotary_emb": _rope(start, 2),
        "encoder_attention_mask": mask,
    }


def _cache(g: torch.Generator | None = None) -> Any:
    """A fresh cache, or (given a generator) one in the pipeline's steady state: each layer's pre-RoPE sink K/V
    (1 frame) and post-RoPE history K/V (2 frames), and the sink's RoPE slid to sit right before the history."""
    from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMRefinerKVCache

    cache = SanaWMRefinerKVCache(R_LAYERS)
    if g is not None:
        inner = R_HEADS * R_HEAD
        for layer in cache.layer_caches:
            layer.store_sink(randn(g, 1, PER_FRAME, inner), randn(g, 1, PER_FRAME, inner))
            layer.store_history(randn(g, 1, 2 * PER_FRAME, inner), randn(g, 1, 2 * PER_FRAME, inner))
        cache.sink_pe = _rope(0, 1)
    return cache


def refiner_inject_inputs(g: torch.Generator) -> dict:
    # a denoising step: attend to [sink, history, current] K/V, each layer its own
    return {**refiner_inputs(g), "kv_cache": _cache(g), "kv_cache_mode": "inject"}


def refiner_capture_pre_inputs(g: torch.Generator) -> dict:
    # seeding the sink: no prefix; each layer's pre-RoPE K/V written into a fresh cache
    return {**refiner_inputs(g, start=0), "kv_cache": _cache(), "kv_cache_mode": "capture_pre_rope"}


def refiner_capture_post_inputs(g: torch.Generator) -> dict:
    # the end of a window: attend to the prefix and write the block's post-RoPE K/V for the history
    return {**refiner_inputs(g), "kv_cache": _cache(g), "kv_cache_mode": "inject_and_capture_post_rope"}


REFINER = Case("sana-wm-refiner", refiner_model, refiner_inputs)
REFINER_INJECT = Case("sana-wm-refiner-inject", refiner_model, refiner_inject_inputs)
REFINER_CAPTURE_PRE = Case("sana-wm-refiner-capture-pre-rope", refiner_model, refiner_capture_pre_inputs)
REFINER_CAPTURE_POST = Case("sana-wm-refiner-capture-post-rope", refiner_model, refiner_capture_post_inputs)


class TestSanaWMRefiner(ConformanceSuite):
    case = REFINER
    # its blocks are LTX-2's (plain Linear layers), whose suite runs every quantized base
    quantized_bases = ("torchao-int8",)


class TestSanaWMRefinerInject(ConformanceSuite):
    case = REFINER_INJECT
    # with a cache, chunks compute block by block on purpose: the reduced rows, and chunks of two with a stride
    configs = [*reduced_configs(), *pick(cpu_configs(), {BACKEND: "torch", INTERVAL: 2, STRIDE: 4})]
    reduced_offload = True
    whole_regions = False


# -- sana-wm: the loop, the seam, the flag ----------------------------------------------------------------------


def test_every_block_gets_the_same_arguments_and_they_reach_it() -> None:
    # The carry's premise: the loop calls blocks positionally with one set of objects (the layout a fresh tuple
    # of equal ints, block_mask always None). And the camera, the Plücker map and the frame mask change the
    # output, so the cases exercise them.
    model = SANA_WM.fresh()
    seen: list[tuple] = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda _m, args: seen.append(args))
    inputs = sana_wm_batch_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(**inputs).sample
        without_camera = model(**{k: v for k, v in inputs.items() if k != "camera_conditions"}).sample
        without_plucker = model(**{k: v for k, v in inputs.items() if k != "chunk_plucker"}).sample
        without_mask = model(**{k: v for k, v in inputs.items() if k != "frame_valid_mask"}).sample
    first = seen[0]
    assert first[4] == (FRAMES, ROWS, COLS) and first[6] is None and first[7] is inputs["camera_conditions"]
    for args in seen[1:4]:
        assert args[4] == first[4] and args[4] is not first[4] and args[6] is None  # equal, not the same
        assert all(a is b for i, (a, b) in enumerate(zip(args, first)) if i not in (0, 4))
    for other in (without_camera, without_plucker):
        assert not torch.equal(full, other)
    assert torch.equal(full[0], without_mask[0]) and not torch.equal(full[1], without_mask[1])


def test_ffn_seam_is_mlp_called_with_the_layout_as_a_keyword(monkeypatch: pytest.MonkeyPatch) -> None:
    # The seam is one module the block calls as mlp(x, HW=THW): the keyword reaches the checkpointed call and its
    # recompute in backward (a region of one member takes whatever arguments the block gave it), and each seam
    # runs as one region.
    from diffusers.models.transformers.transformer_sana_wm import GLUMBConvTemp

    model = SANA_WM.fresh()
    family = family_for(model)
    assert family.name == "sana-wm"
    ffn = plan(model, family, gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.blocks, r.seam) for r in ffn.regions] == [((i,), ("mlp",)) for i in range(4)]
    calls: list[tuple] = []
    forward = GLUMBConvTemp.forward

    def recording(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        calls.append((len(args), kwargs))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(GLUMBConvTemp, "forward", recording)
    with gradseam.patch(model, FFN) as handle, record_regions(handle) as regions:
        run_step(model, SANA_WM)
    assert len(calls) == 8  # forward and recompute, each block
    assert all(n == 1 and kw == {"HW": (FRAMES, ROWS, COLS)} for n, kw in calls)
    assert [(r.shape, r.runs) for r in regions] == [("ffn", 1)] * 4


def test_the_builtin_flag_is_exact_and_owned_by_gradseam() -> None:
    # diffusers' flag passes the loop's positional arguments to its checkpoint function unchanged
    check_builtin_flag(SANA_WM, CHUNKED)


# -- sana-wm-refiner: the per-block KV cache ----------------------------------------------------------------------


def test_each_block_gets_its_own_layer_cache_and_the_refiner_has_no_flag() -> None:
    model = REFINER_INJECT.fresh()
    seen = []
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw), with_kwargs=True)
    inputs = refiner_inject_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(**inputs)
    assert [kw["kv_cache"] for kw in seen] == inputs["kv_cache"].layer_caches
    for name in ("temb", "encoder_hidden_states", "video_rotary_emb", "sink_rotary_emb", "encoder_attention_mask"):
        assert all(kw[name] is seen[0][name] for kw in seen), name
    assert seen[0]["sink_rotary_emb"] is inputs["kv_cache"].sink_pe
    with pytest.raises(ValueError, match="does not support gradient checkpointing"):
        model.enable_gradient_checkpointing()  # upstream has no checkpointing path: gradseam is the only one


_KV_CONFIGS = {
    "interval2": CHUNKED,
    "unsloth+interval2": {**CHUNKED, "gradient_checkpointing_backend": "unsloth"},
    "keep-attention+interval2": {**CHUNKED, "gradient_checkpointing_keep_attention": True},
    "torch-ffn": FFN,
}
_SLOTS = {"capture_pre_rope": ("captured_k_pre", "captured_v_pre"),
          "inject_and_capture_post_rope": ("captured_k_post", "captured_v_post")}


def _step_keeping_cache(model: torch.nn.Module, case: Case, caches: list) -> Step:
    """One training step (forward, backward); the inputs' cache is kept for comparing."""
    def build(g: torch.Generator) -> dict:
        inputs = case.inputs(g)
        caches.append(inputs["kv_cache"])
        return inputs

    return run_step(model, Case(case.name, case.build, build, case.output))


def _patched_step(model: torch.nn.Module, case: Case, config: dict, caches: list) -> tuple[Step, list]:
    from gradseam.offload import cpu_test_mode

    with cpu_test_mode(), gradseam.patch(model, config) as handle, record_regions(handle) as regions:
        return _step_keeping_cache(model, case, caches), regions


@pytest.mark.parametrize("case", [REFINER_CAPTURE_PRE, REFINER_CAPTURE_POST], ids=lambda c: c.name)
@pytest.mark.parametrize("config", list(_KV_CONFIGS.values()), ids=list(_KV_CONFIGS))
def test_capture_modes_write_each_layer_exactly(case: Case, config: dict) -> None:
    # A block recomputed in backward stores its K/V again: the same values, in its own layer (it overwrites,
    # never appends); and the chunks of two compute block by block while the cache is passed.
    model = case.fresh()
    caches: list = []
    reference = _step_keeping_cache(model, case, caches)
    patched, regions = _patched_step(model, case, config, caches)
    assert_same_step(reference, patched, what=f"{case.name}, {config}")
    expected, got = caches
    mode = case.inputs(torch.Generator())["kv_cache_mode"]
    for i, (a, b) in enumerate(zip(expected.layer_caches, got.layer_caches, strict=True)):
        for slot in _SLOTS[mode]:
            assert torch.equal(getattr(a, slot), getattr(b, slot)), f"layer {i}: {slot} differs"
    chunks = [r for r in regions if r.shape == "chunk"]
    assert all(r.fallbacks == {PER_BLOCK: 1} and r.runs == 2 for r in chunks), chunks


def test_without_per_block_a_chunk_would_write_the_wrong_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The declaration is what keeps the cache right: the same chunks without it still give exact outputs (the
    later block sees another layer cache and computes again), but the block run ahead has overwritten the first
    block's layer with its own K/V."""
    from dataclasses import replace

    import gradseam.patcher as patcher

    model = REFINER_CAPTURE_PRE.fresh()
    family = family_for(model)
    blind = replace(family, block_lists=tuple(replace(bl, per_block=()) for bl in family.block_lists))
    monkeypatch.setattr(patcher, "family_for", lambda m: blind)
    caches: list = []
    reference = _step_keeping_cache(model, REFINER_CAPTURE_PRE, caches)
    patched, _ = _patched_step(model, REFINER_CAPTURE_PRE, CHUNKED, caches)
    assert_same_step(reference, patched, what="capture_pre_rope, no per_block")
    expected, got = caches
    assert not torch.equal(expected.get(0).captured_k_pre, got.get(0).captured_k_pre)  # the chunk's head: overwritten
    assert torch.equal(got.get(0).captured_k_pre, expected.get(1).captured_k_pre)  # ... by block 1's K/V
    assert torch.equal(expected.get(1).captured_k_pre, got.get(1).captured_k_pre)  # the follower, alone


@pytest.mark.parametrize(("case", "rewrite", "what"), [
    # the pipeline's next window: the history grows (store_history replaces the tensors)
    (REFINER_INJECT, lambda layer: layer.store_history(layer.history_k[:, 1:], layer.history_v[:, 1:]),
     "history_k"),
    # ... after reading back the captured K/V (which empties the slot)
    (REFINER_CAPTURE_POST, lambda layer: layer.get_captured_post_rope(), "captured_k_post"),
], ids=["history-replaced", "captured-read-back"])
def test_a_cache_rewritten_before_backward_is_refused(case: Case, rewrite: Any, what: str) -> None:
    # A recompute reads the cache as it is at backward time: rewritten since the forward, it would compute from
    # other K/V. gradseam checks each block's layer before recomputing it and refuses, naming the slot.
    model = case.fresh()
    inputs = case.inputs(torch.Generator().manual_seed(1))
    with gradseam.patch(model, ON):
        out = model(**inputs).sample
        for layer in inputs["kv_cache"].layer_caches:
            rewrite(layer)
        with pytest.raises(RuntimeError, match=rf"kv_cache\.{what} was replaced after this checkpointed region"):
            out.square().mean().backward()


def test_a_capture_slot_read_back_before_backward_stays_empty() -> None:
    # A fresh cache holds no tensor when a capture_pre_rope forward starts, so nothing can be checked; read back
    # before backward, its slot is empty, and the recompute's capture is put back (gradseam.run.chains), so it
    # stays empty as unpatched. Outputs and gradients stay exact.
    def step(patched: bool) -> tuple[Any, list]:
        model = REFINER_CAPTURE_PRE.fresh()
        inputs = refiner_capture_pre_inputs(torch.Generator().manual_seed(1))
        with gradseam.patch(model, ON if patched else {"gradient_checkpointing": False}):
            out = model(**inputs).sample
            read = [layer.get_captured_pre_rope() for layer in inputs["kv_cache"].layer_caches]
            out.square().mean().backward()
        return inputs["kv_cache"], read

    plain, read = step(False)
    cache, read_patched = step(True)
    for layer, plain_layer, (k, _), (k2, _) in zip(cache.layer_caches, plain.layer_caches, read_patched, read,
                                                   strict=True):
        assert layer.captured_k_pre is None and plain_layer.captured_k_pre is None and torch.equal(k, k2)


# -- presets at full size ---------------------------------------------------------------------------------------


def test_sana_wm_preset_plans_at_full_size() -> None:
    family, preset, model = preset_model("sana-wm")
    assert family_for(model) is family and preset.config == {}  # the class defaults are the release
    blocks = model.blocks
    softmax = [i for i, b in enumerate(blocks) if type(b.attn).__name__ == "_SoftmaxUCPESinglePathLiteLA"]
    assert (len(blocks), model.config.hidden_size, blocks[0].mlp.inverted_conv.conv.out_channels) == (20, 2240, 13440)
    assert softmax == [3, 7, 11, 15, 19] and all(hasattr(b, "plucker_proj") for b in blocks)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 2.66
    for config, regions in ((ON, 20), (CHUNKED, 10), (FFN, 20)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert len(the_plan.regions) == regions
        assert {b for r in the_plan.regions for b in r.blocks} == set(range(20))
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    # 704x1280, 161 frames through the LTX-2 VAE (8x in time, 32x in space): 21 x 22 x 40 = 18480 tokens
    assert x["hidden_states"].shape == (1, 128, 21, 22, 40) and x["hidden_states"].requires_grad
    assert x["timestep"].shape == (1, 1, 21) and x["encoder_hidden_states"].shape == (1, 1, 300, 2304)
    assert x["camera_conditions"].shape == (1, 21, 20) and x["chunk_plucker"].shape == (1, 48, 21, 22, 40)
    assert preset.make_inputs(model, "meta", torch.bfloat16, 4 * 880, **preset.inputs)["hidden_states"].shape[2] == 4


def test_refiner_preset_plans_at_full_size() -> None:
    family, preset, model = preset_model("sana-wm-refiner")
    assert family_for(model) is family and preset.config == {}  # the class defaults: LTX-2's trunk
    assert (len(model.transformer_blocks), model.transformer_blocks[0].attn1.heads) == (48, 32)
    for config, regions in ((ON, 48), (CHUNKED, 24), (FFN, 48)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert len(the_plan.regions) == regions
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    # one 3-frame block of 22 x 40 tokens against 1 sink + 10 history frames, in every one of the 48 layers
    assert x["hidden_states"].shape == (1, 3 * 880, 128) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 1024, 3840) and x["kv_cache_mode"] == "inject"
    cache = x["kv_cache"]
    assert len(cache) == 48 and cache.get(47).sink_k_pre.shape == (1, 880, 4096)
    assert cache.get(0).history_k.shape == (1, 8800, 4096) and cache.sink_pe[0].shape == (1, 880, 4096)
    assert x["video_rotary_emb"][0].shape == (1, 2640, 4096)
    assert preset.make_inputs(model, "meta", torch.bfloat16, 880, **preset.inputs)["hidden_states"].shape[1] == 880


def test_bench_workloads_truncate_and_patch_exactly() -> None:
    """`gradseam bench --family sana-wm[-refiner] --layers 2` on tiny presets with the real input builders."""
    check_bench_workload("sana-wm", {**TINY, "chunk_plucker_channels": 48},
                         {"frames": 17, "height": 64, "width": 96, "text_tokens": 6}, sequence=3 * 2 * 3)
    check_bench_workload("sana-wm-refiner", R_TINY,
                         {"height": 64, "width": 64, "block_frames": 2, "block_start": 4, "history_frames": 2,
                          "text_tokens": 6}, sequence=2 * PER_FRAME)


def test_bench_builds_the_refiners_kv_cache_for_the_blocks_each_fit_depth_runs() -> None:
    """The refiner's preset passes a KV cache with one layer cache per block, and diffusers refuses a cache for another
    number of blocks. Bench builds the model once at its deepest depth and cuts it: inputs built once, for the deeper
    model, failed every row at the shallower depth on an H100 ("holds 4 layer caches but the model has 2 transformer
    blocks"). Each depth now gets inputs built for the model as cut."""
    import dataclasses

    from gradseam.tools import bench
    from gradseam.tools.checks import find_family

    family = find_family("sana-wm-refiner")
    preset = dataclasses.replace(next(iter(family.presets.values())), config=R_TINY, inputs={
        "height": 64, "width": 64, "block_frames": 2, "block_start": 4, "history_frames": 2, "text_tokens": 6})
    run = bench.real(dataclasses.replace(family, presets={"tiny": preset}), "tiny", depths="1,2", rows=["none"],
                     steps=1, device="cpu")
    assert [(r.depth, r.status) for r in run.results] == [(1, "ok"), (2, "ok")]
    assert 0 < run.results[0].peak_gib < run.results[1].peak_gib
