"""Anima's text conditioner (AnimaTextConditioner) through the conformance kit, plus its preset.

The plain case (one prompt as the pipeline passes it: Qwen3 states, T5 ids and both tokenizers' int64
masks, all valid) runs the kit's whole matrix. A batch of two prompts padded to different lengths in
both tokenizers, a call without masks, and a config without self-attention and with LayerNorms (the
class's two switches) run the reduced matrix. Then: the loop hands every block the same conditioning
(what the carry relies on), the FFN seam is ``norm_mlp → mlp`` and only feeds the residual, the masks
reach the blocks, diffusers' own checkpointing flag, the preset at full size with its real input builder,
and what ``gradseam bench --family anima-text-conditioner --layers 2`` runs.
"""

from __future__ import annotations

import inspect

import torch
from family_checks import assert_plans_cover_every_block

import gradseam
from gradseam.adapters.anima import ANIMA_CONDITIONER
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    assert_regions_whole,
    assert_same_step,
    check_bench_workload,
    check_builtin_flag,
    preset_model,
    randn,
    record_regions,
    run_step,
)

CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}

# 4 blocks 16 wide (2 heads of 8), Qwen3 states 12 wide (so a swapped source and target would not fit),
# 32 T5 ids; 6 T5 queries over 5 Qwen3 states, zero-padded to 8 after the blocks.
T5, QWEN, SOURCE = 6, 5, 12
TINY = {
    "source_dim": SOURCE, "target_dim": 16, "model_dim": 16, "num_layers": 4, "num_attention_heads": 2,
    "target_vocab_size": 32, "min_sequence_length": 8,
}


def conditioner(**changes: object) -> torch.nn.Module:
    from diffusers import AnimaTextConditioner

    return AnimaTextConditioner(**{**TINY, **changes})


def _mask(length: int, *valid: int) -> torch.Tensor:
    # a tokenizer's attention mask (int64), right-padded to the longest prompt of the batch
    mask = torch.zeros(len(valid), length, dtype=torch.int64)
    for row, n in enumerate(valid):
        mask[row, :n] = 1
    return mask


def anima_inputs(g: torch.Generator) -> dict:
    return {
        "source_hidden_states": randn(g, 1, QWEN, SOURCE, grad=True),
        "target_input_ids": torch.randint(0, 32, (1, T5), generator=g),
        "target_attention_mask": _mask(T5, T5),
        "source_attention_mask": _mask(QWEN, QWEN),
    }


def anima_batch_inputs(g: torch.Generator) -> dict:
    # the second prompt is shorter in both tokenizers; the pipeline zeroes the Qwen3 states at its padding
    qwen_mask = _mask(QWEN, QWEN, 3)
    states = (randn(g, 2, QWEN, SOURCE) * qwen_mask[..., None]).requires_grad_(True)
    return {
        "source_hidden_states": states,
        "target_input_ids": torch.randint(0, 32, (2, T5), generator=g),
        "target_attention_mask": _mask(T5, T5, 4),
        "source_attention_mask": qwen_mask,
    }


def anima_unmasked_inputs(g: torch.Generator) -> dict:
    # both masks are optional: a caller may leave them out (every token then attends everywhere)
    return {key: value for key, value in anima_inputs(g).items() if not key.endswith("attention_mask")}


def _out(out: torch.Tensor) -> torch.Tensor:
    return out  # the conditioner returns the context tensor itself


ANIMA = Case("anima-text-conditioner", conditioner, anima_inputs, output=_out)
ANIMA_BATCH = Case("anima-text-conditioner-padded-batch", conditioner, anima_batch_inputs, output=_out)
ANIMA_UNMASKED = Case("anima-text-conditioner-unmasked", conditioner, anima_unmasked_inputs, output=_out)
ANIMA_SWITCHED = Case(
    "anima-text-conditioner-no-self-attn-layernorm",
    lambda: conditioner(use_self_attention=False, use_layer_norm=True),
    anima_batch_inputs,
    output=_out,
)


class TestAnimaTextConditioner(ConformanceSuite):
    case = ANIMA


class TestAnimaTextConditionerPaddedBatch(ConformanceSuite):
    case = ANIMA_BATCH
    reduced = True


class TestAnimaTextConditionerUnmasked(ConformanceSuite):
    case = ANIMA_UNMASKED
    reduced = True


class TestAnimaTextConditionerSwitched(ConformanceSuite):
    # the same block class with no self_attn (declared optional) and LayerNorm in place of RMSNorm
    case = ANIMA_SWITCHED
    reduced = True


def _output(case: Case, **changes: object) -> torch.Tensor:
    model = case.fresh()
    with torch.no_grad():
        return model(**{**case.inputs(torch.Generator().manual_seed(1)), **changes})


def test_the_masks_reach_the_blocks() -> None:
    # a padded Qwen3 state or T5 query changes what the valid queries of the shorter prompt see
    batch = _output(ANIMA_BATCH)
    assert batch.shape == (2, 8, 16) and torch.equal(batch[:, T5:], torch.zeros(2, 2, 16))  # padded to 8
    assert torch.equal(batch[1, 4:T5], torch.zeros(T5 - 4, 16))  # the padded queries are zeroed after the blocks
    for name, full in (("source_attention_mask", _mask(QWEN, QWEN, QWEN)), ("target_attention_mask", _mask(T5, T5, T5))):
        other = _output(ANIMA_BATCH, **{name: full})
        assert torch.equal(batch[0], other[0]) and not torch.equal(batch[1, :4], other[1, :4]), name


def test_the_loop_hands_every_block_the_same_conditioning() -> None:
    # What the carry relies on: the Qwen3 states, both masks and both RoPE tuples are one object each for
    # every block; hidden_states is what the previous block returned.
    model = ANIMA_BATCH.fresh()
    sig = inspect.signature(model.blocks[0].forward)
    seen: list[dict] = []
    returned: list[torch.Tensor] = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda _m, a, kw: seen.append(sig.bind(*a, **kw).arguments), with_kwargs=True)
        block.register_forward_hook(lambda _m, _a, out: returned.append(out))
    inputs = anima_batch_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(**inputs)
    assert len(seen) == 4 and seen[0]["encoder_hidden_states"] is inputs["source_hidden_states"]
    assert seen[0]["target_attention_mask"].shape == (2, 1, 1, T5)
    assert seen[0]["source_attention_mask"].shape == (2, 1, 1, QWEN)
    assert [t.shape for t in seen[0]["source_position_embeddings"]] == [(1, QWEN, 8)] * 2
    others = ("encoder_hidden_states", "target_attention_mask", "source_attention_mask", "position_embeddings",
              "source_position_embeddings")
    assert set(sig.parameters) == {"hidden_states", *others}
    for name in others:
        assert all(kw[name] is seen[0][name] for kw in seen), name
    assert all(kw["hidden_states"] is out for out, kw in zip(returned, seen[1:]))


def test_the_ffn_seam_is_norm_mlp_then_mlp_into_the_residual() -> None:
    model = ANIMA.fresh()
    family = family_for(model)
    assert family.name == "anima-text-conditioner" and family.has_ffn and family.has_attention
    assert family.supports_interval
    declared = family.block_class_for(type(model.blocks[0]))
    assert declared.ffn == (("norm_mlp", "mlp"),)
    assert (declared.attention, declared.optional) == (("self_attn", "cross_attn"), ("self_attn",))
    the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.blocks, r.seam) for r in the_plan.regions] == [((i,), ("norm_mlp", "mlp")) for i in range(4)]
    # mlp is called on norm_mlp's return value itself, and the block returns the residual plus mlp's output
    got: dict[str, torch.Tensor] = {}
    block = model.blocks[1]
    block.norm_mlp.register_forward_hook(lambda _m, a, out: got.update(residual=a[0], normed=out))
    block.mlp.register_forward_hook(lambda _m, a, out: got.update(mlp_in=a[0], mlp_out=out))
    block.register_forward_hook(lambda _m, _a, out: got.update(block_out=out))
    with torch.no_grad():
        model(**anima_inputs(torch.Generator().manual_seed(1)))
    assert got["mlp_in"] is got["normed"]
    assert torch.equal(got["block_out"], got["residual"] + got["mlp_out"])


def test_a_block_without_self_attention_is_planned_without_it() -> None:
    model = ANIMA_SWITCHED.fresh()
    assert not hasattr(model.blocks[0], "self_attn")
    assert isinstance(model.blocks[0].norm_mlp, torch.nn.LayerNorm)
    family = family_for(model)
    the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(FFN))
    assert [r.seam for r in the_plan.regions] == [("norm_mlp", "mlp")] * 4


class AnimaPair(torch.nn.Module):
    """Anima as a trainer that fine-tunes the conditioner too runs it (ai-toolkit's ``train_text_conditioner``):
    the conditioner's output is the Cosmos transformer's text context."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import CosmosTransformer3DModel

        self.text_conditioner = conditioner()
        self.transformer = CosmosTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=2,
            mlp_ratio=2.0, text_embed_dim=16, adaln_lora_dim=8, max_size=(4, 8, 8), rope_scale=(1.0, 4.0, 4.0),
            concat_padding_mask=False, extra_pos_embed_type=None)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, **text: torch.Tensor) -> torch.Tensor:
        context = self.text_conditioner(**text)
        return self.transformer(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=context).sample


def anima_pair_inputs(g: torch.Generator) -> dict:
    return {**anima_batch_inputs(g), "hidden_states": randn(g, 2, 4, 1, 4, 6, grad=True),
            "timestep": torch.tensor([0.3, 0.8])}


def test_anima_trains_both_models_patched_exactly() -> None:
    # Both models of the pipeline patched in chunks of two: the step through the transformer into the
    # conditioner's parameters and the Qwen3 states is the unpatched one, to the bit, and keeps less.
    case = Case("anima-pair", AnimaPair, anima_pair_inputs, output=_out)
    model, twin = case.twins()
    reference = run_step(twin, case)
    with (gradseam.patch(model.text_conditioner, CHUNKED) as conditioner_handle,
          gradseam.patch(model.transformer, CHUNKED) as transformer_handle,
          record_regions(conditioner_handle) as regions, record_regions(transformer_handle) as transformer_regions):
        patched = run_step(model, case)
    assert_same_step(reference, patched, what="anima")
    assert_regions_whole(regions, what="anima conditioner")
    assert_regions_whole(transformer_regions, what="anima transformer")
    assert [r.label for r in regions] == ["blocks[0, 1]", "blocks[2, 3]"]
    assert transformer_handle.family.name == "cosmos" and len(transformer_regions) == 1
    assert any(name.startswith("text_conditioner.blocks.") for name in patched.param_grads)
    assert patched.saved_bytes < reference.saved_bytes


def test_the_builtin_flag_is_exact_and_owned_by_gradseam() -> None:
    # diffusers' flag passes every argument positionally, in the order of the block's parameters
    check_builtin_flag(ANIMA_BATCH, CHUNKED)


# -- the preset at full size ------------------------------------------------------------------------


def test_preset_is_the_released_adapter_and_plans_at_full_size() -> None:
    from diffusers import AnimaTextConditioner

    family, preset, model = preset_model("anima-text-conditioner", "anima-512")
    assert list(family.presets) == ["anima-512"] and family_for(model) is family
    assert dict(preset.config) == ANIMA_CONDITIONER
    params = inspect.signature(AnimaTextConditioner.__init__).parameters
    assert set(ANIMA_CONDITIONER) == set(params) - {"self"}  # every constructor argument, spelled out
    assert all(params[k].default == v for k, v in ANIMA_CONDITIONER.items())  # which diffusers' defaults match
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 136e6
    block = model.blocks[0]
    assert (len(model.blocks), block.cross_attn.num_attention_heads, block.mlp[0].out_features) == (6, 16, 4096)
    assert isinstance(model.in_proj, torch.nn.Identity)
    assert_plans_cover_every_block(model, family, 6, (
        ({"gradient_checkpointing": True}, 6), (CHUNKED, 3), (FFN, 6)
    ))


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    _, preset, model = preset_model("anima-text-conditioner", "anima-512")
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["source_hidden_states"].shape == (1, 512, 1024) and x["source_hidden_states"].requires_grad
    assert x["source_hidden_states"].dtype == torch.bfloat16
    assert x["target_input_ids"].shape == (1, 512) and x["target_input_ids"].dtype == torch.int64
    assert x["target_attention_mask"].shape == x["source_attention_mask"].shape == (1, 512)
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 128, **preset.inputs)
    assert fewer["source_hidden_states"].shape == (1, 128, 1024) and fewer["target_input_ids"].shape == (1, 128)


def test_preset_input_builder_runs_the_model() -> None:
    # the builder's inputs must be ones the model takes: the tiny model, a short prompt, a backward pass
    preset = gradseam.registry.REGISTRY.get("anima-text-conditioner").presets["anima-512"]
    model = ANIMA.fresh()
    x = preset.make_inputs(model, "cpu", torch.float32, t5_tokens=T5, qwen_tokens=QWEN)
    assert int(x["target_attention_mask"].sum()) == T5 and int(x["source_attention_mask"].sum()) == QWEN
    out = model(**x)
    assert out.shape == (1, 8, 16)
    out.square().mean().backward()
    assert x["source_hidden_states"].grad is not None


def test_bench_workload_truncates_and_patches_exactly() -> None:
    # the kit's check: a truncated real-size build, the tokens the first block sees, an exact chunked step
    check_bench_workload("anima-text-conditioner", TINY, {"t5_tokens": T5, "qwen_tokens": QWEN}, sequence=T5)
