"""gradseam.tools.advise: GPU size parsing, the ladder logic (with a fake measurer) and the real-size workloads."""

from __future__ import annotations

import json
import re

import pytest
import torch

from gradseam import UnsupportedStrategyError
from gradseam.errors import GradseamError
from gradseam.tools.advise import LADDER, Estimate, GiB, NoFitError, advise, run_ladder
from gradseam.tools.checks import parse_size
from gradseam.tools.compiled import compiles

# -- GPU sizes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "gib"),
    [
        ("40GiB", 40.0), ("40 GiB", 40.0), ("40gib", 40.0), ("40G", 40.0), ("40960MiB", 40.0),
        ("40 GB", 40e9 / GiB), ("1TiB", 1024.0), (42.5, 42.5), (40, 40.0), ("42.5", 42.5), (" 0.5 GiB ", 0.5),
    ],
)
def test_parse_size(text, gib):
    assert parse_size(text) == pytest.approx(gib)


@pytest.mark.parametrize("bad", ["", "GiB", "40 parsecs", "forty GiB", "-4GiB", "0", 0, -1.0, True, "4 0GiB", "inf"])
def test_parse_size_errors(bad):
    with pytest.raises(ValueError, match="GPU memory size"):
        parse_size(bad)


# -- the ladder ---------------------------------------------------------------------------------


def _key(config) -> tuple:
    return tuple(sorted((k, v) for k, v in config.items() if v not in (None, False)))


class FakeMeasure:
    """Deterministic peaks/times per config; ``table`` maps a label-ish key to (peak, ms) or an exception."""

    def __init__(self, by_label: dict[str, object], default=(100.0, 1.0)):
        self.by_config = {}
        self.default = default
        for label, config in LADDER:
            self.by_config[_key(config)] = by_label.get(label, default)
        self.extra = {k: v for k, v in by_label.items() if isinstance(k, tuple)}
        self.calls: list[dict] = []

    def __call__(self, config):
        self.calls.append(dict(config))
        key = _key(config)
        value = self.extra.get(key, self.by_config.get(key, self.default))
        if isinstance(value, BaseException):
            raise value
        return value


LADDER_VALUES = {
    "none": (60.0, 100.0),
    "torch-ffn": (40.0, 110.0),
    "torch": (20.0, 130.0),
    "unsloth-ffn": (30.0, 125.0),
    "unsloth": (5.0, 140.0),
    "attention offload": (45.0, 120.0),
    "torch-ffn + attention offload": (25.0, 128.0),
    "unsloth-ffn + attention offload": (18.0, 135.0),
}


def test_picks_off_when_it_fits():
    fake = FakeMeasure(LADDER_VALUES)
    advice = advise(None, {}, "80GiB", measure=fake, static_gib=10.0)
    assert advice.chosen.label == "none"
    assert advice.config == {"gradient_checkpointing": False}
    # no eager checkpointing can beat no checkpointing: after none, only the compiled rungs are measured
    compiled = [config for _, config in LADDER[1:] if compiles(config)]
    assert compiled and fake.calls == [{"gradient_checkpointing": False}, *compiled]
    eager = [t for t in advice.trials[1:] if not compiles(t.config)]
    assert eager and all(t.status == "not tried" and "eager checkpointing is not faster" in t.reason for t in eager)
    assert json.loads(advice.to_json()) == {"gradient_checkpointing": False}


def test_compiled_blocks_faster_than_no_checkpointing_win_where_it_fits():
    """Compiled blocks can beat eager no checkpointing (Flux dev 4k on the H200: compile 465 ms, none 484 ms, both
    predicted by auto's measurement); an advice that stopped at none once never measured them."""
    fake = FakeMeasure({**LADDER_VALUES, "compile": (8.0, 95.0)})
    advice = advise(None, {}, "80GiB", measure=fake, static_gib=10.0)
    assert advice.chosen.label == "compile"
    assert {"gradient_checkpointing": True, "gradient_checkpointing_backend": "compile"} in fake.calls


def test_fastest_fitting_rung_wins():
    # static 10: off (70) and attention offload (55) miss 50; torch-ffn (50) fits and is fastest
    advice = run_ladder(FakeMeasure(LADDER_VALUES), 50.0, 10.0, supports_interval=False)
    assert advice.chosen.label.startswith("torch-ffn")
    by = {t.label: t for t in advice.trials}
    assert by["none"].status == "over GPU memory"
    assert by["none"].reason == "over the GPU size by 20.00 GiB"
    assert by["attention offload"].reason == "over the GPU size by 5.00 GiB"
    assert "slower than chosen" in by["torch"].reason


def test_climbs_to_unsloth_when_needed():
    values = dict(LADDER_VALUES)
    fake = FakeMeasure(values, default=(50.0, 200.0))  # win-back strides keep too much
    advice = run_ladder(fake, 16.0, 10.0)
    assert advice.chosen.label == "unsloth"
    assert advice.config == {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"}
    by = {t.label: t for t in advice.trials}
    assert by["torch"].reason == "over the GPU size by 14.00 GiB"
    # win-back was tried on the unsloth backend and missed; sparser strides then skipped
    assert by["unsloth, interval 2"].status == "over GPU memory"
    assert by["unsloth, 3 of every 4 blocks"].status == "over GPU memory"
    assert by["unsloth, every other block"].status == "not tried"
    assert "denser setting" in by["unsloth, every other block"].reason


def test_interval_win_back():
    unsloth = dict(next(config for label, config in LADDER if label == "unsloth"))
    interval2 = {**unsloth, "gradient_checkpointing_interval": 2}
    stride2 = {**unsloth, "gradient_checkpointing_interval": 1, "gradient_checkpointing_segment_stride": 2}
    stride34 = {**unsloth, "gradient_checkpointing_interval": 3, "gradient_checkpointing_segment_stride": 4}
    stride4 = {**unsloth, "gradient_checkpointing_interval": 1, "gradient_checkpointing_segment_stride": 4}
    values = {
        **LADDER_VALUES,
        _key(interval2): (5.5, 138.0),
        _key(stride34): (6.0, 137.0),
        _key(stride2): (7.0, 120.0),
        _key(stride4): (9.0, 105.0),  # misses the budget
    }
    advice = run_ladder(FakeMeasure(values), 18.0, 10.0)
    assert advice.chosen.label == "unsloth, every other block"
    assert advice.config == stride2
    by = {t.label: t for t in advice.trials}
    assert by["unsloth"].reason == "fits, but slower than chosen (140.0 ms vs 120.0 ms)"
    assert by["unsloth, 1 of every 4 blocks"].reason == "over the GPU size by 1.00 GiB"


def test_no_interval_step_for_ffn_backends_or_unsupported_families():
    fake = FakeMeasure(LADDER_VALUES, default=(1000.0, 1.0))
    advice = run_ladder(fake, 50.0, 10.0)  # torch-ffn chosen: interval does not group FFN regions
    assert not any("interval 2" in t.label for t in advice.trials)
    fake = FakeMeasure(LADDER_VALUES, default=(1000.0, 1.0))
    advice = run_ladder(fake, 16.0, 10.0, supports_interval=False)
    assert advice.chosen.label == "unsloth"
    assert not any("interval 2" in t.label for t in advice.trials)


def test_an_out_of_memory_row_says_what_its_step_began_with_where_the_measuring_read_it():
    """A row that ran out of memory while the protocol measured it (:func:`gradseam.tools.measure.measure`, which reads
    the GPU's allocated memory before the first step) says so in its reason: out of memory beside 11.27 GiB that the
    step found is another finding than out of memory from its own activations."""
    from gradseam.tools.measure import BEGAN_WITH

    failed = torch.OutOfMemoryError("CUDA out of memory")
    setattr(failed, BEGAN_WITH, int(11.27 * 2**30))
    advice = run_ladder(FakeMeasure({**LADDER_VALUES, "none": failed}, default=(1000.0, 1.0)), 50.0, 10.0)
    by = {t.label: t for t in advice.trials}
    assert by["none"].status == "OOM"
    assert by["none"].reason == "out of memory while measuring (11.27 GiB allocated when its step began)"


def test_oom_and_unsupported_are_recorded():
    values = {
        **LADDER_VALUES,
        "none": torch.OutOfMemoryError("CUDA out of memory"),
        "attention offload": UnsupportedStrategyError("family 'x' has no attention submodules"),
    }
    advice = run_ladder(FakeMeasure(values, default=(1000.0, 1.0)), 50.0, 10.0)
    by = {t.label: t for t in advice.trials}
    assert by["none"].status == "OOM"
    assert by["none"].reason == "out of memory while measuring"
    assert by["attention offload"].status == "unsupported"
    assert "no attention submodules" in by["attention offload"].reason
    assert advice.chosen.label == "torch-ffn"
    assert "OOM" in advice.report() and "->" in advice.report()


def test_other_errors_propagate():
    with pytest.raises(KeyError):
        run_ladder(FakeMeasure({"none": KeyError("bug")}), 50.0)


def test_nothing_fits_says_by_how_much():
    with pytest.raises(NoFitError) as info:
        advise(None, {}, "12GiB", measure=FakeMeasure(LADDER_VALUES), static_gib=10.0)
    message = str(info.value)
    assert "smallest activation peak seen was 5.00 GiB (unsloth)" in message
    assert "nothing fits in 12.00 GiB of GPU memory" in message
    assert "3.00 GiB over the GPU size" in message and "budget" not in message
    assert "gradient_checkpointing_stream_weights" in message and "at least 3.00 GiB of the 10.00 GiB" in message
    assert info.value.advice.chosen is None
    assert len(info.value.advice.trials) == len(LADDER)
    with pytest.raises(GradseamError, match="nothing fits"):
        _ = info.value.advice.config


def test_activations_over_the_gpu_alone_do_not_suggest_streaming_weights():
    """Streaming frees weights only: when the activations alone are over the GPU, it would not help."""
    with pytest.raises(NoFitError) as info:
        advise(None, {}, "4GiB", measure=FakeMeasure(LADDER_VALUES), static_gib=0.5)
    assert "stream_weights" not in str(info.value)


STREAM = "gradient_checkpointing_stream_weights"


def _rung(label):
    return dict(next(config for name, config in LADDER if name == label))


def test_when_the_weights_do_not_fit_rungs_are_measured_again_with_the_fewest_blocks_streamed():
    """25 GiB of static memory on a 16 GiB card, 40 blocks of 0.5 GiB: only ``unsloth`` (5 GiB of activations)
    can fit once weights stream, with 30 blocks out (15 GiB, less two in flight: its 14 GiB shortfall). Its
    static memory is then 10 GiB and its pinned memory the activations' 2 GiB plus the streamed 15."""
    streamed = {**_rung("unsloth"), STREAM: 30}
    fake = FakeMeasure({**LADDER_VALUES, _key(streamed): Estimate(5.5, 150.0, 2.0)})
    advice = advise(None, {}, "16GiB", measure=fake, static_gib=25.0, block_gib=[0.5] * 40)
    assert advice.chosen.label == "unsloth + stream 30" and advice.config == streamed
    assert advice.chosen.pinned_gib == 17.0 and advice.chosen.reason == "15.00 GiB of frozen weights in host memory"
    tried = [t.label for t in advice.trials if STREAM in t.config]
    assert tried == ["unsloth + stream 30"], "rungs whose activations alone are over are not streamed"
    assert fake.calls[-1] == streamed, "streamed rungs are measured like any other; no win-back after them"
    assert json.loads(advice.to_json())[STREAM] == 30
    with pytest.raises(NoFitError) as info:  # the same, on a host that cannot pin 17 GiB
        advise(None, {}, "16GiB", measure=fake, static_gib=25.0, block_gib=[0.5] * 40, pinnable_gib=16.0)
    trial = next(t for t in info.value.advice.trials if t.label == "unsloth + stream 30")
    assert trial.status == "over host memory" and "17.0 GiB of pinned host memory (15.0 GiB of it streamed" in trial.reason
    assert "With frozen weights streamed from host memory nothing fitted either" in str(info.value)


def test_every_block_streams_when_nothing_less_frees_enough():
    fake = FakeMeasure({**LADDER_VALUES, _key({**_rung("unsloth"), STREAM: "all"}): (5.0, 160.0)})
    advice = run_ladder(fake, 16.0, 30.0, block_gib=[0.5] * 40)  # 19 GiB short: 20 GiB less one in flight
    assert advice.chosen.label == "unsloth + stream all" and advice.config[STREAM] == "all"


@pytest.mark.parametrize(("over", "want"), [(2.0, 5), (3.0, 6), (-1.0, 1), (4.0, 6), (5.0, None)])
def test_the_blocks_to_stream_are_counted_in_bytes_as_the_runtime_spreads_them(over, want):
    """Two 2 GiB blocks then four of 1 GiB: spread places blocks by size (five of the six are blocks 1 to 5), and the
    two largest picked stay on the GPU in flight, so 2 GiB needs five and 3 GiB all six."""
    from gradseam.tools.advise import blocks_to_stream

    assert blocks_to_stream([2, 2, 1, 1, 1, 1], over) == want


def test_a_streamed_count_is_scaled_to_the_depth_measured():
    from gradseam.tools.advise import stream_at_depth
    from gradseam.tools.depth import DepthPlan

    plan = DepthPlan({"transformer_blocks": 19, "single_transformer_blocks": 38})  # Flux: a unit is 1 + 2 blocks
    assert stream_at_depth({STREAM: 25}, plan, 2)[STREAM] == 3  # 25 of 57 is 2.6 of the 6 kept
    assert stream_at_depth({STREAM: 1}, plan, 1)[STREAM] == 1, "at least one"
    assert stream_at_depth({STREAM: "all"}, plan, 2) == {STREAM: "all"}
    assert stream_at_depth({"gradient_checkpointing": True}, plan, 2) == {"gradient_checkpointing": True}


def test_frozen_block_weights_are_read_per_block_and_extended_to_the_full_depth():
    from cases import FLUX

    from gradseam.patcher import family_for
    from gradseam.tools.advise import frozen_block_gib
    from gradseam.tools.depth import DepthPlan

    model = FLUX.fresh().requires_grad_(False)
    family = family_for(model)
    got = frozen_block_gib(model, family)
    double = sum(p.nbytes for p in model.transformer_blocks[0].parameters()) / GiB
    single = sum(p.nbytes for p in model.single_transformer_blocks[0].parameters()) / GiB
    assert got == [double] * len(model.transformer_blocks) + [single] * len(model.single_transformer_blocks)
    plan = DepthPlan({"transformer_blocks": 19, "single_transformer_blocks": 38})  # as if cut from the real depth
    assert frozen_block_gib(model, family, plan) == [double] * 19 + [single] * 38
    model.transformer_blocks[0].ff.net[2].weight.requires_grad_(True)  # trainable weights do not stream
    assert frozen_block_gib(model, family)[0] < double


def test_nothing_measurable():
    oom = torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(NoFitError, match="no strategy could be measured"):
        advise(None, {}, 40, measure=FakeMeasure({}, default=oom))


def test_to_dict_is_json():
    advice = run_ladder(FakeMeasure(LADDER_VALUES), 50.0, 10.0)
    data = json.loads(json.dumps(advice.to_dict()))
    assert data["gpu_gib"] == 50.0 and "budget_gib" not in data
    assert data["recommended"] == advice.config
    assert len(data["trials"]) == len(advice.trials)


def test_advise_needs_cuda_for_a_real_model():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only error")
    model = torch.nn.Linear(4, 4)  # the device check comes first, so any CPU module shows it
    with pytest.raises(GradseamError, match="needs the model on a CUDA GPU"):
        advise(model, {"input": torch.randn(2, 4)}, "40GiB")


def test_bad_gpu_size_fails_before_measuring():
    fake = FakeMeasure(LADDER_VALUES)
    with pytest.raises(ValueError, match="GPU memory size"):
        advise(None, {}, "lots", measure=fake)
    assert fake.calls == []


def test_gpu_is_the_gpu_size_and_budget_its_deprecated_name():
    """"budget" means the compiler's memory budget only: the GPU's size is ``gpu``; ``budget=`` still
    works, with a warning that names ``gpu``."""
    advice = advise(None, {}, gpu="80GiB", measure=FakeMeasure(LADDER_VALUES), static_gib=10.0)
    assert advice.gpu_gib == 80.0 and advice.report().startswith("GPU memory 80.00 GiB")
    with pytest.warns(DeprecationWarning, match="use gpu="):
        old = advise(None, {}, budget="80GiB", measure=FakeMeasure(LADDER_VALUES), static_gib=10.0)
    assert old.gpu_gib == 80.0 and old.chosen.label == advice.chosen.label
    with pytest.warns(DeprecationWarning, match="Advice.gpu_gib"):
        assert old.budget_gib == 80.0
    with pytest.raises(TypeError, match="give gpu only"):
        advise(None, {}, "80GiB", budget="80GiB", measure=FakeMeasure(LADDER_VALUES))
    with pytest.raises(TypeError, match="GPU memory size"):
        advise(None, {}, measure=FakeMeasure(LADDER_VALUES))


def test_the_ladder_is_derived_least_aggressive_first():
    """The ladder comes from the named strategies in the catalog's order: the eager backends (each with its
    kept-kernel variant), attention offload alone and beside each backend that takes it, the compiled
    backends from the largest memory budget to the smallest, the compiler alone, gradseam on compiled
    blocks. Interval and stride variants are the win-back's steps, not rungs."""
    assert [label for label, _ in LADDER] == [
        "none", "torch-ffn", "torch", "torch + attention kept", "unsloth-ffn", "unsloth", "attention offload",
        "torch-ffn + attention offload", "torch + attention offload", "unsloth-ffn + attention offload",
        "unsloth + attention offload", "compile", "unsloth-compile, budget 0.3", "unsloth-compile",
        "unsloth-compile, budget 0.05", "unsloth-compile, budget 0", "compile, memory budget 0.3",
        "compile, memory budget 0.1", "compile, memory budget 0.05", "compile, memory budget 0", "compiled: torch + attention kept", "compiled: unsloth + attention offload",
    ]
    assert LADDER[0][1] == {"gradient_checkpointing": False}


# -- real-size workloads (preset builders) ------------------------------------------------------


def _tiny(family, config, inputs):
    from dataclasses import replace

    from gradseam import Preset

    preset = family.presets[next(iter(family.presets))]
    return replace(family, presets={"tiny": Preset("tiny", config, inputs, preset.make_inputs)})


TINY = {
    "flux": (
        {"in_channels": 4, "num_layers": 2, "num_single_layers": 3, "attention_head_dim": 8,
         "num_attention_heads": 2, "joint_attention_dim": 16, "pooled_projection_dim": 8, "axes_dims_rope": [2, 2, 4]},
        {"image_tokens": 16, "text_tokens": 8},
    ),
    "flux2": (
        {"in_channels": 4, "num_layers": 2, "num_single_layers": 3, "attention_head_dim": 8, "num_attention_heads": 2,
         "joint_attention_dim": 16, "timestep_guidance_channels": 16, "axes_dims_rope": [2, 2, 2, 2]},
        {"image_tokens": 16, "text_tokens": 6},
    ),
    "qwenimage": (
        {"in_channels": 8, "out_channels": 2, "num_layers": 3, "attention_head_dim": 8, "num_attention_heads": 2,
         "joint_attention_dim": 16, "axes_dims_rope": [2, 2, 4]},
        {"image_tokens": 16, "text_tokens": 6},
    ),
    "wan": (
        {"num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 4, "out_channels": 4, "text_dim": 16,
         "freq_dim": 16, "ffn_dim": 32, "num_layers": 3, "rope_max_seq_len": 32},
        {"frames": 5, "height": 32, "width": 32},
    ),
    "chroma": (
        {"patch_size": 1, "in_channels": 4, "num_layers": 2, "num_single_layers": 3, "attention_head_dim": 8,
         "num_attention_heads": 2, "joint_attention_dim": 16, "axes_dims_rope": [2, 2, 4],
         "approximator_num_channels": 8, "approximator_hidden_dim": 16, "approximator_layers": 1},
        {"image_tokens": 16, "text_tokens": 8},
    ),
    "krea2": (
        {"in_channels": 4, "num_layers": 3, "attention_head_dim": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 48, "timestep_embed_dim": 16, "text_hidden_dim": 16, "num_text_layers": 3,
         "text_num_attention_heads": 2, "text_num_key_value_heads": 1, "text_intermediate_size": 32,
         "num_layerwise_text_blocks": 2, "num_refiner_text_blocks": 2, "axes_dims_rope": [2, 2, 4]},
        {"image_tokens": 16, "text_tokens": 6},
    ),
    "zimage": (
        {"in_channels": 4, "dim": 32, "n_layers": 3, "n_refiner_layers": 2, "n_heads": 2, "n_kv_heads": 2,
         "cap_feat_dim": 16, "axes_dims": [4, 6, 6], "axes_lens": [256, 16, 16]},
        {"image_tokens": 16, "text_tokens": 7},
    ),
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_workload_builds_truncates_and_steps(name):
    from gradseam.tools.checks import find_family
    from gradseam.tools.measure import forward_backward, grad_leaves
    from gradseam.tools.workloads import build, sequence_length

    family = _tiny(find_family(name), *TINY[name])
    workload = build(family, "tiny", layers=1, device="cpu", dtype=torch.float32)
    assert workload.truncated and all(kept == 1 for kept, _ in workload.truncated.values())
    assert "layers truncated" in workload.label(16)
    assert not any(p.requires_grad for p in workload.model.parameters())
    inputs = workload.inputs()
    leaves = grad_leaves(inputs)
    assert leaves and all(t.dtype == torch.float32 for t in leaves)
    assert sequence_length(workload.model, workload.family, inputs) > 0
    forward_backward(workload.model, inputs)()
    assert all(t.grad is not None for t in leaves)
    assert workload.inputs(tokens=64) is not None


def test_every_builtin_preset_has_an_input_builder():
    import gradseam

    for family in gradseam.families():
        for name, preset in family.presets.items():
            assert preset.make_inputs is not None, (family.name, name)


def test_unknown_family_and_preset():
    from gradseam.tools.checks import find_family, find_preset
    from gradseam.tools.workloads import build

    with pytest.raises(GradseamError, match="no installed family 'nope'"):
        find_family("nope")
    with pytest.raises(GradseamError, match="has no preset 'x'.*dev-1024"):
        find_preset(find_family("flux"), "x")
    import diffusers

    if not hasattr(diffusers, "MageFlowTransformer2DModel"):
        with pytest.raises(GradseamError, match="can be imported from the installed diffusers"):
            build("mageflow", device="meta")


def test_advise_and_bench_name_a_configuration_alike():
    """A user reading `gradseam advise` next to `gradseam bench` finds each candidate under its row's name."""
    from gradseam.tools.advise import LADDER
    from gradseam.tools.bench_rows import real_rows

    def key(config):  # "gradient_checkpointing: False" is what an absent key means
        return json.dumps({k: v for k, v in (config or {}).items() if (k, v) != ("gradient_checkpointing", False)},
                          sort_keys=True)

    rows = real_rows()
    assert ("none", None) in rows  # the hand-written references carry no config; "none" is the empty one
    bench = {key(config): label for label, config in rows if config is not None} | {key({}): "none"}
    for label, config in LADDER:  # every rung of the ladder is also a bench row
        assert bench.get(key(config)) in (label, "ref: " + label), (label, bench.get(key(config)))


def test_workload_on_a_quantized_base_trains_only_its_lora():
    """``build(base=, lora=)`` (bench's --base/--lora): the blocks' Linear weights quantized in place and
    stored smaller, a LoRA on the attention projections the only trainable parameters, and a step
    reaches them; the label says both."""
    pytest.importorskip("torchao")
    pytest.importorskip("peft")
    from gradseam.tools.bases import weight_bytes
    from gradseam.tools.checks import find_family
    from gradseam.tools.measure import forward_backward
    from gradseam.tools.workloads import blocks, build

    family = _tiny(find_family("flux"), *TINY["flux"])
    plain = build(family, "tiny", device="cpu", dtype=torch.float32)
    workload = build(family, "tiny", device="cpu", dtype=torch.float32, base="torchao-int8", lora=4)
    kept = blocks(workload.model, family)
    assert type(kept[0].attn.to_q.base_layer.weight).__name__ == "Int8Tensor"
    assert sum(map(weight_bytes, kept)) < sum(map(weight_bytes, blocks(plain.model, family)))
    trainable = {n for n, p in workload.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert workload.label(16).endswith("torchao-int8, LoRA r=4)")
    forward_backward(workload.model, workload.inputs())()
    assert all(p.grad is not None for n, p in workload.model.named_parameters() if n in trainable)


# -- a two-depth line that cannot be right ---------------------------------------------------------


def _scripted_depths(monkeypatch, times: dict[tuple[int, int], float]) -> list[tuple[int, int]]:
    """``measure_once`` replaced: each (depth, steps) call returns its scripted step time (the peak grows with
    depth); returns the calls made, in order."""
    from gradseam.tools import advise as advise_module
    from gradseam.tools.measure import Measurement

    calls: list[tuple[int, int]] = []

    def once(model, inputs, config, depth, loss_fn=None, *, family, plan, device="cuda", steps=1):
        calls.append((depth, steps))
        return Measurement(peak_gib=0.5 * depth, step_ms=times[depth, steps], pinned_gib=0.0)

    monkeypatch.setattr(advise_module, "measure_once", once)
    return calls


def _two_depths(device: str = "cuda"):
    from cases import FLUX

    from gradseam.tools.advise import depth_measure

    model = FLUX.fresh()
    measure, _ = depth_measure(model, {}, device=device, depths=(2, 4), target=19)
    return measure


def test_a_deeper_step_timed_faster_is_timed_again_and_the_second_line_is_used(monkeypatch):
    """One step each said depth 4 ran faster than depth 2 (a line falling with depth would predict the full model
    faster than either): both depths are timed again over three steps, and their line is the estimate."""
    calls = _scripted_depths(monkeypatch, {(2, 1): 230.0, (4, 1): 207.0, (2, 3): 100.0, (4, 3): 160.0})
    got = _two_depths()({"gradient_checkpointing": True})
    assert calls == [(2, 1), (4, 1), (2, 3), (4, 3)]
    assert got.unit_costs.step_ms == pytest.approx(30.0)  # (160 - 100) / 2 per unit
    assert got.step_ms == pytest.approx(40.0 + 30.0 * 19)


def test_a_step_that_never_grows_with_depth_is_refused_with_both_times(monkeypatch):
    _scripted_depths(monkeypatch, {(2, 1): 230.0, (4, 1): 207.0, (2, 3): 221.0, (4, 3): 221.0})
    with pytest.raises(UnsupportedStrategyError) as raised:
        _two_depths()({"gradient_checkpointing": True})
    message = str(raised.value)
    assert "221.0 ms at depth 2 and 221.0 ms at depth 4" in message
    assert "median of 3 steps" in message and "gradseam advise --depths" in message


def test_a_step_that_grows_with_depth_is_timed_once_per_depth(monkeypatch):
    calls = _scripted_depths(monkeypatch, {(2, 1): 100.0, (4, 1): 160.0})
    assert _two_depths()({"gradient_checkpointing": True}).unit_costs.step_ms == pytest.approx(30.0)
    assert calls == [(2, 1), (4, 1)]


def test_the_cpu_measures_saved_bytes_and_does_not_time_again(monkeypatch):
    """On the CPU a row's figure is what it saves for backward; a tiny model's step time is within the noise."""
    calls = _scripted_depths(monkeypatch, {(2, 1): 230.0, (4, 1): 207.0})
    _two_depths("cpu")({"gradient_checkpointing": True})
    assert calls == [(2, 1), (4, 1)]


def test_the_planner_records_a_refused_line_as_unsupported_with_its_reason(monkeypatch):
    """What ``auto`` caches for such a row: its reason, so the plan leaves it out instead of trusting the line."""
    from gradseam.tools.auto_planner import _Rows

    _scripted_depths(monkeypatch, {(2, 1): 230.0, (4, 1): 207.0, (2, 3): 221.0, (4, 3): 220.0})
    measure = _two_depths()

    class Request:
        model = torch.nn.Linear(1, 1)
        streamed = False

    rows = _Rows(Request(), lambda request: (measure, "depths 2 and 4", 0.0))  # type: ignore[arg-type]
    got = rows.one("torch", {"gradient_checkpointing": True})
    assert isinstance(got, str) and got.startswith("unsupported: its step did not take longer with more blocks")


def test_each_candidate_is_reported_as_it_starts_and_as_it_ends_with_its_seconds():
    """A large model's ladder takes minutes: ``progress`` hears each candidate's label as it starts and how it
    ended (measured, out of memory, unsupported) with its own seconds and the running total."""
    values = {**LADDER_VALUES, "torch-ffn": torch.OutOfMemoryError("CUDA out of memory"),
              "unsloth-ffn": UnsupportedStrategyError("no FFN seam")}
    heard: list[tuple[str, bool]] = []
    advise(None, {}, 50.0, measure=FakeMeasure(values), static_gib=10.0, progress=lambda line, done: heard.append(
        (line, done)))
    started = [line for line, done in heard if not done]
    ended = [line for line, done in heard if done]
    assert started[:3] == ["measuring none at two depths", "measuring torch-ffn at two depths",
                           "measuring torch at two depths"]
    assert len(started) == len(ended) and heard[0][1] is False and heard[1][1] is True
    assert re.fullmatch(r"none: measured in \d+\.\d s \(1 candidates, \d+ s so far\)", ended[0]), ended[0]
    assert ended[1].startswith("torch-ffn: out of memory in ")
    assert next(line for line in ended if line.startswith("unsloth-ffn:")).startswith("unsloth-ffn: unsupported in ")


def test_a_streamed_rung_and_a_config_off_the_ladder_are_labelled():
    from gradseam.tools.advise import label_of

    torch_rung = dict(LADDER)["torch"]
    assert label_of({**torch_rung, STREAM: 12}) == "torch + stream 12"
    assert label_of(torch_rung) == "torch"
    assert label_of({"gradient_checkpointing": True, "made_up": 1}) == "{'gradient_checkpointing': True, 'made_up': 1}"


def test_sequence_length_stops_before_the_last_lists_first_block_runs():
    """bench's probe of the token count needs only each list's first block's input: the forward stops there, so a
    model whose blocks cannot run eagerly at the preset's size (Kandinsky 6 SR's flex attention asked for 236 GiB
    on an H100) is still measured. Flux: the double list runs whole, the single list's first block never does."""
    from gradseam.tools.checks import find_family
    from gradseam.tools.workloads import build, resolve, sequence_length

    family = _tiny(find_family("flux"), *TINY["flux"])
    workload = build(family, "tiny", layers=2, device="cpu", dtype=torch.float32)
    inputs = workload.inputs()
    ran: list[str] = []
    hooks = [block.register_forward_hook(lambda m, a, o, name=f"{lst.path}.{i}": ran.append(name))
             for lst in family.block_lists for i, block in enumerate(resolve(workload.model, lst.path))]
    lengths: list[int] = []
    for lst in family.block_lists:  # what each list's first block sees, read from a whole forward
        first = resolve(workload.model, lst.path)[0]
        hooks.append(first.register_forward_pre_hook(
            lambda m, a, k: lengths.append(max(k["hidden_states"].shape[:-1])), with_kwargs=True))
    with torch.no_grad():
        workload.model(**inputs)
    whole, lengths_seen = list(ran), list(lengths)
    ran.clear()
    lengths.clear()
    assert sequence_length(workload.model, workload.family, inputs) == max(lengths_seen)
    assert ran == [name for name in whole if name.startswith("transformer_blocks.")]  # no single block ran
    assert len(whole) > len(ran)
    for h in hooks:
        h.remove()


def test_a_candidate_the_compiler_refuses_is_one_unsupported_rung_not_the_end_of_the_ladder(monkeypatch):
    """``gradseam advise`` on Flux dev stopped at its twentieth candidate, 160 s in (an H200), when inductor refused a
    ``compiled: unsloth + attention offload`` graph: a compiled candidate the compiler refuses is now unsupported, with
    the compiler's first line, and the ladder goes on. A failure of the same name where nothing compiles is not the
    compiler's to excuse, and propagates."""
    from cases import WAN

    from gradseam.patcher import family_for
    from gradseam.tools import measure as measuring
    from gradseam.tools.advise import measure_once
    from gradseam.tools.compiled import budget_config
    from gradseam.tools.depth import plan_for

    class BackendCompilerFailed(Exception):  # torch._dynamo.exc's, matched by name as gradseam matches it
        inner_exception = RuntimeError("Found a custom (non-ATen) operator whose output has alias annotations: "
                                       "aten::record_stream\nWhile executing %record_stream")

    def refused(step, **kwargs):
        raise BackendCompilerFailed("backend='inductor' raised: RuntimeError: ...")

    monkeypatch.setattr(measuring, "measure", refused)
    model = WAN.fresh()
    family = family_for(model)
    plan = plan_for(model, family)
    inputs = WAN.inputs(torch.Generator().manual_seed(0))
    with pytest.raises(UnsupportedStrategyError, match=r"torch.compile could not compile its blocks \(RuntimeError: "
                                                       r"Found a custom \(non-ATen\) operator .*record_stream\)$"):
        measure_once(model, inputs, budget_config(0.1), 1, family=family, plan=plan, device="cpu")
    with pytest.raises(BackendCompilerFailed):
        measure_once(model, inputs, {"gradient_checkpointing": True}, 1, family=family, plan=plan, device="cpu")


@pytest.mark.parametrize("fails", [False, True], ids=["measured", "out-of-memory"])
def test_a_candidate_that_leaves_gpu_memory_allocated_stops_the_ladder_before_any_later_rung_is_measured(
        monkeypatch, fails):
    """As ``auto``'s rows (tests/test_auto.py): every rung is measured from the memory the first found, so one that
    leaves some of its own allocated on the GPU would have every later rung measured beside it and the advice compare
    rungs that did not start alike. On the GPU path ``advise`` stops at it, naming the rung and the figures."""
    from cases import WAN

    from gradseam.tools import advise as advise_module
    from gradseam.tools import measure as measuring

    levels = iter([1.0, 1.0, 1.0, 10.0])  # GiB allocated beside the model's state: before and after each rung
    monkeypatch.setattr(measuring, "allocated_beside", lambda model: int(next(levels) * 2**30))
    fake = FakeMeasure({**LADDER_VALUES, LADDER[1][0]: torch.OutOfMemoryError("CUDA out of memory.")} if fails
                       else LADDER_VALUES)
    monkeypatch.setattr(advise_module, "_gpu_measure", lambda *args: (fake, "depths 1 and 2", 0.0, True))
    model = WAN.fresh()
    with pytest.raises(GradseamError) as raised:
        advise(model, WAN.inputs(torch.Generator().manual_seed(1)), "40GiB", block_gib=[], pinnable_gib=64.0)
    failed = " after it ran out of memory" if fails else ""
    assert (f"gradseam advise: measuring {LADDER[1][0]}{failed} left 9.00 GiB allocated on the GPU that was not before "
            "it (1.00 GiB before, 10.00 GiB after its memory was released)") in str(raised.value)
    assert "no advice is given from candidates measured so" in str(raised.value)
    assert [_key(c) for c in fake.calls] == [_key(LADDER[0][1]), _key(LADDER[1][1])]  # nothing after it measured


def test_a_candidate_that_gives_back_what_it_allocated_is_not_stopped(monkeypatch):
    """The check's other side: a few MiB left behind (a cuBLAS workspace, compiled kernels' state) is under its
    threshold, and every rung is measured."""
    from cases import WAN

    from gradseam.tools import advise as advise_module
    from gradseam.tools import measure as measuring

    grow = iter(range(0, 10**9, 1 << 20))  # 1 MiB more at each read
    monkeypatch.setattr(measuring, "allocated_beside", lambda model: next(grow))
    fake = FakeMeasure(LADDER_VALUES)
    monkeypatch.setattr(advise_module, "_gpu_measure", lambda *args: (fake, "depths 1 and 2", 0.0, True))
    advice = advise(WAN.fresh(), WAN.inputs(torch.Generator().manual_seed(1)), "40GiB", block_gib=[],
                    pinnable_gib=64.0)
    assert len(fake.calls) > 2 and advice.chosen is not None


def test_a_candidate_that_fails_otherwise_ends_the_ladder_as_its_own_error_not_as_memory_left_behind(monkeypatch):
    """A failure that is neither out of memory nor a refusal ends the ladder (``_try`` raises it again): it must reach
    the user as itself, not as a reading of the GPU memory its traceback still holds."""
    from cases import WAN

    from gradseam.tools import advise as advise_module
    from gradseam.tools import measure as measuring

    levels = iter([1.0, 1.0, 1.0, 10.0, 10.0])
    monkeypatch.setattr(measuring, "allocated_beside", lambda model: int(next(levels) * 2**30))
    fake = FakeMeasure({**LADDER_VALUES, LADDER[1][0]: RuntimeError("a bug in the model's forward")})
    monkeypatch.setattr(advise_module, "_gpu_measure", lambda *args: (fake, "depths 1 and 2", 0.0, True))
    with pytest.raises(RuntimeError, match="a bug in the model's forward"):
        advise(WAN.fresh(), WAN.inputs(torch.Generator().manual_seed(1)), "40GiB", block_gib=[], pinnable_gib=64.0)


def test_a_refused_candidate_that_leaves_gpu_memory_allocated_stops_the_ladder_too(monkeypatch):
    """A refused rung is recorded and the ladder goes on past it, so what it left is read as a measured rung's is."""
    from cases import WAN

    from gradseam.tools import advise as advise_module
    from gradseam.tools import measure as measuring

    levels = iter([1.0, 1.0, 1.0, 10.0])
    monkeypatch.setattr(measuring, "allocated_beside", lambda model: int(next(levels) * 2**30))
    fake = FakeMeasure({**LADDER_VALUES, LADDER[1][0]: UnsupportedStrategyError("the compiler refused it")})
    monkeypatch.setattr(advise_module, "_gpu_measure", lambda *args: (fake, "depths 1 and 2", 0.0, True))
    with pytest.raises(GradseamError, match=f"gradseam advise: measuring {re.escape(LADDER[1][0])} left 9.00 GiB"):
        advise(WAN.fresh(), WAN.inputs(torch.Generator().manual_seed(1)), "40GiB", block_gib=[], pinnable_gib=64.0)
    assert len(fake.calls) == 2
