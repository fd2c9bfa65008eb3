"""CogVideoX: tiny deterministic models through the conformance kit for the shapes the class takes
(CogVideoX-5B: 3-D RoPE, no positional embedding; CogVideoX-2B: sinusoidal positions, no RoPE, here
with two samples at their own timesteps; 5B-I2V: learned positional embedding, image latents as extra
channels; CogVideoX 1.5 I2V: 2x2x2 patches, the "slice" RoPE and the ``ofs`` embedding), interval
chunks that chain both streams, the loop handing every block the same conditioning, and the presets
at full size with their real input builder."""

from __future__ import annotations

import pytest
import torch
from family_checks import assert_plans_cover_every_block, check_chunks_run_whole

import gradseam
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_bench_workload,
    preset_model,
    randn,
)

TEXT, TEXT_DIM, HEAD = 6, 12, 16

# Head width 16: the RoPE splits it 4 + 6 + 6 over (frame, row, column); 2 heads, hidden 32 (the 3-D
# sinusoidal embedding needs a multiple of 16). Latents 4x4 in 2x2 patches, 2 latent frames: 8 video
# tokens. The positional embeddings assume max_text_seq_length text tokens, as the pipelines pad to it.
TINY = dict(
    num_attention_heads=2, attention_head_dim=HEAD, in_channels=4, out_channels=4, time_embed_dim=8,
    text_embed_dim=TEXT_DIM, num_layers=4, sample_width=4, sample_height=4, sample_frames=5, patch_size=2,
    max_text_seq_length=TEXT, use_rotary_positional_embeddings=True,
)
TINY_2B = dict(TINY, use_rotary_positional_embeddings=False)
TINY_I2V = dict(TINY, in_channels=8, use_learned_positional_embeddings=True)
TINY_15_I2V = dict(TINY, in_channels=8, patch_size_t=2, patch_bias=False, ofs_embed_dim=8)


def cogvideox_model(**config):
    from diffusers import CogVideoXTransformer3DModel

    return CogVideoXTransformer3DModel(**config)


def pipeline_rope(config: dict, frames: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``image_rotary_emb`` as ``CogVideoXPipeline._prepare_rotary_positional_embeddings`` builds it."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

    p, p_t = config["patch_size"], config.get("patch_size_t")
    grid = side // p
    base_h, base_w = config["sample_height"] // p, config["sample_width"] // p
    if p_t is None:
        crops = get_resize_crop_region_for_grid((grid, grid), base_w, base_h)
        return get_3d_rotary_pos_embed(config["attention_head_dim"], crops, (grid, grid), frames)
    return get_3d_rotary_pos_embed(config["attention_head_dim"], None, (grid, grid), (frames + p_t - 1) // p_t,
                                   grid_type="slice", max_size=(base_h, base_w))


def cogvideox_inputs(g: torch.Generator) -> dict:
    # CogVideoX-5B text-to-video: latents frames-first (B, F, C, H, W), padded T5 states, RoPE
    return {
        "hidden_states": randn(g, 1, 2, 4, 4, 4, grad=True),
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM, grad=True),
        "timestep": torch.tensor([500]),
        "image_rotary_emb": pipeline_rope(TINY, 2, 4),
    }


def cogvideox_2b_inputs(g: torch.Generator) -> dict:
    # CogVideoX-2B: no RoPE (its sinusoidal positions are added in patch_embed); two samples, own timesteps
    return {
        "hidden_states": randn(g, 2, 2, 4, 4, 4, grad=True),
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
        "timestep": torch.tensor([120, 870]),
    }


def cogvideox_i2v_inputs(g: torch.Generator) -> dict:
    # CogVideoX-5B-I2V: noisy and image latents concatenated on the channels, learned positions and RoPE
    return {**cogvideox_inputs(g), "hidden_states": randn(g, 1, 2, 8, 4, 4, grad=True)}


def cogvideox15_i2v_inputs(g: torch.Generator) -> dict:
    # CogVideoX1.5-5B-I2V: 4 latent frames in 2-frame patches (2 x 2 x 2 = 8 tokens), the "slice" RoPE
    # over the 2 temporal patches, and the ofs the pipeline passes (2.0)
    return {
        "hidden_states": randn(g, 1, 4, 8, 4, 4, grad=True),
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM, grad=True),
        "timestep": torch.tensor([500]),
        "ofs": torch.tensor([2.0]),
        "image_rotary_emb": pipeline_rope(TINY_15_I2V, 4, 4),
    }


COGVIDEOX = Case("cogvideox", lambda: cogvideox_model(**TINY), cogvideox_inputs)
COGVIDEOX_2B = Case("cogvideox-2b", lambda: cogvideox_model(**TINY_2B), cogvideox_2b_inputs)
COGVIDEOX_I2V = Case("cogvideox-i2v", lambda: cogvideox_model(**TINY_I2V), cogvideox_i2v_inputs)
COGVIDEOX15_I2V = Case("cogvideox1.5-i2v", lambda: cogvideox_model(**TINY_15_I2V), cogvideox15_i2v_inputs)
CASES = [COGVIDEOX, COGVIDEOX_2B, COGVIDEOX_I2V, COGVIDEOX15_I2V]


class TestCogVideoX(ConformanceSuite):
    case = COGVIDEOX


class TestCogVideoX2B(ConformanceSuite):
    case = COGVIDEOX_2B
    reduced = True


class TestCogVideoXI2V(ConformanceSuite):
    case = COGVIDEOX_I2V
    reduced = True


class TestCogVideoX15I2V(ConformanceSuite):
    case = COGVIDEOX15_I2V
    reduced = True


CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_interval_chunks_chain_both_streams(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back): both chunks must be served whole, and the
    # text stream, which leaves the last block unused, must still get its gradient through them.
    report = check_chunks_run_whole(case, CHUNKED, ["transformer_blocks[0, 1]", "transformer_blocks[2, 3]"])
    assert report.saved_ratio < 1
    assert report.patched.input_grads["encoder_hidden_states"].abs().sum() > 0


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_loop_hands_every_block_the_same_conditioning(case: Case) -> None:
    # What the carry relies on: temb (timestep plus ofs embedding), the RoPE tuple and attention_kwargs
    # are one object each for every block; the two streams are what the previous block returned.
    model = case.fresh()
    seen: list[dict] = []
    returned: list[tuple] = []
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(lambda _m, _a, kwargs: seen.append(kwargs), with_kwargs=True)
        block.register_forward_hook(lambda _m, _a, out: returned.append(out))
    inputs = case.inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(**inputs, attention_kwargs={})
    assert len(seen) == 4
    for name in ("temb", "image_rotary_emb", "attention_kwargs"):
        assert all(kw[name] is seen[0][name] for kw in seen), (case.name, name)
    assert (seen[0]["image_rotary_emb"] is None) == (case is COGVIDEOX_2B)
    for before, kw in zip(returned, seen[1:]):
        assert kw["hidden_states"] is before[0] and kw["encoder_hidden_states"] is before[1]


def test_variant_inputs_change_the_output() -> None:
    # The variants exercise their paths: the ofs embedding, the RoPE and the per-sample timesteps matter.
    def output(case: Case, **changes) -> torch.Tensor:
        model = case.fresh()
        with torch.no_grad():
            return model(**{**case.inputs(torch.Generator().manual_seed(1)), **changes}).sample

    assert not torch.equal(output(COGVIDEOX15_I2V), output(COGVIDEOX15_I2V, ofs=torch.tensor([1.0])))
    assert not torch.equal(output(COGVIDEOX), output(COGVIDEOX, image_rotary_emb=None))
    two = output(COGVIDEOX_2B)
    assert not torch.equal(two, output(COGVIDEOX_2B, timestep=torch.tensor([120, 120])))


def test_seam_and_attention_are_planned_as_declared() -> None:
    model = COGVIDEOX.fresh()
    family = family_for(model)
    assert family.name == "cogvideox"
    ffn = plan(model, family, gradseam.CheckpointConfig.coerce(
        gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn"))
    assert [(r.blocks, r.seam) for r in ffn.regions] == [((i,), ("ff",)) for i in range(4)]


# -- the presets at full size ----------------------------------------------------------------------
EXPECTED = {  # blocks, heads, FFN width, video tokens at the preset's size
    "2b-480p": (30, 30, 7680, 13 * 30 * 45),
    "5b-480p": (42, 48, 12288, 13 * 30 * 45),
    "1.5-5b-768p": (42, 48, 12288, 11 * 48 * 85),
    "1.5-5b-i2v-768p": (42, 48, 12288, 11 * 48 * 85),
}


def _preset_model(name: str):
    return preset_model("cogvideox", name)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_presets_plan_at_full_size(name: str) -> None:
    family, _, model = _preset_model(name)
    assert set(family.presets) == set(EXPECTED)
    assert family_for(model) is family
    layers, heads, ff, _ = EXPECTED[name]
    block = model.transformer_blocks[0]
    assert (len(model.transformer_blocks), block.attn1.heads, block.ff.net[0].proj.out_features) == (layers, heads, ff)
    assert_plans_cover_every_block(model, family, layers, (
        ({"gradient_checkpointing": True}, layers), (CHUNKED, layers // 2),
        ({"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}, layers)
    ))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_inputs_have_the_pipelines_sizes(name: str) -> None:
    _, preset, model = _preset_model(name)
    cfg = model.config
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    frames = 22 if cfg.patch_size_t else 13  # 1.5 pads 21 latent frames to a multiple of patch_size_t
    side = (96, 170) if cfg.patch_size_t else (60, 90)
    assert x["hidden_states"].shape == (1, frames, cfg.in_channels, *side) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 226, 4096)
    tokens = EXPECTED[name][3]
    if cfg.use_rotary_positional_embeddings:
        assert [t.shape for t in x["image_rotary_emb"]] == [(tokens, 64)] * 2
    else:
        assert "image_rotary_emb" not in x
    assert ("ofs" in x) == (cfg.ofs_embed_dim is not None)
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, tokens // 2, **preset.inputs)
    assert fewer["hidden_states"].shape[1] == (12 if cfg.patch_size_t else 6)


@pytest.mark.parametrize("case", [COGVIDEOX, COGVIDEOX15_I2V], ids=lambda c: c.name)
def test_preset_rope_is_the_pipelines_at_the_tiny_size(case: Case) -> None:
    from gradseam.adapters.cogvideox import rotary_embedding

    model = case.fresh()
    frames = 4 if model.config.patch_size_t else 2
    built = rotary_embedding(model, frames, 2, 2, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(built, pipeline_rope(dict(model.config), frames, 4)))


def test_preset_rope_is_the_pipelines_at_full_size() -> None:
    # CogVideoX 1.0 spreads the RoPE grid over the resized-and-cropped training grid: at 480p, and at a
    # smaller and a wider grid; 1.5 takes integer positions per temporal patch. Bit for bit the pipeline's.
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

    from gradseam.adapters.cogvideox import rotary_embedding

    _, _, v10 = _preset_model("5b-480p")
    for h, w in ((30, 45), (20, 20), (30, 60)):
        ref = get_3d_rotary_pos_embed(64, get_resize_crop_region_for_grid((h, w), 45, 30), (h, w), 13)
        assert all(torch.equal(a, b) for a, b in zip(rotary_embedding(v10, 13, h, w, "cpu"), ref))
    _, _, v15 = _preset_model("1.5-5b-768p")
    ref = get_3d_rotary_pos_embed(64, None, (48, 85), 11, grid_type="slice", max_size=(150, 150))
    assert all(torch.equal(a, b) for a, b in zip(rotary_embedding(v15, 22, 48, 85, "cpu"), ref))


@pytest.mark.parametrize(("case", "preset"), [(COGVIDEOX, "5b-480p"), (COGVIDEOX_2B, "2b-480p"),
                                              (COGVIDEOX15_I2V, "1.5-5b-i2v-768p")], ids=lambda v: getattr(v, "name", v))
def test_preset_input_builder_runs_the_model(case: Case, preset: str) -> None:
    family = gradseam.registry.REGISTRY.get("cogvideox")
    model = case.fresh()
    frames = 13 if model.config.patch_size_t else 5  # 4 latent frames for 1.5, 2 for 1.0
    x = family.presets[preset].make_inputs(model, "cpu", torch.float32, None, frames=frames, height=32, width=32)
    assert x["encoder_hidden_states"].shape == (1, TEXT, TEXT_DIM)
    out = model(**x).sample
    assert out.shape == x["hidden_states"].shape[:2] + (4, 4, 4)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


@pytest.mark.parametrize(("config", "preset", "frames", "tokens"), [
    (TINY, "5b-480p", 5, 8), (TINY_2B, "2b-480p", 5, 8), (TINY_15_I2V, "1.5-5b-i2v-768p", 13, 8)],
    ids=["5b", "2b", "1.5-i2v"])
def test_bench_workload_truncates_steps_and_patches_exactly(config: dict, preset: str, frames: int,
                                                            tokens: int) -> None:
    """`gradseam bench --family cogvideox --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload("cogvideox", config, {"frames": frames, "height": 32, "width": 32}, preset=preset,
                         sequence=tokens)
