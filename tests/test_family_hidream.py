"""HiDream-I1: a tiny deterministic MoE model through the conformance kit (training-mode routing,
non-square latents with the model's own padding mask, dense FFNs, eval-mode routing), the interval
it ignores by design, MoE routing that a recompute reproduces, and the preset at full size."""

from __future__ import annotations

import warnings

import pytest
import torch
from family_checks import blocks_per_list

import gradseam
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
    run_step,
)

DOUBLE, SINGLE, LLAMA_LAYERS = 2, 3, 3
T5, LLAMA = 3, 2  # prompt tokens
CHANNELS = 4
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}


TINY = dict(
    patch_size=2, in_channels=CHANNELS, num_layers=DOUBLE, num_single_layers=SINGLE, attention_head_dim=8,
    num_attention_heads=2, caption_channels=[12, 10], text_emb_dim=8, num_routed_experts=4,
    num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(4, 4),
    llama_layers=[0, 1, 2, 2, 2],  # one per block, as the released config's 0..31 then 31s
)


def hidream_model(**overrides):
    from diffusers import HiDreamImageTransformer2DModel

    return HiDreamImageTransformer2DModel(**{**TINY, **overrides})


def hidream_inputs(g: torch.Generator, batch: int = 1, height: int = 4, width: int = 4) -> dict:
    # a 4x4 latent: 2x2 patches of 2x2
    return {
        "hidden_states": randn(g, batch, CHANNELS, height, width, grad=True),
        "timesteps": torch.linspace(500.0, 200.0, batch),
        "encoder_hidden_states_t5": randn(g, batch, T5, 12, grad=True),
        "encoder_hidden_states_llama3": randn(g, LLAMA_LAYERS, batch, LLAMA, 10, grad=True),
        "pooled_embeds": randn(g, batch, 8, grad=True),
    }


def hidream_masked_inputs(g: torch.Generator) -> dict:
    # Non-square latents (2x4 patches): the model pads the tokens to max_resolution's 12 and masks
    # the padding's keys (hidden_states_masks), in both streams.
    return hidream_inputs(g, batch=2, height=4, width=8)


def _eval_model():
    return hidream_model().eval()


HIDREAM = Case("hidream", hidream_model, hidream_inputs)
HIDREAM_MASKED = Case("hidream-masked", lambda: hidream_model(max_resolution=(6, 8)), hidream_masked_inputs)
HIDREAM_DENSE = Case("hidream-dense", lambda: hidream_model(num_routed_experts=0), hidream_inputs)
HIDREAM_EVAL = Case("hidream-eval-routing", _eval_model, hidream_inputs)


# -- The conformance kit ------------------------------------------------------------------------
# The family declares no carry, so the matrices the suites derive have no interval (whole blocks with a
# stride in the reduced ones). The dense and eval-routing variants run the offloaded FFN seams alone of
# the offload matrix.


class TestHiDream(ConformanceSuite):
    case = HIDREAM


class TestHiDreamMasked(ConformanceSuite):
    case = HIDREAM_MASKED
    reduced = True


class TestHiDreamDense(ConformanceSuite):
    case = HIDREAM_DENSE
    reduced = True
    offload = reduced_offload_configs(interval=False, blocks=False, attention=False)


class TestHiDreamEvalRouting(ConformanceSuite):
    case = HIDREAM_EVAL
    configs = reduced_configs(interval=False, kept=False)
    offload = reduced_offload_configs(interval=False, blocks=False, attention=False)


def test_the_family_takes_no_interval() -> None:
    """What the suites' matrices follow from: no carry, so no interval row anywhere."""
    assert not TestHiDream.family().supports_interval
    rows = TestHiDream.strategy_configs() + TestHiDream.offload_configs()
    assert rows and not any(c.get("gradient_checkpointing_interval") for c in rows)


# -- What the suites cannot see -------------------------------------------------------------------

def test_interval_is_ignored_with_a_warning_and_every_block_is_its_own_region() -> None:
    # Both loops rebuild the next block's input between blocks: no carry, so no chunk.
    from gradseam.errors import GradseamWarning

    model = HIDREAM.fresh()
    family = family_for(model)
    assert family.name == "hidream" and not family.supports_interval
    config = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
    with pytest.warns(GradseamWarning, match="does not support gradient_checkpointing_interval"):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
    assert [(r.list_path, r.blocks, r.shape) for r in the_plan.regions] == [
        *(("double_stream_blocks", (i,), "block") for i in range(DOUBLE)),
        *(("single_stream_blocks", (i,), "block") for i in range(SINGLE)),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GradseamWarning)
        report = check_strategy(HIDREAM, config, whole=True)
    assert report.saved_ratio < 1


def test_a_carry_would_only_fall_back(monkeypatch) -> None:
    # Why the lists declare none: with one, every chunk's later block gets another text input (double
    # stream) or a longer sequence (single stream) than the chunk ran it with, and computes again.
    from dataclasses import replace

    import gradseam.patcher as patcher
    from gradseam.errors import GradseamWarning
    from gradseam.family import Carry

    model = HIDREAM.fresh()
    family = family_for(model)
    carries = {"double_stream_blocks": Carry({"hidden_states": 0, "encoder_hidden_states": 1}),
               "single_stream_blocks": Carry({"hidden_states": None})}
    carried = replace(family, block_lists=tuple(replace(bl, carry=carries[bl.path]) for bl in family.block_lists))
    monkeypatch.setattr(patcher, "family_for", lambda m: carried)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GradseamWarning)  # the fallbacks this test is about
        report = check_strategy(HIDREAM, {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2})
    chunks = [r for r in report.regions if r.shape == "chunk"]
    assert {r.list_path for r in chunks} == {"double_stream_blocks", "single_stream_blocks"}
    assert all(r.fallbacks and not r.whole for r in chunks)


def test_ffn_seams_per_stream() -> None:
    model = HIDREAM.fresh()
    the_plan = plan(model, family_for(model), gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.list_path, r.blocks, r.seam) for r in the_plan.regions] == [
        *(p for i in range(DOUBLE) for p in (("double_stream_blocks", (i,), ("block.ff_i",)),
                                             ("double_stream_blocks", (i,), ("block.ff_t",)))),
        *(("single_stream_blocks", (i,), ("block.ff_i",)) for i in range(SINGLE)),
    ]


def _routes(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """Every call's expert choice per MoE gate (filled while the model runs)."""
    found: dict[str, list[torch.Tensor]] = {}
    for name, module in model.named_modules():
        if name.endswith("ff_i.gate"):
            module.register_forward_hook(
                lambda _m, _a, out, name=name: found.setdefault(name, []).append(out[0].detach().clone())
            )
    return found


def test_a_recompute_routes_every_token_as_the_forward_did() -> None:
    # Under torch-ffn each gate runs twice per step: in forward, and again when backward recomputes
    # the seam. Both calls must pick the same experts (the parity would break otherwise, but this
    # says why), and in training mode the routed experts get gradients through the recompute.
    model = HIDREAM.fresh()
    routes = _routes(model)
    with gradseam.patch(model, FFN):
        run_step(model, HIDREAM)
    assert len(routes) == DOUBLE + SINGLE
    for name, calls in routes.items():
        assert len(calls) == 2, name
        assert torch.equal(calls[0], calls[1]), f"{name}: recompute routed differently"
    routed = [p.grad for n, p in model.named_parameters() if ".ff_i.experts." in n]
    assert routed and any(g is not None and g.abs().sum() > 0 for g in routed)


def test_moe_forward_leaves_no_state_behind() -> None:
    # The gate's aux loss is computed in training mode and dropped: no attribute or buffer of any MoE
    # module changes in forward, so computing it again in backward changes nothing either.
    model = HIDREAM.fresh()
    moes = {n: m for n, m in model.named_modules() if type(m).__name__ in ("MOEFeedForwardSwiGLU", "MoEGate")}
    assert len(moes) == 2 * (DOUBLE + SINGLE)

    def state() -> dict:
        return {n: ({k: v for k, v in vars(m).items() if not k.startswith("_")},
                    {k: b.clone() for k, b in m.named_buffers()}) for n, m in moes.items()}

    before = state()
    run_step(model, HIDREAM)
    after = state()
    assert before.keys() == after.keys()
    for name in before:
        assert before[name][0] == after[name][0], name
        assert before[name][1].keys() == after[name][1].keys()


def test_eval_routing_trains_only_the_shared_expert() -> None:
    # diffusers runs the routed experts under no_grad outside training (moe_infer): the eval case is
    # exact, and its routed experts and gates get no gradient, with or without gradseam.
    report = check_strategy(HIDREAM_EVAL, FFN)
    grads = report.patched.param_grads
    assert not any(".ff_i.experts." in n or ".ff_i.gate." in n for n in grads)
    assert any(".ff_i.shared_experts." in n for n in grads)


def test_the_mask_and_the_prompts_reach_the_output() -> None:
    # The masked case's padding keys are zeroed: the same tokens unpadded (max_resolution fits them
    # exactly, so the model builds an all-ones mask) give another output. Every prompt input gets a
    # gradient through the blocks.
    report = check_strategy(HIDREAM_MASKED, FFN)
    for name in ("encoder_hidden_states_t5", "encoder_hidden_states_llama3", "pooled_embeds", "hidden_states"):
        assert report.patched.input_grads[name].abs().sum() > 0, name
    llama = report.patched.input_grads["encoder_hidden_states_llama3"]
    assert all(llama[k].abs().sum() > 0 for k in range(LLAMA_LAYERS))  # each block's own Llama layer
    unpadded = Case("hidream-unpadded", lambda: hidream_model(max_resolution=(4, 8)), hidream_masked_inputs)
    torch.manual_seed(0)
    plain = run_step(unpadded.build(), unpadded).outputs[0]
    padded = report.reference.outputs[0]
    assert padded.shape[2] == 12 and plain.shape[2] == 8  # training-mode output keeps the padded rows
    assert not torch.equal(padded[:, :, :8], plain)


# -- Presets: the real-size config builds (on the meta device) and plans at full size -------------
def _meta_model():
    from diffusers import HiDreamImageTransformer2DModel

    family = next(f for f in gradseam.families() if f.name == "hidream")
    preset = family.presets["i1-1024"]
    with torch.device("meta"):
        return family, preset, HiDreamImageTransformer2DModel(**preset.config)


def test_preset_plans_at_full_size() -> None:
    family, _, model = _meta_model()
    assert family_for(model) is family
    block = model.double_stream_blocks[0].block
    assert (block.attn1.heads, len(block.ff_i.experts), block.ff_i.gate.top_k) == (20, 4, 2)
    for config, regions in (({"gradient_checkpointing": True}, 48), (FFN, 16 * 2 + 32)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert len(the_plan.regions) == regions
        assert blocks_per_list(the_plan.regions) == {"double_stream_blocks": 16, "single_stream_blocks": 32}


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    _, preset, model = _meta_model()
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 16, 128, 128) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states_t5"].shape == (1, 128, 4096)
    assert x["encoder_hidden_states_llama3"].shape == (32, 1, 128, 4096)
    assert x["pooled_embeds"].shape == (1, 2048)
    assert preset.make_inputs(model, "meta", torch.bfloat16, 1024)["hidden_states"].shape == (1, 16, 64, 64)


def test_preset_input_builder_runs_the_model() -> None:
    family = next(f for f in gradseam.families() if f.name == "hidream")
    model = HIDREAM.fresh()
    x = family.presets["i1-1024"].make_inputs(model, "cpu", torch.float32, 4, t5_tokens=T5, llama_tokens=LLAMA)
    assert x["encoder_hidden_states_llama3"].shape[0] == LLAMA_LAYERS
    out = model(**x).sample
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_steps_and_patches_exactly() -> None:
    """`gradseam bench --family hidream --layers 2` on a tiny preset with the real input builder: the kit's check."""
    check_bench_workload("hidream", TINY, {"image_tokens": 4, "t5_tokens": T5, "llama_tokens": LLAMA})


def test_compiled_blocks_leave_hidreams_eval_routed_gates_without_a_gradient_as_eager():
    """HiDream in eval mode routes its experts under no_grad (diffusers' moe_infer): eager autograd leaves the
    MoE gates' weights at None; compiled blocks gave them zeros, which AdamW decays (found by the kit's
    quantized rows, issue 39). The reach probe now drops the compiled graphs' zeros for every parameter no
    output reaches, in each piece of the block's broken graph."""
    import torch

    from gradseam.testing import check_strategy

    try:
        check_strategy(HIDREAM_EVAL, {"gradient_checkpointing": True, "gradient_checkpointing_backend": "compile"})
    finally:
        # HiDream's graph breaks leave dynamo state behind remove() that makes every later compile of a
        # Flux block in the process ~3x slower (2 s -> 7 s), until a reset
        torch._dynamo.reset()
