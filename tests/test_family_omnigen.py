"""OmniGen v1: a tiny deterministic model through the conformance kit, a two-prompt batch with a
condition image in one prompt and left padding in the other (the processor's causal / bidirectional
mask), interval chunks that really chain, and the presets at full size."""

from __future__ import annotations

import pytest
import torch
from family_checks import assert_plans_cover_every_block, check_chunks_run_whole

import gradseam
from gradseam.adapters.omnigen import multimodal_mask
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_bench_workload,
    preset_model,
    randn,
)

VOCAB, LATENT = 40, 4  # a 4x4 latent in 2x2 patches: 4 tokens per image

TINY = dict(
    in_channels=4, patch_size=2, hidden_size=16, num_attention_heads=2, num_key_value_heads=2, intermediate_size=32,
    num_layers=4, vocab_size=VOCAB, pad_token_id=2, pos_embed_max_size=8, time_step_dim=8,
    # distinct factors, so the RoPE the blocks share is not the identity scaling
    rope_scaling={"short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [1.0, 1.5, 2.0, 2.5]},
)


def omnigen_model():
    from diffusers import OmniGenTransformer2DModel

    return OmniGenTransformer2DModel(**TINY)


def _ids(g: torch.Generator, batch: int, n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, n), generator=g)


def omnigen_inputs(g: torch.Generator) -> dict:
    # text-to-image: 5 prompt tokens, the timestep token, 4 output tokens
    mask, positions = multimodal_mask([5], 4)
    return {
        "hidden_states": randn(g, 1, 4, LATENT, LATENT, grad=True),
        "timestep": torch.tensor([0.4]),
        "input_ids": _ids(g, 1, 5),
        "input_img_latents": [],
        "input_image_sizes": {},
        "attention_mask": mask,
        "position_ids": positions,
    }


def omnigen_edit_inputs(g: torch.Generator) -> dict:
    # Two prompts as the processor batches them: the first holds a condition image (2 text tokens, its
    # 4 patch-token slots, 2 more text tokens), the second is 5 text tokens, left-padded to 8.
    ids = _ids(g, 2, 8)
    ids[0, 2:6] = 0
    ids[1, :3] = 2
    spans = {0: [[2, 6]]}
    mask, positions = multimodal_mask([8, 5], 4, spans)
    return {
        "hidden_states": randn(g, 2, 4, LATENT, LATENT, grad=True),
        "timestep": torch.tensor([0.3, 0.8]),
        "input_ids": ids,
        "input_img_latents": [randn(g, 1, 4, LATENT, LATENT, grad=True)],
        "input_image_sizes": spans,
        "attention_mask": mask,
        "position_ids": positions,
    }


OMNIGEN = Case("omnigen", omnigen_model, omnigen_inputs)
OMNIGEN_EDIT = Case("omnigen-edit-padded", omnigen_model, omnigen_edit_inputs)


class TestOmniGen(ConformanceSuite):
    case = OMNIGEN


class TestOmniGenEditPadded(ConformanceSuite):
    case = OMNIGEN_EDIT
    reduced = True


CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}


@pytest.mark.parametrize("case", [OMNIGEN, OMNIGEN_EDIT], ids=lambda c: c.name)
def test_interval_chunks_chain(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back): both chunks must be served whole.
    check_chunks_run_whole(case, CHUNKED, ["layers[0, 1]", "layers[2, 3]"])


def test_seam_is_the_norm_and_the_mlp() -> None:
    model = OMNIGEN.fresh()
    family = family_for(model)
    assert family.name == "omnigen"
    ffn = plan(model, family, gradseam.CheckpointConfig.coerce(
        gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn"))
    assert [(r.blocks, r.seam) for r in ffn.regions] == [((i,), ("post_attention_layernorm", "mlp")) for i in range(4)]


def test_every_block_gets_the_same_mask_and_rope() -> None:
    model = OMNIGEN_EDIT.fresh()
    seen = []
    for block in model.layers:
        block.register_forward_pre_hook(lambda _m, _a, kw: seen.append((kw["attention_mask"], kw["image_rotary_emb"])),
                                        with_kwargs=True)
    with torch.no_grad():
        model(**omnigen_edit_inputs(torch.Generator().manual_seed(1)))
    masks, ropes = zip(*seen)
    assert all(m is masks[0] for m in masks) and all(r is ropes[0] for r in ropes)
    assert masks[0].shape == (2, 1, 13, 13)  # 8 prompt + 1 timestep + 4 image tokens, additive


def test_condition_image_and_causal_mask_reach_the_blocks() -> None:
    # The condition latent sits in a list, so the kit does not collect its gradient: check it here,
    # through chunked blocks.
    model = OMNIGEN_EDIT.fresh()
    inputs = omnigen_edit_inputs(torch.Generator().manual_seed(1))
    with gradseam.patch(model, CHUNKED):
        model(**inputs).sample.square().mean().backward()
    assert inputs["input_img_latents"][0].grad.abs().sum() > 0
    # The mask is causal over the prompt: changing sample 1's last prompt token leaves the trunk's output
    # on its earlier prompt tokens (and on sample 0) as it was, and changes everything from there on.
    final = []
    model.norm.register_forward_hook(lambda _m, _a, out: final.append(out))
    changed = dict(inputs, input_ids=inputs["input_ids"].clone())
    changed["input_ids"][1, -1] = 3 + (changed["input_ids"][1, -1] - 2) % (VOCAB - 3)
    with torch.no_grad():
        model(**inputs)
        model(**changed)
    a, b = final
    assert torch.equal(a[0], b[0]) and torch.equal(a[1, 3:7], b[1, 3:7])
    assert not torch.equal(a[1, 7], b[1, 7]) and not torch.equal(a[1, 9:], b[1, 9:])


# -- the presets at full size ----------------------------------------------------------------------
def _preset_model(name: str):
    return preset_model("omnigen", name)


@pytest.mark.parametrize("name", ["v1-1024", "v1-edit-1024"])
def test_presets_plan_at_full_size(name: str) -> None:
    family, _, model = _preset_model(name)
    assert set(family.presets) == {"v1-1024", "v1-edit-1024"}
    assert family_for(model) is family
    block = model.layers[0]
    assert (block.self_attn.heads, block.mlp.gate_up_proj.out_features, len(model.layers)) == (32, 2 * 8192, 32)
    assert_plans_cover_every_block(model, family, 32, (
        ({"gradient_checkpointing": True}, 32), (CHUNKED, 16),
        ({"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}, 32)
    ))


def test_preset_inputs_have_the_pipelines_layout() -> None:
    _, preset, model = _preset_model("v1-edit-1024")
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 4, 128, 128) and x["hidden_states"].requires_grad
    assert x["input_ids"].shape == (1, 128 + 4096)
    assert [t.shape for t in x["input_img_latents"]] == [(1, 4, 128, 128)]
    assert x["input_image_sizes"] == {0: [[8, 8 + 4096]]}
    assert x["attention_mask"].shape == (1, 8321, 8321) and x["position_ids"].shape[1] == 8321
    _, t2i, _ = _preset_model("v1-1024")
    small = t2i.make_inputs(model, "meta", torch.bfloat16, 1024, **t2i.inputs)
    assert small["hidden_states"].shape == (1, 4, 64, 64) and small["input_img_latents"] == []


@pytest.mark.parametrize("images", [0, 1])
def test_preset_input_builder_runs_the_model(images: int) -> None:
    family = gradseam.registry.REGISTRY.get("omnigen")
    model = OMNIGEN.fresh()
    x = family.presets["v1-edit-1024"].make_inputs(model, "cpu", torch.float32, 4, text_tokens=5, images=images)
    out = model(**x).sample
    assert out.shape == (1, 4, LATENT, LATENT)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_steps_and_patches_exactly() -> None:
    """`gradseam bench --family omnigen --layers 2` on a tiny preset with the real input builder: the kit's check."""
    check_bench_workload("omnigen", TINY, {"image_tokens": 4, "text_tokens": 5, "images": 1},
                         preset="v1-edit-1024", sequence=5 + 4 + 1 + 4)
