"""ConsisID (ConsisIDTransformer3DModel) through the conformance kit, plus its preset.

The family declares no carry (a face residual after every second block), so the kit's matrix is
``torch`` / ``torch-ffn`` x stride, kept attention and the offload backends without an interval. The
plain case (the face modules on, the pipeline's RoPE, the learned positional embedding) runs all of it;
a batch of two with their own timesteps and faces runs a reduced set. Then: an interval is ignored with
a warning, a carry would make every chunk fall back (why there is none), the perceiver cross-attentions
run outside every region and still train (and what declaring them would cost), the FFN seam, the inputs
reach the output, diffusers' own checkpointing flag, and the preset at full size.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from family_checks import assert_plans_cover_every_block

import gradseam
from gradseam.adapters.consisid import CONSISID_PREVIEW, rotary_embedding
from gradseam.errors import GradseamWarning
from gradseam.family import BlockClass, BlockList, Carry
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
)

WHOLE = {"gradient_checkpointing": True}
CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}
_M = "diffusers.models.transformers.consisid_transformer_3d"

# 2 heads of 16 (32 wide; the 3-D RoPE splits a head 4 + 6 + 6), T5 states 8 wide, 4 blocks with a perceiver
# after blocks 0 and 2. The latent video is the learned positional embedding's size: 2 frames of 4 x 4 in
# patches of 2, 8 video tokens; 8 channels (noisy + image latents). Face modules: 2 EVA scales of 5 tokens,
# 3 face tokens, as wide as the perceivers' keys (int(32 / 3 * 2) = 21).
TEXT = 6
TINY = {
    "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 8, "out_channels": 4, "time_embed_dim": 8,
    "text_embed_dim": 8, "num_layers": 4, "sample_width": 4, "sample_height": 4, "sample_frames": 5, "patch_size": 2,
    "max_text_seq_length": TEXT, "use_rotary_positional_embeddings": True, "use_learned_positional_embeddings": True,
    "is_train_face": True, "cross_attn_interval": 2, "cross_attn_dim_head": 8, "cross_attn_num_heads": 2,
    "LFE_id_dim": 4, "LFE_vit_dim": 8, "LFE_depth": 2, "LFE_dim_head": 4, "LFE_num_heads": 2, "LFE_num_id_token": 2,
    "LFE_num_querie": 3, "LFE_output_dim": 21, "LFE_ff_mult": 2, "LFE_num_scale": 2,
}


def consisid_model() -> torch.nn.Module:
    from diffusers import ConsisIDTransformer3DModel

    return ConsisIDTransformer3DModel(**TINY)


def _rope() -> tuple:
    # the pipeline's RoPE argument for 2 latent frames on a 2 x 2 patch grid, made by the preset's builder
    return rotary_embedding(SimpleNamespace(config=SimpleNamespace(**TINY)), 2, 2, 2, "cpu")


def consisid_inputs(g: torch.Generator, batch: int = 1, timestep: tuple[int, ...] = (500,)) -> dict:
    return {
        "hidden_states": randn(g, batch, 2, 8, 4, 4, grad=True),
        "encoder_hidden_states": randn(g, batch, TEXT, 8, grad=True),
        "timestep": torch.tensor(timestep),
        "image_rotary_emb": _rope(),
        "id_cond": randn(g, batch, 4, grad=True),
        "id_vit_hidden": [randn(g, batch, 5, 8) for _ in range(2)],  # a frozen EVA-CLIP's, as in training
    }


def consisid_batch_inputs(g: torch.Generator) -> dict:
    return consisid_inputs(g, batch=2, timestep=(150, 850))  # two videos, two faces, own timesteps


CONSISID = Case("consisid", consisid_model, consisid_inputs)
CONSISID_BATCH = Case("consisid-batch", consisid_model, consisid_batch_inputs)


class TestConsisID(ConformanceSuite):
    case = CONSISID


class TestConsisIDBatch(ConformanceSuite):
    case = CONSISID_BATCH
    reduced = True


def test_the_matrix_has_no_interval() -> None:
    family = TestConsisID.family()
    assert family.name == "consisid" and not family.supports_interval and family.has_ffn and family.has_attention
    rows = TestConsisID.strategy_configs() + TestConsisID.offload_configs()
    assert rows and not any(c.get("gradient_checkpointing_interval") for c in rows)


# -- no carry, and why ---------------------------------------------------------------------------


def test_an_interval_is_ignored_with_a_warning() -> None:
    model = CONSISID.fresh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        the_plan = plan(model, family_for(model), gradseam.CheckpointConfig.coerce(CHUNKED))
    assert any(issubclass(w.category, GradseamWarning) and "does not support gradient_checkpointing_interval"
               in str(w.message) for w in caught)
    assert [r.blocks for r in the_plan.regions] == [(i,) for i in range(4)]  # one region per block


def test_a_carry_would_make_every_chunk_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the missing carry avoids: the face residual after blocks 0 and 2 hands blocks 1 and 3 a tensor their
    # predecessor did not return, so both interval-2 chunks compute block by block (their second block twice
    # in forward). Exact either way.
    import gradseam.patcher as patcher

    family = family_for(CONSISID.fresh())
    carried = replace(family, block_lists=(
        replace(family.block_lists[0], carry=Carry({"hidden_states": 0, "encoder_hidden_states": 1})),))
    monkeypatch.setattr(patcher, "family_for", lambda m: carried)
    report = check_strategy(CONSISID, CHUNKED)
    assert {r.label: r.whole for r in report.regions if r.shape == "chunk"} == {
        "transformer_blocks[0, 1]": False, "transformer_blocks[2, 3]": False
    }


# -- the face modules ---------------------------------------------------------------------------


def test_the_perceivers_run_outside_every_region_and_train() -> None:
    report = check_strategy(CONSISID, WHOLE, whole=True)
    assert {r.label for r in report.regions} == {f"transformer_blocks[{i}]" for i in range(4)}
    for name in ("perceiver_cross_attention.0.to_q.weight", "perceiver_cross_attention.1.to_kv.weight",
                 "local_facial_extractor.proj_out"):
        assert report.patched.param_grads[name].abs().sum() > 0, name
    for name in ("id_cond", "hidden_states", "encoder_hidden_states"):
        assert report.patched.input_grads[name].abs().sum() > 0, name


def test_declaring_the_perceivers_would_cover_them_but_refuse_ffn_and_attention_offload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Why the perceivers are left alone: as a block list of their own they checkpoint exactly and keep less,
    # but their class has no FFN seam and no attention side, so the family would lose both for every block.
    import gradseam.patcher as patcher

    family = family_for(CONSISID.fresh())
    covered = replace(
        family,
        block_lists=(*family.block_lists, BlockList("perceiver_cross_attention", optional=True)),
        block_classes=(*family.block_classes, BlockClass(f"{_M}.PerceiverCrossAttention")),
    )
    assert not covered.has_ffn and not covered.has_attention
    plain = check_strategy(CONSISID, WHOLE)
    monkeypatch.setattr(patcher, "family_for", lambda m: covered)
    report = check_strategy(CONSISID, WHOLE, whole=True)
    assert {"perceiver_cross_attention[0]", "perceiver_cross_attention[1]"} <= {r.label for r in report.regions}
    assert report.saved_ratio < plain.saved_ratio


def _perceiver_kept(train: bool) -> float:
    """The activations one perceiver saves for backward per video token at the released width (3072, keys 2048
    wide, 16 x 128 heads, 32 face tokens), in units of a block input's token (3072 floats); weights not
    counted, and the face side (the same at any length) taken out as the difference of two lengths."""
    from diffusers.models.transformers.consisid_transformer_3d import PerceiverCrossAttention

    with torch.device("meta"):
        perceiver = PerceiverCrossAttention(dim=3072, dim_head=128, heads=16, kv_dim=2048)
    perceiver = perceiver.to_empty(device="cpu").requires_grad_(train)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in perceiver.parameters():
            p.normal_(0, 0.02, generator=generator)
    weights = {p.untyped_storage().data_ptr() for p in perceiver.parameters()}

    def kept(tokens: int) -> int:
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(1, tokens, 3072, requires_grad=True, generator=generator)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            perceiver(torch.randn(1, 32, 2048, generator=generator), x)
        return sum(n for ptr, n in saved.items() if ptr not in weights)

    return (kept(96) - kept(32)) / (64 * 3072 * 4)


def test_what_a_perceiver_keeps() -> None:
    # The docstring's estimate: its input and normed input, scaled query, attention output and softmax when
    # it trains; with frozen weights (a LoRA elsewhere) its Linear layers keep no input.
    assert 3.4 < _perceiver_kept(train=True) < 3.8
    assert 1.1 < _perceiver_kept(train=False) < 1.4


# -- the cuts and the inputs ----------------------------------------------------------------------


def test_the_ffn_seam_is_ff_over_both_streams() -> None:
    model = CONSISID.fresh()
    family = family_for(model)
    declared = family.block_class_for(type(model.transformer_blocks[0]))
    assert (declared.ffn, declared.attention) == ((("ff",),), ("attn1",))
    the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.blocks, r.seam) for r in the_plan.regions] == [((i,), ("ff",)) for i in range(4)]
    # ff sees the concatenation of both modulated streams: text and video tokens, one call per block
    seen: list[tuple] = []
    model.transformer_blocks[0].ff.register_forward_hook(lambda _m, a, _o: seen.append(tuple(a[0].shape)))
    with torch.no_grad():
        model(**consisid_inputs(torch.Generator().manual_seed(1)))
    assert seen == [(1, TEXT + 8, 32)]


def test_variant_inputs_change_the_output() -> None:
    def output(case: Case, **changes: object) -> torch.Tensor:
        model = case.fresh()
        with torch.no_grad():
            return model(**{**case.inputs(torch.Generator().manual_seed(1)), **changes}).sample

    plain = output(CONSISID)
    assert not torch.equal(plain, output(CONSISID, image_rotary_emb=None))
    assert not torch.equal(plain, output(CONSISID, id_cond=torch.zeros(1, 4)))
    assert not torch.equal(plain, output(CONSISID, id_vit_hidden=[torch.zeros(1, 5, 8)] * 2))
    batch = output(CONSISID_BATCH)
    assert not torch.equal(batch, output(CONSISID_BATCH, timestep=torch.tensor([150, 150])))


def test_the_builtin_flag_is_exact_and_owned_by_gradseam() -> None:
    # diffusers' flag passes the block's four arguments positionally; the perceivers stay outside it too
    check_builtin_flag(CONSISID_BATCH, WHOLE)


# -- the preset at full size ----------------------------------------------------------------------


def test_preset_plans_at_full_size() -> None:
    from diffusers import ConsisIDTransformer3DModel

    family, preset, model = preset_model("consisid", "preview-480p")
    assert set(family.presets) == {"preview-480p"} and family_for(model) is family
    assert dict(preset.config) == CONSISID_PREVIEW
    params = set(inspect.signature(ConsisIDTransformer3DModel.__init__).parameters) - {"self"}
    missing = params - set(CONSISID_PREVIEW)  # left at the class defaults
    assert set(CONSISID_PREVIEW) <= params and missing == {
        "flip_sin_to_cos", "freq_shift", "activation_fn", "timestep_activation_fn", "norm_elementwise_affine",
        "norm_eps", "spatial_interpolation_scale", "temporal_interpolation_scale",
    }
    assert 6.1e9 < sum(p.numel() for p in model.parameters()) < 6.2e9
    block = model.transformer_blocks[0]
    assert (len(model.transformer_blocks), block.attn1.heads, block.ff.net[0].proj.out_features) == (42, 48, 12288)
    assert len(model.perceiver_cross_attention) == 21
    assert_plans_cover_every_block(model, family, 42, ((WHOLE, 42), (FFN, 42)))


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    _, preset, model = preset_model("consisid", "preview-480p")
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 13, 32, 60, 90) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 226, 4096) and x["timestep"].dtype == torch.int64
    cos, sin = x["image_rotary_emb"]
    assert cos.shape == sin.shape == (13 * 30 * 45, 64)
    assert x["id_cond"].shape == (1, 1280)
    assert [t.shape for t in x["id_vit_hidden"]] == [(1, 577, 1024)] * 5
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 4 * 30 * 45, **preset.inputs)
    assert fewer["hidden_states"].shape == (1, 4, 32, 60, 90) and fewer["image_rotary_emb"][0].shape[0] == 4 * 30 * 45


def test_preset_rope_is_the_pipelines() -> None:
    # the builder's RoPE argument, bit for bit what ConsisIDPipeline computes for the released config
    from diffusers.pipelines.consisid.pipeline_consisid import ConsisIDPipeline

    config = SimpleNamespace(**CONSISID_PREVIEW)
    pipe = SimpleNamespace(vae_scale_factor_spatial=8, transformer=SimpleNamespace(config=config))
    ref = ConsisIDPipeline._prepare_rotary_positional_embeddings(pipe, 480, 720, 13, "cpu")
    ours = rotary_embedding(SimpleNamespace(config=config), 13, 30, 45, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


def test_preset_input_builder_runs_the_model() -> None:
    # the builder's inputs must be ones the model takes: the tiny model, at its tiny size
    preset = gradseam.registry.REGISTRY.get("consisid").presets["preview-480p"]
    model = CONSISID.fresh()
    x = preset.make_inputs(model, "cpu", torch.float32, frames=5, height=32, width=32, vit_tokens=5)
    assert x["hidden_states"].shape == (1, 2, 8, 4, 4) and len(x["id_vit_hidden"]) == 2
    out = model(**x).sample
    assert out.shape == (1, 2, 4, 4, 4)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_and_patches_exactly() -> None:
    """`gradseam bench --family consisid --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload("consisid", TINY, {"frames": 5, "height": 32, "width": 32, "vit_tokens": 5},
                         preset="preview-480p", sequence=8, patch_config=WHOLE)
