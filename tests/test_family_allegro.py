"""Allegro (AllegroTransformer3DModel) through the conformance kit, plus its presets.

The plain case (one right-padded prompt and the pipeline's RoPE tables, built by the preset's own
builder) runs the kit's whole matrix. A batch of two (own timesteps, prompts padded to different
lengths) and the model's optional video mask (a keep-mask over latent pixels, max-pooled to patches
and turned into a bias before the loop) run the reduced matrix. Then: the loop hands every block the
same conditioning (what the carry relies on), the FFN seam is ``ff`` alone on the modulated
``norm2`` output, the variant inputs change the output, diffusers' own checkpointing flag, and the
presets at full size with their real input builder.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from family_checks import (
    assert_ffn_seam_is_one_module,
    assert_plans_cover_every_block,
    prompt_mask,
    sample_output,
)

import gradseam
from gradseam.adapters.allegro import ALLEGRO_2_8B, rotary_emb
from gradseam.patcher import family_for
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_bench_workload,
    check_builtin_flag,
    preset_model,
    randn,
)

CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}

# 2 heads of 12 (24 wide: the RoPE gives each of frames, rows and columns a third of a head, 4 channels),
# T5 states 16 wide, 4 blocks. 2 latent frames of 4 x 4 in patches of 1 x 2 x 2: 8 video tokens.
TEXT = 6
TINY = {
    "patch_size": 2, "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 4, "out_channels": 4,
    "num_layers": 4, "cross_attention_dim": 24, "caption_channels": 16, "sample_height": 4, "sample_width": 4,
    "sample_frames": 2,
}


def allegro_model() -> torch.nn.Module:
    from diffusers import AllegroTransformer3DModel

    return AllegroTransformer3DModel(**TINY)


def _rope() -> tuple:
    # the pipeline's RoPE argument for 2 latent frames of 4 x 4, made by the preset's builder
    return rotary_emb(SimpleNamespace(**{**ALLEGRO_2_8B, **TINY}), 2, 4, 4, "cpu")


def allegro_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": randn(g, 1, 4, 2, 4, 4, grad=True),
        "encoder_hidden_states": randn(g, 1, TEXT, 16, grad=True),
        "timestep": torch.tensor([500.0]),
        "encoder_attention_mask": prompt_mask(TEXT, 4),
        "image_rotary_emb": _rope(),
    }


def allegro_batch_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": randn(g, 2, 4, 2, 4, 4, grad=True),
        "encoder_hidden_states": randn(g, 2, TEXT, 16, grad=True),
        "timestep": torch.tensor([150.0, 850.0]),
        "encoder_attention_mask": prompt_mask(TEXT, 6, 3),
        "image_rotary_emb": _rope(),
    }


def _video_mask() -> torch.Tensor:
    # (batch, frames, height, width) over latent pixels, 1 = keep: the second sample's last frame and the
    # first sample's right half of its first frame are padding (a patch is kept if any of its pixels is)
    mask = torch.ones(2, 2, 4, 4)
    mask[1, 1] = 0
    mask[0, 0, :, 2:] = 0
    return mask


def allegro_video_mask_inputs(g: torch.Generator) -> dict:
    return {**allegro_batch_inputs(g), "attention_mask": _video_mask()}


ALLEGRO = Case("allegro", allegro_model, allegro_inputs)
ALLEGRO_BATCH = Case("allegro-padded-batch", allegro_model, allegro_batch_inputs)
ALLEGRO_VIDEO_MASK = Case("allegro-video-mask", allegro_model, allegro_video_mask_inputs)


class TestAllegro(ConformanceSuite):
    case = ALLEGRO


class TestAllegroPaddedBatch(ConformanceSuite):
    case = ALLEGRO_BATCH
    reduced = True


class TestAllegroVideoMask(ConformanceSuite):
    case = ALLEGRO_VIDEO_MASK
    reduced = True


def test_variant_inputs_change_the_output() -> None:
    # each input the cases vary reaches the blocks: the RoPE, the prompt padding, the video mask
    plain = sample_output(ALLEGRO)
    assert not torch.equal(plain, sample_output(ALLEGRO, image_rotary_emb=None))
    assert not torch.equal(plain, sample_output(ALLEGRO, encoder_attention_mask=None))
    masked = sample_output(ALLEGRO_VIDEO_MASK)
    assert not torch.equal(masked, sample_output(ALLEGRO_VIDEO_MASK, attention_mask=None))
    batch = sample_output(ALLEGRO_BATCH)
    assert not torch.equal(batch[1], sample_output(ALLEGRO_BATCH, encoder_attention_mask=prompt_mask(TEXT, 6, 6))[1])


def test_the_loop_hands_every_block_the_same_conditioning() -> None:
    # What the carry relies on: temb, the text states, both biases and the caller's RoPE tuple are one
    # object each for every block; hidden_states is what the previous block returned.
    model = ALLEGRO_VIDEO_MASK.fresh()
    sig = inspect.signature(model.transformer_blocks[0].forward)
    seen: list[dict] = []
    returned: list[torch.Tensor] = []
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(lambda _m, a, kw: seen.append(sig.bind(*a, **kw).arguments), with_kwargs=True)
        block.register_forward_hook(lambda _m, _a, out: returned.append(out))
    inputs = allegro_video_mask_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(**inputs)
    assert len(seen) == 4 and seen[0]["image_rotary_emb"] is inputs["image_rotary_emb"]
    assert seen[0]["temb"].shape == (2, 6 * 24)
    assert seen[0]["attention_mask"].shape == (2, 1, 8)  # the video mask, pooled to patches, as a bias
    assert seen[0]["encoder_attention_mask"].shape == (2, 1, TEXT)
    for name in ("encoder_hidden_states", "temb", "attention_mask", "encoder_attention_mask", "image_rotary_emb"):
        assert all(kw[name] is seen[0][name] for kw in seen), name
    assert all(kw["hidden_states"] is out for out, kw in zip(returned, seen[1:]))


def test_the_ffn_seam_is_ff_on_the_modulated_norm2_output() -> None:
    # norm2 cannot join (ff sees its output scaled and shifted); norm3 is built but never called
    assert_ffn_seam_is_one_module(ALLEGRO, "allegro", FFN, blocks="transformer_blocks", ffn="ff", norm="norm2",
                                  never_called=("norm3",))
    assert not list(ALLEGRO.fresh().transformer_blocks[0].norm3.parameters())


def test_the_builtin_flag_is_exact_and_owned_by_gradseam() -> None:
    # diffusers' flag passes every argument positionally, in the order of the block's parameters
    check_builtin_flag(ALLEGRO_VIDEO_MASK, CHUNKED)


# -- presets at full size -----------------------------------------------------------------------

PRESETS = {"2.8b-88x720p": (22, 90, 160), "2.8b-40x720p": (10, 90, 160), "2.8b-40x360p": (10, 46, 80)}


def test_presets_plan_at_full_size() -> None:
    # the three checkpoints share one trunk: one config, planned once at full size on the meta device
    from diffusers import AllegroTransformer3DModel

    family, _, model = preset_model("allegro", "2.8b-88x720p")
    assert set(family.presets) == set(PRESETS) and family_for(model) is family
    assert all(dict(preset.config) == ALLEGRO_2_8B for preset in family.presets.values())
    params = set(inspect.signature(AllegroTransformer3DModel.__init__).parameters) - {"self"}
    assert set(ALLEGRO_2_8B) == params  # every constructor argument, spelled out
    assert 2.7e9 < sum(p.numel() for p in model.parameters()) < 2.8e9
    block = model.transformer_blocks[0]
    assert (len(model.transformer_blocks), block.attn1.heads, block.ff.net[0].proj.out_features) == (32, 24, 9216)
    assert_plans_cover_every_block(model, family, 32, (
        ({"gradient_checkpointing": True}, 32), (CHUNKED, 16), (FFN, 32)
    ))


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_inputs_have_the_pipelines_sizes(name: str) -> None:
    _, preset, model = preset_model("allegro", name)
    frames, h, w = PRESETS[name]
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 4, frames, h, w) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 512, 4096)
    assert x["encoder_attention_mask"].shape == (1, 512) and x["timestep"].shape == (1,)
    tables, positions = x["image_rotary_emb"]
    assert [cos.shape for cos, _ in tables] == [(frames, 32), (h // 2, 32), (w // 2, 32)]
    assert [p.shape for p in positions] == [(1, frames * h // 2 * w // 2)] * 3
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 4 * h // 2 * w // 2, **preset.inputs)
    assert fewer["hidden_states"].shape == (1, 4, 4, h, w)
    assert fewer["image_rotary_emb"][1][0].shape == (1, 4 * h // 2 * w // 2)


def test_preset_rope_is_the_pipelines() -> None:
    # the builder's RoPE argument, bit for bit what AllegroPipeline computes for the released config
    from diffusers import AllegroPipeline

    config = SimpleNamespace(**ALLEGRO_2_8B)
    pipe = SimpleNamespace(vae_scale_factor_spatial=8, transformer=SimpleNamespace(config=config))
    (ref_tables, ref_positions) = AllegroPipeline._prepare_rotary_positional_embeddings(pipe, 1, 368, 640, 10, "cpu")
    tables, positions = rotary_emb(config, 10, 46, 80, "cpu")
    assert all(torch.equal(a, b) for pair, ref in zip(tables, ref_tables) for a, b in zip(pair, ref))
    assert all(torch.equal(a, b) for a, b in zip(positions, ref_positions))


def test_preset_input_builder_runs_the_model() -> None:
    # the builder's inputs must be ones the model takes: the tiny model, at a tiny size, a short prompt
    preset = gradseam.registry.REGISTRY.get("allegro").presets["2.8b-88x720p"]
    model = ALLEGRO.fresh()
    x = preset.make_inputs(model, "cpu", torch.float32, frames=8, height=32, width=32, text_tokens=TEXT,
                           prompt_tokens=4)
    assert x["hidden_states"].shape == (1, 4, 2, 4, 4) and int(x["encoder_attention_mask"].sum()) == 4
    out = model(**x).sample
    assert out.shape == (1, 4, 2, 4, 4)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_and_patches_exactly() -> None:
    """`gradseam bench --family allegro --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload("allegro", TINY, {"frames": 8, "height": 32, "width": 32, "text_tokens": TEXT},
                         preset="2.8b-88x720p", sequence=2 * 2 * 2)
