"""Ideogram 4: a tiny deterministic model through the conformance kit on the pipeline's packed
``[left pad][text][image]`` sequence, a packed batch of two prompts with per-token timesteps, the
unconditional transformer's image-only sequence, interval chunks that really chain, and the presets
at full size."""

from __future__ import annotations

import pytest
import torch
from family_checks import assert_plans_cover_every_block

import gradseam
from gradseam.adapters.ideogram4 import packed_layout
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_bench_workload,
    check_strategy,
    randn,
    reduced_configs,
    reduced_offload_configs,
)

GRID, MAX_TEXT, LAYERS = 2, 6, 4  # 2 x 2 image tokens after 6 text slots
CHANNELS, FEATURES = 4, 12
CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}


# head 8 = 2 x (2 t + 1 h + 1 w) MRoPE frequencies
TINY = dict(
    in_channels=CHANNELS, num_layers=LAYERS, attention_head_dim=8, num_attention_heads=2, intermediate_size=32,
    adaln_dim=8, llm_features_dim=FEATURES, mrope_section=(2, 1, 1),
)


def ideogram4_model():
    from diffusers import Ideogram4Transformer2DModel

    return Ideogram4Transformer2DModel(**TINY)


def ideogram4_inputs(g: torch.Generator, prompts: tuple[int, ...] = (4,), max_text: int = MAX_TEXT) -> dict:
    position_ids, segment_ids, indicator = packed_layout(list(prompts), GRID, max_text, "cpu")
    batch, length = indicator.shape
    return {
        "hidden_states": randn(g, batch, length, CHANNELS, grad=True),
        "timestep": torch.linspace(0.3, 0.7, batch),
        "encoder_hidden_states": randn(g, batch, length, FEATURES, grad=True),
        "position_ids": position_ids,
        "segment_ids": segment_ids,
        "indicator": indicator,
    }


def ideogram4_packed_inputs(g: torch.Generator) -> dict:
    # two prompts of different lengths (different left padding) and one timestep per token
    inputs = ideogram4_inputs(g, prompts=(6, 3))
    inputs["timestep"] = torch.rand(inputs["indicator"].shape, generator=g)
    return inputs


def ideogram4_unconditional_inputs(g: torch.Generator) -> dict:
    # the pipeline's unconditional pass: image tokens only, zeroed text features
    inputs = ideogram4_inputs(g, prompts=(0,), max_text=0)
    inputs["encoder_hidden_states"] = torch.zeros_like(inputs["encoder_hidden_states"])
    return inputs


IDEOGRAM4 = Case("ideogram4", ideogram4_model, ideogram4_inputs)
IDEOGRAM4_PACKED = Case("ideogram4-packed", ideogram4_model, ideogram4_packed_inputs)
IDEOGRAM4_UNCONDITIONAL = Case("ideogram4-unconditional", ideogram4_model, ideogram4_unconditional_inputs)


# -- The conformance kit ------------------------------------------------------------------------
BACKEND, STRIDE = "gradient_checkpointing_backend", "gradient_checkpointing_segment_stride"


class TestIdeogram4(ConformanceSuite):
    case = IDEOGRAM4


class TestIdeogram4Packed(ConformanceSuite):
    case = IDEOGRAM4_PACKED
    reduced = True


class TestIdeogram4Unconditional(ConformanceSuite):
    case = IDEOGRAM4_UNCONDITIONAL
    # the zeroed prompt through chunks and offloaded FFN seams: one row each
    configs = reduced_configs(ffn=False, kept=False)
    offload = reduced_offload_configs(blocks=False, attention=False)


# -- What the suites cannot see -------------------------------------------------------------------

def test_layout_is_the_pipelines() -> None:
    position_ids, segment_ids, indicator = packed_layout([4, 6], GRID, MAX_TEXT, "cpu")
    assert indicator[0].tolist() == [0, 0, 3, 3, 3, 3, 2, 2, 2, 2]
    assert segment_ids[0].tolist() == [-1, -1] + [1] * 8 and segment_ids[1].eq(1).all()
    assert position_ids[0, 2:6, 0].tolist() == [0, 1, 2, 3] and position_ids[1, :6, 2].tolist() == list(range(6))
    assert position_ids[0, 6:].tolist() == [[65536, 65536 + r, 65536 + c] for r in range(2) for c in range(2)]


@pytest.mark.parametrize("case", [IDEOGRAM4, IDEOGRAM4_PACKED], ids=lambda c: c.name)
def test_interval_chunks_chain(case: Case) -> None:
    report = check_strategy(case, {**CHUNKED, STRIDE: None}, whole=True)
    assert [r.label for r in report.regions if r.shape == "chunk"] == ["layers[0, 1]", "layers[2, 3]"]


def test_plan_has_the_ffn_seam_in_every_block() -> None:
    model = IDEOGRAM4.fresh()
    family = family_for(model)
    assert family.name == "ideogram4"
    ffn = plan(model, family, gradseam.CheckpointConfig.coerce({"gradient_checkpointing": True, BACKEND: "torch-ffn"}))
    assert [(r.blocks, r.seam) for r in ffn.regions] == [((i,), ("feed_forward", "ffn_norm2")) for i in range(LAYERS)]


def test_packing_inputs_reach_the_blocks() -> None:
    # The text features reach the output through the chunked blocks only at text slots (the model
    # zeroes the rest), the segments keep padding out of the sample's attention, and per-token
    # timesteps give every token its own modulation.
    report = check_strategy(IDEOGRAM4_PACKED, CHUNKED)
    grad = report.patched.input_grads["encoder_hidden_states"]
    _, _, indicator = packed_layout([6, 3], GRID, MAX_TEXT, "cpu")
    text = indicator == 3
    assert (grad[text].abs().sum(-1) > 0).all() and grad[~text].eq(0).all()
    model = IDEOGRAM4_PACKED.fresh()

    def out(**change) -> torch.Tensor:
        with torch.no_grad():
            return model(**{**ideogram4_packed_inputs(torch.Generator().manual_seed(1)), **change}).sample

    full = out()
    assert not torch.equal(full, out(segment_ids=torch.ones_like(indicator)))
    assert not torch.equal(full, out(timestep=torch.tensor([0.5, 0.5])))


# -- Presets: the real-size config builds (on the meta device) and plans at full size -------------
def _meta_model():
    from diffusers import Ideogram4Transformer2DModel

    with torch.device("meta"):
        return Ideogram4Transformer2DModel()


def test_presets_plan_at_full_size() -> None:
    family = next(f for f in gradseam.families() if f.name == "ideogram4")
    assert set(family.presets) == {"1024", "2048"}
    model = _meta_model()
    assert family_for(model) is family
    block = model.layers[0]
    assert (block.attention.num_heads, block.attention.head_dim, block.feed_forward.w1.out_features) == (18, 256, 12288)
    params = sum(p.numel() for p in model.parameters())
    assert 9.2e9 < params < 9.4e9  # "9.3B"
    for preset in family.presets.values():
        assert preset.config == {}
        assert_plans_cover_every_block(model, family, 34, (
            ({"gradient_checkpointing": True}, 34), (CHUNKED, 17),
            ({"gradient_checkpointing": True, BACKEND: "torch-ffn"}, 34)
        ))


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    family = next(f for f in gradseam.families() if f.name == "ideogram4")
    model = _meta_model()
    for name, image_tokens in (("1024", 4096), ("2048", 16384)):
        preset = family.presets[name]
        x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
        assert x["hidden_states"].shape == (1, 2048 + image_tokens, 128) and x["hidden_states"].requires_grad
        assert x["encoder_hidden_states"].shape == (1, 2048 + image_tokens, 53248)
        assert x["position_ids"].shape == (1, 2048 + image_tokens, 3)
    small = family.presets["1024"].make_inputs(model, "meta", torch.bfloat16, 1024)
    assert small["hidden_states"].shape[1] == 2048 + 1024


def test_preset_input_builder_runs_the_model() -> None:
    family = next(f for f in gradseam.families() if f.name == "ideogram4")
    model = IDEOGRAM4.fresh()
    x = family.presets["1024"].make_inputs(model, "cpu", torch.float32, 9, text_tokens=5, prompt_tokens=3)
    assert x["indicator"][0].tolist() == [0, 0, 3, 3, 3] + [2] * 9
    out = model(**x).sample
    out.square().mean().backward()
    assert x["hidden_states"].grad[:, 5:].abs().sum() > 0 and x["hidden_states"].grad[:, :5].eq(0).all()


def test_bench_workload_truncates_steps_and_patches_exactly() -> None:
    """`gradseam bench --family ideogram4 --layers 2` on a tiny preset with the real input builder: the kit's check."""
    check_bench_workload("ideogram4", TINY, {"image_tokens": 4, "text_tokens": MAX_TEXT, "prompt_tokens": 4})
