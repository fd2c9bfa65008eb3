"""Kandinsky 6.0 (two families of one adapter) through the conformance kit, bit for bit on the CPU.

``kandinsky6`` (Kandinsky6Transformer3DModel, joint video and audio): a tiny model with the released
flags (cross-modal RoPE, gates, fixed modulation, image-to-video token types) runs the kit's full matrix
with audio; a batch of two with padded prompts in the image-to-video mode runs the reduced one. Video
alone (no audio latents) leaves the audio seams and the audio and cross-modal attentions idle, which the
kit's suite counts as a wrong declaration, so it is checked here row by row. Then: chunks that really
chain in all three lists, the seams and attention sides as planned, diffusers' own checkpointing flag,
the presets at full size and their input builder.

``kandinsky6-sr`` (Kandinsky6SRTransformer3DModel, the case: two tiles at their own timesteps, as the
pipeline batches them): its attention is flex attention with a NABLA block
mask, which torch runs backward on the CPU only with its device check lifted (``flex_backward_on_cpu``;
the eager path is plain autograd, the same for the patched and the unpatched model). The kit's kernel
locator cannot run flex attention (its dispatch mode has no rule for the higher-order op), so the SR suite
runs the rows that do not locate kernels, and the rest is checked here: two ``-ffn`` rows step by step,
where flex attention is called (once per block, inside ``self_attention``, never inside the seam) and that
its NABLA masks really select, attention offloaded inside whole blocks refused, diffusers' flag, and the
presets. The compiled rows of both families run with ``-m compiled``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import gradseam
from gradseam.errors import UnsupportedStrategyError
from gradseam.offload import cpu_test_mode
from gradseam.patcher import family_for
from gradseam.planning import plan, resolve
from gradseam.testing import (
    Case,
    ConformanceSuite,
    Step,
    assert_regions_whole,
    assert_same_step,
    check_bench_workload,
    check_builtin_flag,
    check_strategy,
    config_id,
    cpu_configs,
    offload_configs,
    pick,
    preset_model,
    randn,
    record_regions,
    run_step,
)

ON = {"gradient_checkpointing": True}
CHUNKED = {**ON, "gradient_checkpointing_interval": 2}
FFN = {**ON, "gradient_checkpointing_backend": "torch-ffn"}
OFFLOAD_ATTENTION = {"gradient_checkpointing_offload_attention": True}
LISTS = ("video_text_transformer_blocks", "audio_text_transformer_blocks", "visual_transformer_blocks")
TEXT, TEXT_DIM, POOLED, AUDIO = 6, 12, 6, 5

# Video 16 wide (2 heads of 8: RoPE 2 + 2 + 4), audio 8 wide (1 head of 8), the released flags; 2 text blocks
# per branch (the released Lite's count, and cheaper) and 4 fused blocks (interval 2 with stride 4 then forms a
# chunk and leaves blocks alone).
TINY = dict(
    in_visual_dim=4, out_visual_dim=4, in_text_dim=TEXT_DIM, in_text_dim2=POOLED, time_dim=8, patch_size=(1, 2, 2),
    model_dim=16, ff_dim=32, num_text_blocks=2, num_visual_blocks=4, axes_dims=(2, 2, 4), visual_cond=True,
    in_audio_dim=4, out_audio_dim=4, model_dim_a=8, time_dim_a=8, ff_dim_a=16, axes_dims_a=(2, 2, 4),
    text_token_padding=True, ca_rope=True, cross_gates=True, fix_modulation=True, visual_token_type_num_embeddings=2,
)


def kandinsky6_model(**overrides: Any) -> torch.nn.Module:
    from diffusers import Kandinsky6Transformer3DModel

    return Kandinsky6Transformer3DModel(**{**TINY, **overrides})


def joint_inputs(g: torch.Generator) -> dict:
    # text-to-video-and-audio: 2 latent frames of 4 x 4 (2 x 2 x 2 = 8 video tokens) with the visual_cond
    # channels (4 + 4 + 1), 5 audio latents, 6 prompt tokens
    return {
        "hidden_states": randn(g, 1, 2, 4, 4, 9, grad=True),
        "audio_hidden_states": randn(g, 1, AUDIO, 4, grad=True),
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM, grad=True),
        "pooled_projections": randn(g, 1, POOLED, grad=True),
        "timestep": torch.tensor([500.0]),
    }


def pipeline_batch_inputs(g: torch.Generator) -> dict:
    # two samples as Kandinsky6TI2VAPipeline batches them in image-to-video mode: a reference tail frame
    # (token type 1, RoPE position 0), the second prompt padded (key-padding mask), two timesteps
    mask = torch.ones(2, TEXT, dtype=torch.bool)
    mask[1, 4:] = False
    types = torch.zeros(2, 3, dtype=torch.long)
    types[:, -1] = 1
    return {
        "hidden_states": randn(g, 2, 3, 4, 4, 9, grad=True),
        "audio_hidden_states": randn(g, 2, AUDIO, 4, grad=True),
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
        "pooled_projections": randn(g, 2, POOLED, grad=True),
        "timestep": torch.tensor([300.0, 800.0]),
        "encoder_attention_mask": mask,
        "visual_token_type_ids": types,
        "visual_rope_pos": (torch.tensor([0, 1, 0]), torch.arange(2), torch.arange(2)),
    }


def video_only_inputs(g: torch.Generator) -> dict:
    x = joint_inputs(g)
    del x["audio_hidden_states"]
    return x


def _both(out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return out.sample, out.audio_sample


JOINT = Case("kandinsky6", kandinsky6_model, joint_inputs, output=_both)
PIPELINE_BATCH = Case("kandinsky6-i2va-batch", kandinsky6_model, pipeline_batch_inputs, output=_both)
VIDEO_ONLY = Case("kandinsky6-video-only", kandinsky6_model, video_only_inputs, output=lambda out: out.sample)


class TestKandinsky6(ConformanceSuite):
    case = JOINT
    quantized_bases = ("torchao-int8",)  # one base: the blocks hold plain nn.Linear layers only, as most do


class TestKandinsky6ImageToVideoBatch(ConformanceSuite):
    case = PIPELINE_BATCH
    reduced = True


_UNPATCHED: dict[str, Step] = {}


def _unpatched(case: Case) -> Step:
    """The unpatched step of ``case``, once per case (the kit's own reference cache serves check_strategy)."""
    if case.name not in _UNPATCHED:
        _UNPATCHED[case.name] = run_step(case.fresh(), case)
    return _UNPATCHED[case.name]


def _step_patched(case: Case, config: dict, expected: Step) -> list:
    """One patched step of ``case`` against ``expected``: exact, keeping less; the regions as they ran."""
    model = case.fresh()
    with cpu_test_mode(), gradseam.patch(model, config) as handle, record_regions(handle) as regions:
        got = run_step(model, case)
    assert_same_step(expected, got, what=f"{case.name} {config_id(config)}")
    assert got.saved_bytes < expected.saved_bytes, f"{case.name} {config_id(config)} kept no less"
    return regions


_AUDIO_SIDE = ("audio_dec_block.self_attention", "audio_dec_block.cross_attention", "va_cross_attention",
               "av_cross_attention")


@pytest.mark.parametrize("config", [CHUNKED, {**FFN, **OFFLOAD_ATTENTION}], ids=config_id)
def test_video_only_is_exact_and_idles_only_the_audio_regions(config: dict) -> None:
    # sample_audio=False: `aud` is None through every fused block. Chunks carry the None on and stay whole;
    # the audio seam and the audio and cross-modal attentions are never called, and nothing else idles.
    regions = _step_patched(VIDEO_ONLY, config, _unpatched(VIDEO_ONLY))
    idle = {r.label for r in regions if not r.ran}
    audio = {r.label for r in regions if r.label.endswith(("audio_dec_block.feed_forward", *_AUDIO_SIDE))}
    assert idle == audio and len(idle) == (0 if config == CHUNKED else 4 * (1 + len(_AUDIO_SIDE)))
    assert_regions_whole([r for r in regions if r.ran])


def test_interval_chunks_chain_in_all_three_lists_and_every_block_computes() -> None:
    # A wrong carry would still be exact (chunks fall back): every chunk must be served whole, with the
    # fresh (video_temb, audio_temb) tuple of every iteration seen as the same argument.
    report = check_strategy(JOINT, CHUNKED, whole=True)
    chunks = sorted(r.label for r in report.regions if r.shape == "chunk")
    assert chunks == sorted([f"{path}[0, 1]" for path in LISTS] + [f"{LISTS[2]}[2, 3]"])
    assert all(not r.fallbacks for r in report.regions)
    # Not vacuous: both text branches, both streams of every fused block and the cross-modal attentions get
    # gradients, and so do the latents of both modalities and the prompt.
    grads = report.patched.param_grads
    names = [f"{p}.{i}.feed_forward.net.0.proj.weight" for p in LISTS[:2] for i in range(2)]
    for i in range(4):
        names += [f"visual_transformer_blocks.{i}.{m}" for m in (
            "video_dec_block.feed_forward.net.0.proj.weight", "audio_dec_block.feed_forward.net.0.proj.weight",
            "va_cross_attention.to_key.weight", "av_cross_attention.to_key.weight")]
    for name in names:
        assert grads[name].abs().sum() > 0, name
    for name in ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "pooled_projections"):
        assert report.patched.input_grads[name].abs().sum() > 0, name


def test_seams_and_attention_are_planned_as_declared() -> None:
    model = JOINT.fresh()
    family = family_for(model)
    assert family.name == "kandinsky6"
    ffn = plan(model, family, gradseam.CheckpointConfig.coerce(FFN))
    fused = [("video_dec_block.feed_forward",), ("audio_dec_block.feed_forward",)]
    assert [(r.list_path, r.blocks, r.seam) for r in ffn.regions] == [
        (path, (i,), seam) for path in LISTS for i in range(4 if path == LISTS[2] else 2)
        for seam in (fused if path == LISTS[2] else [("feed_forward",)])
    ]
    by_class = {bc.name.rsplit(".", 1)[-1]: bc.attention for bc in family.block_classes}
    assert by_class == {
        "Kandinsky6TransformerEncoderBlock": ("attn",),
        "Kandinsky6FusedTransformerDecoderBlock": ("video_dec_block.self_attention", "video_dec_block.cross_attention",
                                                   *_AUDIO_SIDE),
    }


def test_diffusers_own_checkpointing_flag() -> None:
    check_builtin_flag(JOINT, CHUNKED)


# -- kandinsky6: the presets at full size ----------------------------------------------------------------
EXPECTED = {  # block counts per list, (video heads, video MLP, audio heads, audio MLP), parameters (billions)
    "pro-480p-5s": ((4, 4, 60), (32, 16384, 16, 7168), 30.1),
    "lite-480p-5s": ((2, 2, 32), (28, 7168, 14, 3584), 3.2),
}


@functools.cache
def _preset(name: str) -> tuple[Any, Any, torch.nn.Module]:
    return preset_model("kandinsky6", name)  # on meta: no weight is allocated


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_presets_plan_at_full_size(name: str) -> None:
    family, _, model = _preset(name)
    assert set(family.presets) == set(EXPECTED) and family_for(model) is family
    counts, widths, billions = EXPECTED[name]
    block = model.visual_transformer_blocks[0]
    assert (block.video_dec_block.self_attention.num_heads, block.video_dec_block.feed_forward.net[2].in_features,
            block.audio_dec_block.self_attention.num_heads,
            block.audio_dec_block.feed_forward.net[2].in_features) == widths
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == billions
    expected = dict(zip(LISTS, counts))
    for config, regions in ((ON, sum(counts)), (FFN, sum(counts) + counts[2]),
                            (CHUNKED, sum((n + 1) // 2 for n in counts))):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        blocks: dict[str, set[int]] = {}
        for region in the_plan.regions:
            blocks.setdefault(region.list_path, set()).update(region.blocks)
        assert {k: len(v) for k, v in blocks.items()} == expected and len(the_plan.regions) == regions


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    _, pro, model = _preset("pro-480p-5s")
    x = pro.make_inputs(model, "meta", torch.bfloat16, None, **pro.inputs)
    assert x["hidden_states"].shape == (1, 31, 60, 108, 33) and x["hidden_states"].requires_grad
    assert x["audio_hidden_states"].shape == (1, 218, 40) and x["audio_hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 1024, 3584) and x["pooled_projections"].shape == (1, 768)
    assert "encoder_attention_mask" not in x and "visual_token_type_ids" not in x
    fewer = pro.make_inputs(model, "meta", torch.bfloat16, 2 * 30 * 54, **pro.inputs)
    assert fewer["hidden_states"].shape[1] == 2 and fewer["audio_hidden_states"].shape[1] == 9
    i2va = pro.make_inputs(model, "meta", torch.bfloat16, None, **{**pro.inputs, "image": True, "audio": False,
                                                                    "prompt_tokens": 300})
    assert i2va["hidden_states"].shape[1] == 32 and "audio_hidden_states" not in i2va
    assert i2va["visual_token_type_ids"].shape == (1, 32) and i2va["encoder_attention_mask"].shape == (1, 1024)
    assert [p.shape[0] for p in i2va["visual_rope_pos"]] == [32, 30, 54]


@pytest.mark.parametrize("mode", [{}, {"image": True, "prompt_tokens": 4}, {"audio": False}],
                         ids=["t2va", "ti2va-padded", "video-only"])
def test_preset_input_builder_runs_the_model(mode: dict) -> None:
    family = gradseam.registry.REGISTRY.get("kandinsky6")
    model = JOINT.fresh()
    x = family.presets["pro-480p-5s"].make_inputs(model, "cpu", torch.float32, None, frames=5, height=32, width=32,
                                                   text_tokens=TEXT, **mode)
    out = model(**x)
    assert out.sample.shape == (*x["hidden_states"].shape[:4], 4)
    assert (out.audio_sample is None) == (mode.get("audio") is False)
    out.sample.square().mean().backward()
    assert x["hidden_states"].grad is not None
    if "prompt_tokens" in mode:
        assert x["encoder_attention_mask"].sum() == 4


def test_bench_workload_truncates_steps_and_patches_exactly() -> None:
    """`gradseam bench --family kandinsky6 --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload("kandinsky6", TINY, {"frames": 5, "height": 32, "width": 32, "text_tokens": TEXT},
                         preset="pro-480p-5s", sequence=2 * 2 * 2)


# -- kandinsky6-sr ------------------------------------------------------------------------------------------


@pytest.fixture
def flex_backward_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Lift torch's CPU check on flex attention's backward (a device check alone: its unfused eager path, a
    dense softmax over the block mask with its own backward, runs anyway, the same ops for the unpatched and
    the patched model), and silence its warning that the call is not compiled."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *args, **kwargs: None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile", UserWarning)
        yield


# 16 wide (2 heads of 8), 4 blocks. A sliding-tile prior of one block (the released one spans 11 x 7 x 7
# blocks, which at this size would cover every block and leave NABLA nothing to choose), so the block mask is
# the data-dependent NABLA selection.
SR_TINY = dict(in_visual_dim=4, out_visual_dim=4, time_dim=8, model_dim=16, ff_dim=32, num_visual_blocks=4,
               axes_dims=(2, 2, 4), nabla_window=(1, 1, 1))


def sr_model() -> torch.nn.Module:
    from diffusers import Kandinsky6SRTransformer3DModel

    model = Kandinsky6SRTransformer3DModel(**SR_TINY)
    torch.nn.init.normal_(model.pooled_bias, std=0.3)  # upstream's zeros (a folded constant) would hide it
    return model


def sr_inputs(g: torch.Generator) -> dict:
    # two tiles as the pipeline batches them (tiles_batch_size=2) at their own timesteps, each 2 latent frames
    # x 8 x 16 (4 NABLA blocks of 8 x 8 tokens) of noisy + anchor + mask channels. One shape for every SR test:
    # eager flex attention compiles its call once per shape.
    return {"hidden_states": randn(g, 2, 2, 8, 16, 9, grad=True), "timestep": torch.tensor([500.0, 200.0])}


SR = Case("kandinsky6-sr", sr_model, sr_inputs)

_MATRIX = cpu_configs() + offload_configs()
SR_FFN = pick(_MATRIX, {"gradient_checkpointing_backend": "torch-ffn", "gradient_checkpointing_interval": 2,
                        "gradient_checkpointing_segment_stride": 4},
              {"gradient_checkpointing_backend": "unsloth-ffn", **OFFLOAD_ATTENTION})


@pytest.mark.usefixtures("flex_backward_on_cpu")
class TestKandinsky6SR(ConformanceSuite):
    """The kit's rows that do not locate attention kernels: whole blocks and chunks (the compiled rows with
    ``-m compiled``), offloaded blocks, attention offload alone. The ``-ffn`` rows, and attention offloaded in
    whole blocks refused, are tested below."""

    case = SR
    configs = pick(cpu_configs(), {"gradient_checkpointing_backend": "torch"},
                   {"gradient_checkpointing_backend": "torch", "gradient_checkpointing_interval": 2,
                    "gradient_checkpointing_segment_stride": 4},
                   {"gradient_checkpointing_backend": "compile"})
    offload = [*pick(offload_configs(), {"gradient_checkpointing_backend": "unsloth", "gradient_checkpointing_interval": 2,
                                         "gradient_checkpointing_segment_stride": 4}),
               dict(OFFLOAD_ATTENTION),  # attention offload alone (pick() selects checkpointing rows)
               *pick(offload_configs(), {"gradient_checkpointing_backend": "unsloth-compile"})]
    quantized_bases = ()  # the kandinsky6 suite runs them on the same nn.Linear-only blocks

    def test_declaration_matches_the_model(self) -> None:
        """Every block planned; where flex attention runs is checked by ``test_sr_flex_attention_runs_...``
        (the kit's kernel locator cannot run flex attention)."""
        model = self.case.fresh()
        family = self.family()
        planned = plan(model, family, gradseam.CheckpointConfig(gradient_checkpointing=True))
        assert [r.blocks for r in planned.regions] == [(i,) for i in range(len(resolve(model, LISTS[2])))]


@pytest.mark.parametrize("config", SR_FFN, ids=config_id)
def test_sr_ffn_rows(config: dict, flex_backward_on_cpu: None) -> None:
    # What the kit's -ffn rows check, but the seams' regions counted here rather than by the kernel locator.
    regions = _step_patched(SR, config, _unpatched(SR))
    assert_regions_whole(regions)
    seams = (0, 1) if config.get("gradient_checkpointing_segment_stride") else range(4)  # interval 2 of stride 4
    assert {r.label for r in regions if r.shape == "ffn"} == {f"visual_transformer_blocks[{i}].feed_forward" for i in seams}


def test_sr_flex_attention_runs_once_per_block_inside_the_attention_side(
    monkeypatch: pytest.MonkeyPatch, flex_backward_on_cpu: None
) -> None:
    # The kit's check_declared_sides, for flex attention: every call runs inside a block's self_attention (the
    # attention side), none inside feed_forward (the seam). The NABLA masks it is given really select.
    import diffusers.models.transformers.transformer_kandinsky6_sr as upstream
    import torch.nn.attention.flex_attention as flex

    model = SR.fresh()
    where: list[str] = []
    seen: list[tuple[str, bool]] = []
    for i, block in enumerate(model.visual_transformer_blocks):
        for name in ("self_attention", "feed_forward"):
            label = f"{i}.{name}"
            getattr(block, name).register_forward_pre_hook(lambda m, a, label=label: where.append(label))
            getattr(block, name).register_forward_hook(lambda m, a, o: where.pop() and None)
    call, build = flex.flex_attention, upstream.nabla_block_mask

    def flex_attention(*args: Any, **kwargs: Any) -> Any:
        seen.append((where[-1] if where else "", False))
        return call(*args, **kwargs)

    def nabla_block_mask(*args: Any, **kwargs: Any) -> Any:
        mask = build(*args, **kwargs)
        seen.append(("mask", bool((mask.kv_num_blocks < mask.kv_num_blocks.new_tensor(4)).any())))
        return mask

    monkeypatch.setattr(flex, "flex_attention", flex_attention)
    monkeypatch.setattr(upstream, "nabla_block_mask", nabla_block_mask)
    run_step(model, SR)
    calls = [w for w, _ in seen if w != "mask"]
    assert calls == [f"{i}.self_attention" for i in range(4)]
    assert any(sparse for w, sparse in seen if w == "mask"), "every NABLA mask kept every block"


def test_sr_attention_offloaded_in_whole_blocks_is_refused(flex_backward_on_cpu: None) -> None:
    # Flex attention compiles its own call even when eager, which cannot run under the gate that keeps or
    # offloads kernel outputs inside a whole-block region: refused in forward, saying what to change (kept
    # attention, gradient_checkpointing_keep_attention, goes through the same gate and is refused the same way).
    model = SR.fresh()
    with cpu_test_mode(), gradseam.patch(model, {**ON, **OFFLOAD_ATTENTION}), pytest.raises(
            UnsupportedStrategyError, match=r"an attention submodule \(Kandinsky6\w*\) calls torch.compile inside its forward"):
        run_step(model, SR)
    assert gradseam.handle_of(model) is None
    assert_same_step(_unpatched(SR), run_step(model, SR), what="after the refusal")


@pytest.mark.parametrize("inside_dynamo", [True, False], ids=["dynamo-assertion", "attention-assertion"])
def test_sr_a_failure_inside_dynamo_under_the_gate_is_refused_the_same_way(
    monkeypatch: pytest.MonkeyPatch, inside_dynamo: bool
) -> None:
    """Torch 2.11 on an H100 (bench, Kandinsky 6 SR, unsloth + attention offload) failed an assertion inside
    dynamo ("Guard failed on the same frame it was created") where torch 2.13 raises a dynamo exception: the
    same refusal. An assertion the attention's own code raises is not dynamo's and passes through unchanged."""
    from torch.nn.attention import flex_attention as flex

    message = "Guard failed on the same frame it was created. This is a bug - please create an issue."
    module = "torch._dynamo.guards" if inside_dynamo else __name__  # the module whose code raises

    def failing(*args: Any, **kwargs: Any) -> Any:
        exec(f"raise AssertionError({message!r})", {"__name__": module})

    monkeypatch.setattr(flex, "flex_attention", failing)
    model = SR.fresh()
    expected = (UnsupportedStrategyError, r"calls torch.compile inside its forward.*AssertionError: Guard failed") \
        if inside_dynamo else (AssertionError, r"^Guard failed on the same frame")
    with cpu_test_mode(), gradseam.patch(model, {**ON, **OFFLOAD_ATTENTION}), pytest.raises(
            expected[0], match=expected[1]):
        run_step(model, SR)


def test_sr_diffusers_own_checkpointing_flag(flex_backward_on_cpu: None) -> None:
    check_builtin_flag(SR, CHUNKED)


@pytest.mark.parametrize("name", ["vsr-1.4b-512x512", "vsr-1.4b-512x768"])
def test_sr_presets_plan_at_full_size(name: str) -> None:
    family, preset, model = preset_model("kandinsky6-sr", name)
    assert family_for(model) is family and model.config.out_visual_dim == 640
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 1.41
    assert model.visual_transformer_blocks[0].self_attention.num_heads == 28
    for config, regions in ((ON, 32), (FFN, 32), (CHUNKED, 16)):
        assert len(plan(model, family, gradseam.CheckpointConfig.coerce(config)).regions) == regions
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    width = 48 if name.endswith("768") else 32
    assert x["hidden_states"].shape == (1, 31, 32, width, 129) and x["hidden_states"].requires_grad
    assert preset.make_inputs(model, "meta", torch.bfloat16, 2 * 32 * width, **preset.inputs)[
        "hidden_states"].shape[1] == 2


def test_sr_bench_workload_truncates_steps_and_patches_exactly(flex_backward_on_cpu: None) -> None:
    """`gradseam bench --family kandinsky6-sr --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload("kandinsky6-sr", SR_TINY, {"frames": 5, "height": 128, "width": 256, "batch": 2},
                         preset="vsr-1.4b-512x768", sequence=2 * 8 * 16)
