"""Nucleus-Image: a tiny deterministic MoE model through the conformance kit (a dense block and three
expert-choice MoE blocks, GQA, a non-square latent), input variants (ai-toolkit's batch of two at their
own timesteps with a right-padded prompt mask and attention_kwargs), interval chunks, the loop handing
every block the same conditioning, MoE routing that a recompute reproduces, diffusers' own
checkpointing flag, the text KV cache at inference, and the presets at full size with their real input
builder."""

from __future__ import annotations

import inspect

import pytest
import torch
from family_checks import assert_plans_cover_every_block, check_chunks_run_whole, record_block_calls

import gradseam
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_bench_workload,
    check_builtin_flag,
    check_strategy,
    preset_model,
    randn,
    run_step,
)

CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}

TEXT, TEXT_DIM, CHANNELS = 5, 12, 16  # Qwen3-VL tokens, their width, packed latent channels (4 x 2x2)
ROWS, COLS = 2, 4  # patch grid: 8 image tokens, non-square

# 2 query heads over 1 KV head of 8 (GQA, as the released 16 over 4), 16 wide, RoPE 2 + 2 + 4. Block 0
# dense (mlp_ratio 12 gives the SwiGLU 128 channels: the class rounds int(d * r * 2/3) down to a multiple
# of 128, so the default ratio would leave it empty at this width), blocks 1-3 MoE with 4 experts of 8
# at capacities of 2x, 1x, 2x the sequence (4, 2 and 4 of the 8 tokens per expert).
TINY = dict(
    patch_size=2, in_channels=CHANNELS, out_channels=4, num_layers=4, attention_head_dim=8, num_attention_heads=2,
    num_key_value_heads=1, joint_attention_dim=TEXT_DIM, axes_dims_rope=(2, 2, 4), mlp_ratio=12.0,
    moe_enabled=True, dense_moe_strategy="leave_first_block_dense", num_experts=4, moe_intermediate_dim=8,
    capacity_factors=[0.0, 2.0, 1.0, 2.0],
)


def nucleus_model(**overrides: object) -> torch.nn.Module:
    from diffusers import NucleusMoEImageTransformer2DModel

    model = NucleusMoEImageTransformer2DModel(**{**TINY, **overrides})
    # upstream allocates the packed expert weights with torch.empty and leaves them to the checkpoint:
    # draw them (under the kit's seed, so the build is deterministic)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".img_mlp.experts." in name:
                param.normal_(std=0.3)
    return model


def nucleus_inputs(g: torch.Generator) -> dict:
    # one prompt: the pipeline drops an all-ones mask, so none reaches the model
    return {
        "hidden_states": randn(g, 1, ROWS * COLS, CHANNELS, grad=True),
        "img_shapes": [(1, ROWS, COLS)],
        "encoder_hidden_states": randn(g, 1, TEXT, TEXT_DIM, grad=True),
        "timestep": torch.tensor([0.6]),
    }


def _prompt_mask() -> torch.Tensor:
    # ai-toolkit stacks the tokenizer's int64 masks: the second prompt is right-padded after 3 tokens
    mask = torch.ones(2, TEXT, dtype=torch.long)
    mask[1, 3:] = 0
    return mask


def nucleus_masked_batch_inputs(g: torch.Generator) -> dict:
    # ai-toolkit's training call: a batch of two at their own timesteps, the prompt mask always passed,
    # plus attention_kwargs as a pipeline passes them (the model copies the dict and pops "scale")
    return {
        "hidden_states": randn(g, 2, ROWS * COLS, CHANNELS, grad=True),
        "img_shapes": [(1, ROWS, COLS)] * 2,
        "encoder_hidden_states": randn(g, 2, TEXT, TEXT_DIM, grad=True),
        "encoder_hidden_states_mask": _prompt_mask(),
        "timestep": torch.tensor([0.25, 0.8]),
        "attention_kwargs": {"scale": 1.0},
    }


NUCLEUS = Case("nucleus-moe", nucleus_model, nucleus_inputs, output=lambda out: out.sample)
NUCLEUS_MASKED = Case("nucleus-moe-masked-batch", nucleus_model, nucleus_masked_batch_inputs,
                      output=lambda out: out.sample)
CASES = [NUCLEUS, NUCLEUS_MASKED]


class TestNucleusMoE(ConformanceSuite):
    case = NUCLEUS


class TestNucleusMoEMaskedBatch(ConformanceSuite):
    case = NUCLEUS_MASKED
    reduced = True


# -- the cuts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_interval_chunks_run_whole(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back): both chunks must be served whole.
    report = check_chunks_run_whole(case, CHUNKED, ["transformer_blocks[0, 1]", "transformer_blocks[2, 3]"])
    assert report.saved_ratio < 1
    assert report.patched.input_grads["encoder_hidden_states"].abs().sum() > 0


def test_the_loop_hands_every_block_the_same_conditioning() -> None:
    # What the carry relies on: the normed text, temb, the RoPE tuple and the attention_kwargs dict (with
    # the joint key mask) are one object each for every block; hidden_states is what the previous returned.
    model = NUCLEUS_MASKED.fresh()
    seen, returned = record_block_calls(model.transformer_blocks)
    with torch.no_grad():
        model(**NUCLEUS_MASKED.inputs(torch.Generator().manual_seed(1)))
    assert len(seen) == 4
    for name in ("encoder_hidden_states", "temb", "image_rotary_emb", "attention_kwargs"):
        assert all(kw[name] is seen[0][name] for kw in seen), name
    assert seen[0]["attention_kwargs"]["attention_mask"].shape == (2, ROWS * COLS + TEXT)
    assert "scale" not in seen[0]["attention_kwargs"]
    for before, kw in zip(returned, seen[1:]):
        assert kw["hidden_states"] is before


def test_the_seam_is_img_mlp_in_dense_and_moe_blocks() -> None:
    from diffusers.models.attention import FeedForward
    from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoELayer

    model = NUCLEUS.fresh()
    family = family_for(model)
    assert family.name == "nucleus-moe" and family.has_ffn and family.supports_interval
    kinds = [type(b.img_mlp) for b in model.transformer_blocks]
    assert kinds == [FeedForward, NucleusMoELayer, NucleusMoELayer, NucleusMoELayer]
    the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.blocks, r.seam) for r in the_plan.regions] == [((i,), ("img_mlp",)) for i in range(4)]
    report = check_strategy(NUCLEUS, FFN, whole=True)
    ffn = [r for r in report.regions if r.shape == "ffn"]
    assert len(ffn) == 4 and all(r.whole and r.runs == 1 for r in ffn), ffn
    assert report.saved_ratio < 1


# -- MoE routing --------------------------------------------------------------------------------


def _routes(model: torch.nn.Module) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per MoE layer, every call's router logits and the rows it gathered for the experts, in order."""
    found: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    logits: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        layer, _, leaf = name.rpartition(".")
        if leaf == "gate" and layer.endswith("img_mlp"):
            module.register_forward_hook(
                lambda _m, _a, out, n=layer: logits.__setitem__(n, out.detach().clone()))
        if leaf == "experts" and layer.endswith("img_mlp"):
            module.register_forward_pre_hook(
                lambda _m, a, n=layer: found.setdefault(n, []).append((logits[n], a[0].detach().clone())))
    return found


def test_a_recompute_routes_every_token_as_the_forward_did() -> None:
    # Under torch-ffn each MoE layer runs twice per step: in forward, and again when backward recomputes
    # the seam. Both calls must score the tokens alike and hand every expert the same rows in the same
    # order (expert choice: topk over the sequence), and the routed experts and the gate get gradients
    # through the recompute.
    model = NUCLEUS_MASKED.fresh()
    routes = _routes(model)
    with gradseam.patch(model, FFN):
        run_step(model, NUCLEUS_MASKED)
    assert sorted(routes) == [f"transformer_blocks.{i}.img_mlp" for i in (1, 2, 3)]
    for name, calls in routes.items():
        assert len(calls) == 2, name
        (logits, rows), (again, rows_again) = calls
        assert torch.equal(logits, again) and torch.equal(rows, rows_again), f"{name}: recompute routed differently"
    # capacity ceil(c * 8 / 4) tokens per expert and sample: 4, 2, 4
    assert [calls[0][1].shape[0] for _, calls in sorted(routes.items())] == [4 * 2 * 4, 4 * 2 * 2, 4 * 2 * 4]
    grads = {n: p.grad for n, p in model.named_parameters() if ".img_mlp.experts." in n or ".img_mlp.gate." in n}
    assert len(grads) == 3 * 3 and all(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_moe_forward_leaves_no_state_behind() -> None:
    # No attribute or buffer of any MoE module changes in forward (no aux loss, no running statistics),
    # so computing it again in backward changes nothing either.
    model = NUCLEUS.fresh()
    moes = {n: m for n, m in model.named_modules() if type(m).__name__ in ("NucleusMoELayer", "SwiGLUExperts")}
    assert len(moes) == 2 * 3

    def state() -> dict:
        return {n: ({k: v for k, v in vars(m).items() if not k.startswith("_")},
                    {k: b.clone() for k, b in m.named_buffers()}) for n, m in moes.items()}

    before = state()
    run_step(model, NUCLEUS)
    after = state()
    for name in before:
        assert before[name][0] == after[name][0], name
        assert before[name][1].keys() == after[name][1].keys()


# -- the inputs reach the blocks ----------------------------------------------------------------


def test_padded_prompt_tokens_get_no_gradient_and_the_mask_matters() -> None:
    report = check_strategy(NUCLEUS_MASKED, CHUNKED)
    grads = report.patched.input_grads["encoder_hidden_states"]
    assert grads[0].abs().sum() > 0 and grads[1, :3].abs().sum() > 0
    assert torch.equal(grads[1, 3:], torch.zeros_like(grads[1, 3:]))  # padding reaches nothing
    model = NUCLEUS_MASKED.fresh()
    inputs = nucleus_masked_batch_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        masked = model(**inputs).sample
        unmasked = model(**{**inputs, "encoder_hidden_states_mask": None}).sample
    assert torch.equal(masked[0], unmasked[0]) and not torch.equal(masked[1], unmasked[1])


def test_diffusers_flag_set_before_patching_is_switched_off_and_stays_exact() -> None:
    # the model's own checkpointing path calls every block positionally with all five arguments
    check_builtin_flag(NUCLEUS_MASKED, CHUNKED)


def test_text_kv_cache_inference_is_unchanged_by_a_patch() -> None:
    # diffusers' text KV cache (the pipeline's recommended speed-up) hooks every block and writes its
    # cached text keys into the shared attention_kwargs dict; under no_grad a patched model computes
    # exactly as the unpatched one, on the first (filling) call and on the second (cached) one.
    from diffusers.hooks import TextKVCacheConfig

    plain, patched = NUCLEUS_MASKED.twins()
    handle = gradseam.patch(patched, CHUNKED)
    for model in (plain, patched):
        model.enable_cache(TextKVCacheConfig())
    inputs = nucleus_masked_batch_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(plain(**inputs).sample, patched(**inputs).sample)
    handle.remove()


# -- presets at full size -----------------------------------------------------------------------

PRESETS = {"17b-1024": 64, "17b-512": 32}  # patch-grid side


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_plan_at_full_size(name: str) -> None:
    from diffusers import NucleusMoEImageTransformer2DModel

    family, preset, model = preset_model("nucleus-moe", name)
    assert set(family.presets) == set(PRESETS)
    assert family_for(model) is family
    params = set(inspect.signature(NucleusMoEImageTransformer2DModel.__init__).parameters) - {"self"}
    assert set(preset.config) == params  # every constructor argument, spelled out
    assert 16.5e9 < sum(p.numel() for p in model.parameters()) < 17.5e9  # "17B total"
    blocks = model.transformer_blocks
    moe = [b.moe_enabled for b in blocks]
    assert len(blocks) == 32 and moe == [False] * 3 + [True] * 29
    block = blocks[3]
    assert (block.attn.heads, block.attn.inner_kv_dim // 128, block.img_mlp.num_experts) == (16, 4, 64)
    assert (block.img_mlp.capacity_factor, blocks[5].img_mlp.capacity_factor) == (4.0, 2.0)
    assert block.img_mlp.experts.use_grouped_mm
    assert_plans_cover_every_block(model, family, 32, (
        ({"gradient_checkpointing": True}, 32), (CHUNKED, 16), (FFN, 32)
    ))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_inputs_have_the_trainers_sizes(name: str) -> None:
    _, preset, model = preset_model("nucleus-moe", name)
    side = PRESETS[name]
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, side * side, 64) and x["hidden_states"].requires_grad
    assert x["img_shapes"] == [(1, side, side)]
    assert x["encoder_hidden_states"].shape == (1, 256, 4096)
    assert x["encoder_hidden_states_mask"].shape == (1, 256)
    assert x["timestep"].shape == (1,)
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 1024, **preset.inputs)
    assert fewer["hidden_states"].shape == (1, 1024, 64) and fewer["img_shapes"] == [(1, 32, 32)]


def test_preset_input_builder_runs_the_model() -> None:
    # the builder's inputs must be ones the model takes: the tiny model, a 32x64 picture, a padded prompt
    preset = gradseam.registry.REGISTRY.get("nucleus-moe").presets["17b-1024"]
    model = NUCLEUS.fresh()
    x = preset.make_inputs(model, "cpu", torch.float32, height=32, width=64, text_tokens=TEXT, prompt_tokens=3)
    assert x["hidden_states"].shape == (1, ROWS * COLS, CHANNELS) and x["img_shapes"] == [(1, ROWS, COLS)]
    assert x["encoder_hidden_states_mask"].tolist() == [[1, 1, 1, 0, 0]]
    out = model(**x).sample
    assert out.shape == (1, ROWS * COLS, CHANNELS)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_and_patches_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gradseam bench --family nucleus-moe --layers 2` on a tiny preset with the real input builder."""
    from diffusers.models.transformers.transformer_nucleusmoe_image import SwiGLUExperts

    # bench builds the model through its constructor, which leaves the packed expert weights
    # uninitialised (torch.empty): draw them, so that no NaN in leftover memory makes the comparison fail
    init = SwiGLUExperts.__init__

    def drawn(self: SwiGLUExperts, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        with torch.no_grad():
            self.gate_up_proj.normal_(std=0.3)
            self.down_proj.normal_(std=0.3)

    monkeypatch.setattr(SwiGLUExperts, "__init__", drawn)
    check_bench_workload("nucleus-moe", TINY, {"height": 32, "width": 64, "text_tokens": TEXT},
                         preset="17b-1024", sequence=ROWS * COLS)
