"""Cosmos Predict: tiny deterministic models through the conformance kit for the four shapes the class
takes (Predict 2 Video2World: a condition channel and a timestep per frame; Cosmos 1.0: a learnable
positional embedding, padded text, two samples; Transfer 2.5: projected Reason1 states, an image
context and ControlNet residuals; Anima: one latent frame, no fps, the text conditioner's zero-padded
output), interval chunks that chain (and fall back exactly where the ControlNet hands blocks their own
residuals), and the presets at full size.

The tiny models set ``concat_padding_mask=False``: the class default resizes ``padding_mask`` with
torchvision, which this environment lacks; it only adds an input channel before the blocks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from family_checks import assert_plans_cover_every_block, check_chunks_run_whole

import gradseam
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    assert_regions_whole,
    assert_same_step,
    check_bench_workload,
    check_strategy,
    preset_model,
    randn,
    record_regions,
    run_step,
)

TEXT, TEXT_DIM = 6, 16

# Head width 12: the RoPE splits it 4 + 4 + 4 over (frame, row, column); 2 heads, hidden 24.
TINY = dict(
    in_channels=5, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=4, mlp_ratio=2.0,
    text_embed_dim=TEXT_DIM, adaln_lora_dim=8, max_size=(8, 16, 16), patch_size=(1, 2, 2),
    rope_scale=(1.0, 3.0, 3.0), concat_padding_mask=False, extra_pos_embed_type=None,
)
TRANSFER = dict(
    TINY, num_layers=6, use_crossattn_projection=True, crossattn_proj_in_channels=20,
    encoder_hidden_states_channels=TEXT_DIM, controlnet_block_every_n=4, img_context_dim_in=10,
    img_context_num_tokens=3, img_context_dim_out=24,
)

# Anima's flags (diffusers' Cosmos-2.0-Diffusion-2B-Text2Image config, which scripts/convert_anima_to_diffusers.py
# uses): latent channels in and out alike (no condition channel), RoPE scale (1, 4, 4), no learnable embedding.
ANIMA = dict(TINY, in_channels=4, rope_scale=(1.0, 4.0, 4.0))


def cosmos_model(**overrides):
    from diffusers import CosmosTransformer3DModel

    model = CosmosTransformer3DModel(**{**TINY, **overrides})
    if model.learnable_pos_embed is not None:  # upstream starts it at zero: make it matter
        for p in model.learnable_pos_embed.parameters():
            torch.nn.init.normal_(p)
    return model


def cosmos_inputs(g: torch.Generator) -> dict:
    # Predict 2 Video2World: 2 latent frames x 4 x 4 (8 tokens in 1x2x2 patches), the first frame the
    # conditioning one (mask channel 1, its own near-zero timestep), 6 T5 tokens, fps for the RoPE
    mask = torch.zeros(1, 1, 2, 4, 4)
    mask[:, :, 0] = 1.0
    return {
        "hidden_states": randn(g, 1, 4, 2, 4, 4, grad=True),
        "timestep": torch.tensor([0.0001, 0.6]).view(1, 1, 2, 1, 1),
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM, grad=True),
        "condition_mask": mask,
        "fps": 16,
    }


def cosmos_v1_inputs(g: torch.Generator) -> dict:
    # Cosmos 1.0 Text2World: two samples at their own timesteps, the second prompt padded (text mask)
    mask = torch.ones(2, TEXT, dtype=torch.bool)
    mask[1, -2:] = False
    return {
        "hidden_states": randn(g, 2, 4, 2, 4, 4, grad=True),
        "timestep": torch.tensor([0.3, 0.8]),
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
        "attention_mask": mask,
        "fps": 24,
    }


def cosmos_transfer_inputs(g: torch.Generator) -> dict:
    # Transfer 2.5: projected text states and an image context as one tuple, and the ControlNet's
    # residuals for blocks 0 and 4 (every 4th block)
    inputs = cosmos_inputs(g)
    inputs["encoder_hidden_states"] = (randn(g, 1, TEXT, 20, grad=True), randn(g, 1, 3, 10, grad=True))
    inputs["block_controlnet_hidden_states"] = [randn(g, 1, 8, 24) for _ in range(2)]
    return inputs


def anima_inputs(g: torch.Generator) -> dict:
    # Anima's pipeline: one latent frame of 4 x 6 (6 tokens in 1x2x2 patches), one timestep (the sigma), no
    # fps, and AnimaTextConditioner's output: 4 prompt tokens, zero-padded (to 512 in the real model)
    text = randn(g, 1, TEXT, TEXT_DIM)
    text[:, 4:] = 0.0
    return {
        "hidden_states": randn(g, 1, 4, 1, 4, 6, grad=True),
        "timestep": torch.tensor([0.6]),
        "encoder_hidden_states": text.requires_grad_(),
        "padding_mask": torch.zeros(1, 1, 32, 48),
    }


COSMOS = Case("cosmos", cosmos_model, cosmos_inputs)
COSMOS_V1 = Case("cosmos-1.0", lambda: cosmos_model(in_channels=4, rope_scale=(2.0, 1.0, 1.0),
                                                    extra_pos_embed_type="learnable"), cosmos_v1_inputs)
COSMOS_TRANSFER = Case("cosmos-transfer", lambda: cosmos_model(**TRANSFER), cosmos_transfer_inputs)
COSMOS_ANIMA = Case("cosmos-anima", lambda: cosmos_model(**ANIMA), anima_inputs)


class TestCosmos(ConformanceSuite):
    case = COSMOS


class TestCosmos1(ConformanceSuite):
    case = COSMOS_V1
    reduced = True


class TestCosmosAnima(ConformanceSuite):
    case = COSMOS_ANIMA
    reduced = True


class TestCosmosTransfer(ConformanceSuite):
    case = COSMOS_TRANSFER
    reduced = True
    whole_regions = False  # chunks meeting a ControlNet residual compute block by block, on purpose


CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}


@pytest.mark.parametrize("case", [COSMOS, COSMOS_V1], ids=lambda c: c.name)
def test_interval_chunks_chain(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back): both chunks must be served whole.
    check_chunks_run_whole(case, CHUNKED, ["transformer_blocks[0, 1]", "transformer_blocks[2, 3]"])


def test_controlnet_residuals_make_only_their_chunks_fall_back() -> None:
    # Residuals reach blocks 0 and 4: the chunks holding them compute block by block (exactly), the
    # chunk in between, whose blocks both get None, still runs whole.
    report = check_strategy(COSMOS_TRANSFER, CHUNKED)
    chunks = {r.label: r for r in report.regions if r.shape == "chunk"}
    assert sorted(chunks) == [f"transformer_blocks[{i}, {i + 1}]" for i in (0, 2, 4)]
    assert chunks["transformer_blocks[0, 1]"].fallbacks and chunks["transformer_blocks[4, 5]"].fallbacks
    assert chunks["transformer_blocks[2, 3]"].whole
    # the residuals matter: without them the output differs
    plain = Case("cosmos-transfer-plain", COSMOS_TRANSFER.build, lambda g: {
        **cosmos_transfer_inputs(g), "block_controlnet_hidden_states": None})
    torch.manual_seed(0)
    assert not torch.equal(run_step(plain.build(), plain).outputs[0], report.reference.outputs[0])


def test_the_loop_hands_blocks_one_context_and_their_own_residuals() -> None:
    seen = []
    model = COSMOS_TRANSFER.fresh()
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(lambda _m, args: seen.append(args))
    with torch.no_grad():
        model(**cosmos_transfer_inputs(torch.Generator().manual_seed(1)))
    contexts = [args[1] for args in seen]
    assert isinstance(contexts[0], tuple) and all(c is contexts[0] for c in contexts)
    assert [args[7] is not None for args in seen] == [True, False, False, False, True, False]


def test_per_frame_timesteps_and_learnable_embedding_are_shared() -> None:
    # What the carry relies on: per-token timestep embeddings and the positional embedding are one
    # object each for every block.
    for case, index in ((COSMOS, 2), (COSMOS_V1, 5)):
        model = case.fresh()
        seen = []
        for block in model.transformer_blocks:
            block.register_forward_pre_hook(lambda _m, args, _seen=seen: _seen.append(args))
        with torch.no_grad():
            model(**case.inputs(torch.Generator().manual_seed(1)))
        assert seen[0][index] is not None and all(args[index] is seen[0][index] for args in seen), case.name
    assert seen[0][5].abs().sum() > 0  # the (randomised) learnable embedding of the 1.0 case


class AnimaPair(torch.nn.Module):
    """Anima as a trainer that also fine-tunes the text conditioner runs it (ai-toolkit's
    ``train_text_conditioner``): the conditioner's output is the transformer's text context."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import AnimaTextConditioner

        self.text_conditioner = AnimaTextConditioner(
            source_dim=12, target_dim=TEXT_DIM, model_dim=16, num_layers=2, num_attention_heads=2,
            target_vocab_size=32, min_sequence_length=TEXT)
        self.transformer = cosmos_model(**ANIMA)

    def forward(self, qwen: torch.Tensor, t5_ids: torch.Tensor, qwen_mask: torch.Tensor, t5_mask: torch.Tensor,
                **inputs: torch.Tensor) -> Any:
        context = self.text_conditioner(source_hidden_states=qwen, target_input_ids=t5_ids,
                                        target_attention_mask=t5_mask, source_attention_mask=qwen_mask)
        return self.transformer(encoder_hidden_states=context, **inputs)


def anima_pair_inputs(g: torch.Generator) -> dict:
    # two prompts: 5 Qwen3 states and 4 T5 ids each, the second prompt one token shorter in both (masked)
    masks = torch.ones(2, 5), torch.ones(2, 4)
    masks[0][1, -1] = masks[1][1, -1] = 0
    return {
        "qwen": randn(g, 2, 5, 12, grad=True), "t5_ids": torch.randint(0, 32, (2, 4), generator=g),
        "qwen_mask": masks[0], "t5_mask": masks[1],
        "hidden_states": randn(g, 2, 4, 1, 4, 6, grad=True), "timestep": torch.tensor([0.3, 0.8]),
    }


def test_anima_trains_its_conditioner_through_the_patched_transformer() -> None:
    # Only the transformer is patched here (the conditioner has its own family, tested in test_family_anima.py): the
    # gradients that reach the conditioner's parameters through the chunked transformer are the unpatched model's.
    case = Case("anima-pair", AnimaPair, anima_pair_inputs)
    model, twin = case.twins()
    reference = run_step(twin, case)
    with gradseam.patch(model.transformer, CHUNKED) as handle, record_regions(handle) as regions:
        patched = run_step(model, case)
    assert_same_step(reference, patched, what="anima")
    assert_regions_whole(regions, what="anima")
    assert any(name.startswith("text_conditioner.blocks.") for name in patched.param_grads)
    assert patched.saved_bytes < reference.saved_bytes


def test_seam_and_attention_are_planned_as_declared() -> None:
    model = COSMOS.fresh()
    family = family_for(model)
    assert family.name == "cosmos"
    ffn = plan(model, family, gradseam.CheckpointConfig.coerce(
        gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn"))
    assert [(r.blocks, r.seam) for r in ffn.regions] == [((i,), ("ff",)) for i in range(4)]


# -- the presets at full size ----------------------------------------------------------------------
EXPECTED = {
    "predict2-2b-720p": (28, 16, 8192),
    "predict2-14b-720p": (36, 40, 20480),
    "predict2.5-2b-720p": (28, 16, 8192),
    "1.0-7b-720p": (28, 32, 16384),
    "anima-1024": (28, 16, 8192),
}


def _preset_model(name: str):
    return preset_model("cosmos", name)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_presets_plan_at_full_size(name: str) -> None:
    family, _, model = _preset_model(name)
    assert set(family.presets) == set(EXPECTED)
    assert family_for(model) is family
    layers, heads, ff = EXPECTED[name]
    block = model.transformer_blocks[0]
    assert (len(model.transformer_blocks), block.attn1.heads, block.ff.net[0].proj.out_features) == (layers, heads, ff)
    assert_plans_cover_every_block(model, family, layers, (
        ({"gradient_checkpointing": True}, layers), (CHUNKED, layers // 2),
        ({"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}, layers)
    ))


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    _, preset, model = _preset_model("predict2-2b-720p")
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 16, 24, 88, 160) and x["hidden_states"].requires_grad
    assert x["condition_mask"].shape == (1, 1, 24, 88, 160) and x["timestep"].shape == (1, 1, 24, 1, 1)
    assert x["encoder_hidden_states"].shape == (1, 512, 1024) and x["padding_mask"].shape == (1, 1, 704, 1280)
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 2 * 44 * 80, **preset.inputs)
    assert fewer["hidden_states"].shape[2] == 2
    _, p25, model = _preset_model("predict2.5-2b-720p")
    assert p25.make_inputs(model, "meta", torch.bfloat16, None, **p25.inputs)["encoder_hidden_states"].shape == (
        1, 512, 100352)
    _, v1, model = _preset_model("1.0-7b-720p")
    x = v1.make_inputs(model, "meta", torch.bfloat16, None, **v1.inputs)
    assert x["hidden_states"].shape == (1, 16, 16, 88, 160) and x["timestep"].shape == (1,)
    assert "condition_mask" not in x


def test_anima_preset_is_the_text2image_config_at_1024() -> None:
    # Anima's transformer: diffusers' Cosmos-2.0-Diffusion-2B-Text2Image (no condition channel, RoPE scale
    # (1, 4, 4)), 1.96B parameters; one 128 x 128 latent frame (4096 tokens) and 512 text tokens, no fps
    _, preset, model = _preset_model("anima-1024")
    cfg = model.config
    assert (cfg.in_channels, cfg.out_channels, tuple(cfg.rope_scale)) == (16, 16, (1.0, 4.0, 4.0))
    assert cfg.concat_padding_mask and cfg.extra_pos_embed_type is None and not cfg.use_crossattn_projection
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 1.96
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 16, 1, 128, 128) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 512, 1024) and x["timestep"].shape == (1,)
    assert x["padding_mask"].shape == (1, 1, 1024, 1024) and {"fps", "condition_mask"}.isdisjoint(x)
    assert preset.make_inputs(model, "meta", torch.bfloat16, 1024, **preset.inputs)["hidden_states"].shape == (
        1, 16, 1, 64, 64)  # ``tokens`` sizes a square image


@pytest.mark.parametrize("case", [COSMOS, COSMOS_V1], ids=lambda c: c.name)
def test_preset_input_builder_runs_the_model(case: Case) -> None:
    family = gradseam.registry.REGISTRY.get("cosmos")
    model = case.fresh()
    x = family.presets["predict2-2b-720p"].make_inputs(model, "cpu", torch.float32, None, frames=5, height=32,
                                                        width=32, text_tokens=TEXT)
    out = model(**x).sample
    assert out.shape == (1, 4, 2, 4, 4)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_steps_and_patches_exactly() -> None:
    """`gradseam bench --family cosmos --layers 2` on a tiny preset with the real input builder: the kit's check."""
    check_bench_workload("cosmos", TINY, {"frames": 5, "height": 32, "width": 32, "text_tokens": TEXT},
                         preset="predict2-2b-720p", sequence=2 * 2 * 2)


def test_anima_bench_workload_truncates_steps_and_patches_exactly() -> None:
    check_bench_workload("cosmos", ANIMA, {"height": 32, "width": 48, "text_tokens": TEXT}, preset="anima-1024",
                         sequence=2 * 3)
