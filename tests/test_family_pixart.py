"""PixArt-α / PixArt-Σ (PixArtTransformer2DModel) through the conformance kit, plus its presets.

The plain case (one image, one prompt padded as the pipelines pad it, with its keep-mask) runs the kit's whole
matrix. Reduced suites: a batch of two (own timesteps, prompts padded to different lengths), and the α-1024
model (size and aspect-ratio conditions) on a batch of two non-square latents, as multi-scale training feeds it.
Then: the chunks run whole, the loop hands every block the same conditioning, the prompt mask reaches the blocks,
the seam and the attention side are what the adapter declares (``dit``'s declaration), dropout inside the
blocks and feed-forward chunking stay exact, kept attention at the real prompt-to-image proportion through the kit (the short
prompt's cross-attention recomputed), no block's submodule runs outside its block (so weight streaming may
stream any block), diffusers' own checkpointing flag, and the presets at full size with their real input builder.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from family_checks import assert_plans_cover_every_block, record_block_calls

import gradseam
from gradseam.adapters import dit, pixart
from gradseam.offload import cpu_test_mode
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    assert_same_step,
    check_bench_workload,
    check_builtin_flag,
    check_declared_sides,
    check_strategy,
    count_kernels,
    preset_model,
    randn,
    run_step,
)

CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}

# 3 heads x 8 = 24 wide (the micro-conditions embed size and aspect ratio at width / 3 each), 4 blocks; an
# 8 x 8 latent in 2 x 2 patches: 16 image tokens; a 6-token prompt 12 wide, projected to the 24-wide stream.
TEXT, CAPTION, LAYERS = 6, 12, 4
TINY = dict(num_attention_heads=3, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=LAYERS,
            cross_attention_dim=24, sample_size=8, patch_size=2, caption_channels=CAPTION,
            use_additional_conditions=False)
TINY_MS = dict(TINY, use_additional_conditions=True)  # α-1024's micro-conditions
SLICES = 4  # feed-forward chunking: 16 tokens in slices of 4


def pixart_model(**config: object) -> torch.nn.Module:
    from diffusers import PixArtTransformer2DModel

    return PixArtTransformer2DModel(**{**TINY, **config})


def _mask(*valid: int) -> torch.Tensor:
    # the T5 tokenizer right-pads every prompt to max_sequence_length; the pipelines pass the 0/1 keep-mask
    mask = torch.zeros(len(valid), TEXT, dtype=torch.long)
    for row, n in enumerate(valid):
        mask[row, :n] = 1
    return mask


def pixart_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": randn(g, 1, 4, 8, 8, grad=True),
        "encoder_hidden_states": randn(g, 1, TEXT, CAPTION, grad=True),
        "encoder_attention_mask": _mask(3),
        "timestep": torch.tensor([500]),
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},  # as PixArtSigmaPipeline passes them
    }


def pixart_batch_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": randn(g, 2, 4, 8, 8, grad=True),
        "encoder_hidden_states": randn(g, 2, TEXT, CAPTION, grad=True),
        "encoder_attention_mask": _mask(TEXT, 2),
        "timestep": torch.tensor([37, 912]),
    }


def pixart_ms_inputs(g: torch.Generator) -> dict:
    # α at 1024: an aspect-ratio bucket (an 8 x 12 latent: 4 x 6 patches, positional embedding interpolated on
    # the fly), each image's [height, width] in pixels and height / width, as PixArtAlphaPipeline passes them
    return {
        **pixart_batch_inputs(g),
        "hidden_states": randn(g, 2, 4, 8, 12, grad=True),
        "added_cond_kwargs": {"resolution": torch.tensor([[64.0, 96.0], [64.0, 96.0]]),
                              "aspect_ratio": torch.tensor([[64 / 96], [64 / 96]])},
    }


def _reseed(_module: torch.nn.Module, _args: tuple) -> None:
    # Dropout draws from torch's global generator, which the kit's reference and patched steps reach at
    # different points: reseeding as the model's forward starts gives every step the same masks (recomputes
    # and chunks must still restore the generators exactly in between).
    torch.manual_seed(1234)


def _sample(out: object) -> torch.Tensor:
    return out.sample  # type: ignore[attr-defined]


PIXART = Case("pixart", pixart_model, pixart_inputs, output=_sample)
PIXART_BATCH = Case("pixart-batch", pixart_model, pixart_batch_inputs, output=_sample)
PIXART_MS = Case("pixart-alpha-ms", lambda: pixart_model(**TINY_MS), pixart_ms_inputs, output=_sample)


class TestPixArt(ConformanceSuite):
    case = PIXART


class TestPixArtBatch(ConformanceSuite):
    case = PIXART_BATCH
    reduced = True


class TestPixArtAlphaMicroConditions(ConformanceSuite):
    case = PIXART_MS
    reduced = True


# -- the carry -----------------------------------------------------------------------------------


def test_chunks_run_whole() -> None:
    # A wrong carry would still be exact (chunks fall back), so parity alone cannot tell: both chunks run whole.
    report = check_strategy(PIXART_BATCH, CHUNKED, whole=True)
    assert sorted(r.label for r in report.regions if r.shape == "chunk") == [
        "transformer_blocks[0, 1]", "transformer_blocks[2, 3]"
    ]
    assert report.saved_ratio < 1
    # the prompt mask reaches attn2 through the chunks: the second prompt's padding gets no gradient
    grads = report.patched.input_grads["encoder_hidden_states"]
    assert grads[0].abs().sum() > 0 and grads[1, :2].abs().sum() > 0
    assert torch.equal(grads[1, 2:], torch.zeros_like(grads[1, 2:]))


def test_the_loop_hands_every_block_the_same_conditioning() -> None:
    # What the carry relies on: the mask bias, the projected prompt, the timestep embedding and
    # cross_attention_kwargs are one object for every block, class_labels is None, and hidden_states is what
    # the previous block returned.
    model = PIXART_BATCH.fresh()
    seen, returned = record_block_calls(model.transformer_blocks)
    x = pixart_batch_inputs(torch.Generator().manual_seed(1))
    kwargs: dict = {}
    with torch.no_grad():
        model(**x, cross_attention_kwargs=kwargs)
    assert len(seen) == LAYERS
    first = seen[0]
    assert first["encoder_attention_mask"].shape == (2, 1, TEXT)  # the keep-mask, turned into a bias once
    assert first["timestep"].shape == (2, 6 * 24)  # adaln_single's output, not the caller's timestep
    for call in seen:
        for name in ("encoder_attention_mask", "encoder_hidden_states", "timestep"):
            assert call[name] is first[name], name
        assert call["cross_attention_kwargs"] is kwargs
        assert call["attention_mask"] is None and call["class_labels"] is None
    for before, call in zip(returned, seen[1:]):
        assert call["hidden_states"] is before


def test_the_prompt_mask_changes_the_output() -> None:
    # so the cases test the mask: masking the second prompt's last three tokens changes only its sample
    model = PIXART_BATCH.fresh()
    x = pixart_batch_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        masked = model(**x).sample
        unmasked = model(**{**x, "encoder_attention_mask": _mask(TEXT, TEXT)}).sample
    assert torch.equal(masked[0], unmasked[0]) and not torch.equal(masked[1], unmasked[1])


# -- the seams -----------------------------------------------------------------------------------


def test_the_declaration_is_dits() -> None:
    assert pixart.PIXART.block_classes == (dit.BASIC_BLOCK,)
    assert pixart.PIXART.has_ffn and pixart.PIXART.has_attention and pixart.PIXART.supports_interval


def test_the_seam_is_ff_and_the_attention_side_attn1_attn2() -> None:
    model = PIXART.fresh()
    family = family_for(model)
    assert family.name == "pixart"
    assert all(b.attn2 is not None and b.norm_type == "ada_norm_single" for b in model.transformer_blocks)
    the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.blocks, r.seam) for r in the_plan.regions] == [((i,), ("ff",)) for i in range(LAYERS)]
    sites = check_declared_sides(PIXART)  # every kernel inside attn1 or attn2, none inside ff
    assert sites.count == 2 * LAYERS and {s.module for s in sites.sites} == {"attn1", "attn2"}


def test_ffn_seams_run_whole_with_dropout_and_chunked_feed_forward() -> None:
    # dropout > 0 draws masks inside ff (and after each attention's output projection): the seam's recompute
    # must draw the same ones. With set_chunk_feed_forward ff runs once per slice, each call a region.
    def build() -> torch.nn.Module:
        model = pixart_model(dropout=0.25)
        for block in model.transformer_blocks:
            block.set_chunk_feed_forward(SLICES, 1)  # along the tokens
        model.register_forward_pre_hook(_reseed)
        return model

    case = Case("pixart-dropout-chunked-ff", build, pixart_batch_inputs, output=_sample)
    model = case.fresh()
    x = pixart_batch_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert not torch.equal(model(**x).sample, model.eval()(**x).sample)  # the masks are drawn
    report = check_strategy(case, FFN, whole=True)
    ff = [r for r in report.regions if r.shape == "ffn"]
    assert len(ff) == LAYERS and all(r.calls == (SLICES,) and r.runs == SLICES and r.whole for r in ff), ff
    assert check_strategy(case, CHUNKED, whole=True).saved_ratio < 1


def test_kept_attention_recomputes_a_short_prompts_cross_attention_and_the_kit_passes_it() -> None:
    # At the real sizes the prompt has fewer than a quarter as many tokens as the image (300 for 4096), and
    # gradseam keeps only kernels with at least that many keys: attn1's kernel is kept, attn2's recomputed. The
    # kit counts only the calls gradseam keeps, so this real proportion (3 prompt tokens for 16 image tokens)
    # passes it, exactly.
    def short(g: torch.Generator) -> dict:
        return {**pixart_batch_inputs(g), "encoder_hidden_states": randn(g, 2, 3, CAPTION, grad=True),
                "encoder_attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}

    case = Case("pixart-short-prompt", pixart_model, short, output=_sample)
    config = {"gradient_checkpointing": True, "gradient_checkpointing_keep_attention": True}
    check_strategy(case, config, whole=True)
    model, twin = case.twins()
    with count_kernels() as unpatched:
        expected = run_step(twin, case)
    with gradseam.patch(model, config), count_kernels() as patched:
        got = run_step(model, case)
    assert_same_step(expected, got)
    assert (unpatched[0], patched[0]) == (LAYERS, LAYERS)  # attn1's kernel, kept; attn2's is not counted


def test_no_block_submodule_runs_outside_its_block() -> None:
    # DiT's model calls transformer_blocks[0].norm1.emb after the loop, which rules out streaming block 0;
    # PixArt's final layer is the model's own, so every block may stream.
    model = PIXART_MS.fresh()
    inside: list[bool] = [False]
    outside: list[str] = []
    for index, block in enumerate(model.transformer_blocks):
        block.register_forward_pre_hook(lambda _m, _a: inside.__setitem__(0, True))
        block.register_forward_hook(lambda _m, _a, _o: inside.__setitem__(0, False))
        for name, sub in block.named_modules():
            if name:
                sub.register_forward_pre_hook(
                    lambda _m, _a, _n=f"{index}.{name}": None if inside[0] else outside.append(_n))
    with torch.no_grad():
        model(**pixart_ms_inputs(torch.Generator().manual_seed(1)))
    assert outside == []


def test_streaming_every_block_is_exact() -> None:
    def build() -> torch.nn.Module:
        model = pixart_model()
        model.requires_grad_(False)  # streaming moves frozen weights: the output layer trains, as a LoRA would
        model.proj_out.requires_grad_(True)
        return model

    case = Case("pixart-frozen", build, pixart_batch_inputs, output=_sample)
    with cpu_test_mode():
        check_strategy(case, {"gradient_checkpointing": True, "gradient_checkpointing_stream_weights": "all"})


def test_the_builtin_flag_is_exact_and_owned_by_gradseam() -> None:
    # diffusers' flag passes the block's arguments positionally, in the order of its parameters
    check_builtin_flag(PIXART_BATCH, CHUNKED)


# -- presets at full size ------------------------------------------------------------------------

# name: (latent side, prompt tokens, micro-conditions, positional-embedding interpolation scale)
PRESETS = {
    "alpha-xl-512": (64, 120, False, 1),
    "alpha-xl-1024": (128, 120, True, 2),
    "sigma-xl-512": (64, 300, False, 1),
    "sigma-xl-1024": (128, 300, False, 2),
    "sigma-xl-2k": (256, 300, False, 4),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_plan_at_full_size(name: str) -> None:
    from diffusers import PixArtTransformer2DModel

    family, preset, model = preset_model("pixart", name)
    side, _, micro, scale = PRESETS[name]
    assert set(family.presets) == set(PRESETS)
    assert family_for(model) is family
    params = set(inspect.signature(PixArtTransformer2DModel.__init__).parameters) - {"self"}
    assert set(preset.config) == params  # every constructor argument, spelled out
    # PixArt XL/2: 611M parameters (0.5M more for α-1024's size and aspect-ratio embedders)
    assert 6.10e8 < sum(p.numel() for p in model.parameters()) < 6.12e8
    block = model.transformer_blocks[0]
    shape = (len(model.transformer_blocks), block.attn1.heads, block.ff.net[0].proj.out_features,
             model.caption_projection.linear_1.in_features)
    assert shape == (28, 16, 4608, 4096)
    assert model.use_additional_conditions is micro and model.config.sample_size == side
    assert model.pos_embed.interpolation_scale == scale and model.proj_out.out_features == 2 * 2 * 8
    assert_plans_cover_every_block(model, family, 28, (
        ({"gradient_checkpointing": True}, 28), (CHUNKED, 14), (FFN, 28)
    ))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_inputs_have_the_training_sizes(name: str) -> None:
    _, preset, model = preset_model("pixart", name)
    side, text, micro, _ = PRESETS[name]
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 4, side, side) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, text, 4096)
    assert x["encoder_attention_mask"].shape == (1, text)
    assert x["timestep"].shape == (1,) and x["timestep"].dtype == torch.int64
    sizes = x["added_cond_kwargs"]
    if micro:
        assert sizes["resolution"].shape == (1, 2) and sizes["aspect_ratio"].shape == (1, 1)
    else:
        assert sizes == {"resolution": None, "aspect_ratio": None}
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 64, **preset.inputs)
    assert fewer["hidden_states"].shape == (1, 4, 16, 16)  # 8 x 8 patches of 2


def test_preset_input_builder_runs_the_model() -> None:
    # the α-1024 builder on the tiny micro-conditioned model: a non-square bucket, a batch, a padded prompt
    preset = gradseam.registry.REGISTRY.get("pixart").presets["alpha-xl-1024"]
    model = PIXART_MS.fresh()
    x = preset.make_inputs(model, "cpu", torch.float32, None, height=64, width=96, text_tokens=TEXT,
                           prompt_tokens=3, batch=3)
    assert x["added_cond_kwargs"]["resolution"].tolist() == [[64.0, 96.0]] * 3
    assert x["encoder_attention_mask"].sum().item() == 3 * 3 and x["timestep"].max() < 1000
    out = model(**x).sample
    assert out.shape == (3, 8, 8, 12)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


@pytest.mark.parametrize(("preset", "config"), [("sigma-xl-1024", TINY), ("alpha-xl-1024", TINY_MS)])
def test_bench_workload_truncates_and_patches_exactly(preset: str, config: dict) -> None:
    """`gradseam bench --family pixart --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload("pixart", config, {"height": 64, "width": 64, "text_tokens": TEXT},
                         preset=preset, sequence=4 * 4)
