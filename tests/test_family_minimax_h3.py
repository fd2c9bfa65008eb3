"""MiniMax-H3: a tiny deterministic model through the conformance kit on the packed text + audio +
video sequence (loss on both output heads), a keyframe-conditioned batch with a third noise level,
interval chunks that really chain in the refiner and the trunk, and the presets at full size."""

from __future__ import annotations

import torch

import gradseam
from gradseam.adapters.minimax_h3 import latent_frames, packed_layout
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_bench_workload,
    check_strategy,
    randn,
)

TEXT, AUDIO, FRAMES, GRID = 3, 4, 2, (1, 2)  # 3 text rows, 2 stereo audio latents, 2 frames of 1 x 2 patches
PATCH_DIM, AUDIO_DIM, TEXT_DIM = 16, 4, 12
REFINER, TRUNK = "token_refiner.refiner_blocks", "transformer_blocks"
CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}


# 3 heads x 8 = 24 attention channels over a 16-wide stream (the real model's 7168 over 5376);
# rope_freq_dim 1 rotates 6 of the 8 head channels, as the real one rotates 96 of 128
TINY = dict(
    num_attention_heads=3, attention_head_dim=8, hidden_size=16, num_layers=4, num_refiner_layers=4,
    ffn_dim=32, in_channels=4, audio_in_channels=AUDIO_DIM, text_dim=TEXT_DIM, freq_dim=16,
    time_embed_hidden_dim=16, time_embed_dim=8, rope_freq_dim=1,
)


def minimax_model():
    from diffusers import MiniMaxH3Transformer3DModel

    return MiniMaxH3Transformer3DModel(**TINY)


def _both(out) -> tuple[torch.Tensor, torch.Tensor]:
    return out.sample, out.audio_sample


def minimax_inputs(g: torch.Generator) -> dict:
    layout = packed_layout(TEXT, AUDIO, FRAMES, GRID, "cpu")
    return {
        "hidden_states": randn(g, 1, FRAMES * GRID[0] * GRID[1], PATCH_DIM, grad=True),
        "audio_hidden_states": randn(g, 1, AUDIO, AUDIO_DIM, grad=True),
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM, grad=True),
        **layout,
    }


def minimax_keyframe_inputs(g: torch.Generator) -> dict:
    # fl2va: a first-frame keyframe's latent rows right after the text, held at t = 0.999 (a third
    # distinct timestep), listed first among the video rows; two replicas of the request
    base = packed_layout(TEXT, AUDIO, FRAMES, GRID, "cpu")
    keyframe = GRID[0] * GRID[1]
    total = base["token_tags"].numel() + keyframe
    video = torch.cat([torch.arange(TEXT, TEXT + keyframe), base["video_indices"] + keyframe])
    audio = base["audio_indices"] + keyframe  # everything after the text moves down
    tags = torch.zeros(total, dtype=torch.long)
    tags[:TEXT], tags[audio] = 1, 2
    timestep_indices = torch.ones(total, dtype=torch.long)
    timestep_indices[audio], timestep_indices[TEXT:TEXT + keyframe] = 0, 2
    position_ids = torch.cat([base["position_ids"][:TEXT], base["position_ids"][-keyframe:],
                              base["position_ids"][TEXT:]])
    return {
        "hidden_states": randn(g, 2, video.numel(), PATCH_DIM, grad=True),
        "audio_hidden_states": randn(g, 2, AUDIO, AUDIO_DIM, grad=True),
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
        "timestep": torch.tensor([0.4, 0.7, 0.999]),
        "timestep_indices": timestep_indices,
        "token_tags": tags,
        "position_ids": position_ids,
        "video_indices": video,
        "audio_indices": audio,
        "text_indices": torch.arange(TEXT),
    }


MINIMAX_H3 = Case("minimax-h3", minimax_model, minimax_inputs, output=_both)
MINIMAX_H3_KEYFRAME = Case("minimax-h3-keyframe", minimax_model, minimax_keyframe_inputs, output=_both)


# -- The conformance kit ------------------------------------------------------------------------
BACKEND = "gradient_checkpointing_backend"


class TestMiniMaxH3(ConformanceSuite):
    case = MINIMAX_H3


class TestMiniMaxH3Keyframe(ConformanceSuite):
    case = MINIMAX_H3_KEYFRAME
    reduced = True


# -- What the suites cannot see -------------------------------------------------------------------

def test_layouts_are_consistent() -> None:
    for case in (MINIMAX_H3, MINIMAX_H3_KEYFRAME):
        x = case.inputs(torch.Generator().manual_seed(0))
        rows = torch.cat([x["text_indices"], x["video_indices"], x["audio_indices"]]).sort().values
        assert torch.equal(rows, torch.arange(x["token_tags"].numel())), case.name  # every row once
        assert x["token_tags"][x["video_indices"]].eq(0).all() and x["token_tags"][x["audio_indices"]].eq(2).all()
        assert x["hidden_states"].shape[1] == x["video_indices"].numel()


def test_interval_chunks_chain_in_both_lists() -> None:
    report = check_strategy(MINIMAX_H3_KEYFRAME, CHUNKED, whole=True)
    assert [r.label for r in report.regions if r.shape == "chunk"] == [
        f"{REFINER}[0, 1]", f"{REFINER}[2, 3]", f"{TRUNK}[0, 1]", f"{TRUNK}[2, 3]"
    ]


def test_ffn_seams() -> None:
    model = MINIMAX_H3.fresh()
    family = family_for(model)
    assert family.name == "minimax-h3"
    the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(
        {"gradient_checkpointing": True, BACKEND: "torch-ffn"}))
    assert [(r.list_path, r.seam) for r in the_plan.regions] == [
        *((REFINER, ("norm2", "ff")) for _ in range(4)), *((TRUNK, ("ff",)) for _ in range(4))
    ]


def test_layout_inputs_reach_the_blocks() -> None:
    # Audio and text get gradients through the chunked lists; the keyframe's own noise level and
    # the modality tags select other AdaLN rows and change both heads' output.
    report = check_strategy(MINIMAX_H3_KEYFRAME, CHUNKED)
    for name in ("hidden_states", "audio_hidden_states", "encoder_hidden_states"):
        assert report.patched.input_grads[name].abs().sum() > 0, name
    model = MINIMAX_H3_KEYFRAME.fresh()

    def out(**change) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return _both(model(**{**minimax_keyframe_inputs(torch.Generator().manual_seed(1)), **change}))

    video, audio = out()
    other_t = out(timestep=torch.tensor([0.4, 0.7, 0.7]))
    x = minimax_keyframe_inputs(torch.Generator().manual_seed(1))
    untagged = out(token_tags=torch.zeros_like(x["token_tags"]))
    for changed in (other_t, untagged):
        assert not torch.equal(video, changed[0]) and not torch.equal(audio, changed[1])


# -- Presets: the real-size config builds (on the meta device) and plans at full size -------------
def _meta_model():
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.device("meta"):
        return MiniMaxH3Transformer3DModel()


def test_presets_plan_at_full_size() -> None:
    family = next(f for f in gradseam.families() if f.name == "minimax-h3")
    assert set(family.presets) == {"33b-768p", "33b-480p"}
    model = _meta_model()
    assert family_for(model) is family
    assert 33.0e9 < sum(p.numel() for p in model.parameters()) < 33.3e9  # "33B transformer"
    for config, regions in (({"gradient_checkpointing": True}, 52), (CHUNKED, 1 + 25),
                            ({"gradient_checkpointing": True, BACKEND: "torch-ffn"}, 52)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        counts: dict[str, int] = {}
        for region in the_plan.regions:
            counts[region.list_path] = counts.get(region.list_path, 0) + len(region.blocks)
        assert counts == {REFINER: 2, TRUNK: 50} and len(the_plan.regions) == regions


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    assert [latent_frames(n) for n in (124, 121, 22, 362)] == [37, 37, 7, 107]
    family = next(f for f in gradseam.families() if f.name == "minimax-h3")
    model = _meta_model()
    for name, video_rows in (("33b-768p", 37 * 24 * 42), ("33b-480p", 37 * 15 * 26)):
        preset = family.presets[name]
        x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
        assert x["hidden_states"].shape == (1, video_rows, 96) and x["hidden_states"].requires_grad
        assert x["audio_hidden_states"].shape == (1, 2 * 207, 32) and x["audio_hidden_states"].requires_grad
        assert x["encoder_hidden_states"].shape == (1, 512, 5120)
        assert x["position_ids"].shape == (512 + 414 + video_rows, 3)
    full = family.presets["33b-768p"]
    more = full.make_inputs(model, "meta", torch.bfloat16, 2 * 1008, **full.inputs)
    assert more["video_indices"].numel() == 2 * 24 * 42


def test_preset_input_builder_runs_the_model() -> None:
    family = next(f for f in gradseam.families() if f.name == "minimax-h3")
    model = MINIMAX_H3.fresh()
    x = family.presets["33b-480p"].make_inputs(model, "cpu", torch.float32, None, frames=22, height=32, width=64,
                                               text_tokens=TEXT)
    video, audio = _both(model(**x))
    assert video.shape == (1, 7 * 2, PATCH_DIM) and audio.shape == (1, 2 * 37, AUDIO_DIM)
    (video.square().mean() + audio.square().mean()).backward()
    assert x["hidden_states"].grad is not None and x["audio_hidden_states"].grad is not None


def test_bench_workload_truncates_steps_and_patches_exactly() -> None:
    """`gradseam bench --family minimax-h3 --layers 2` on a tiny preset with the real input builder: the kit's check."""
    check_bench_workload("minimax-h3", TINY, {"frames": 22, "height": 32, "width": 64, "text_tokens": TEXT})
