"""Ovis-Image: a tiny deterministic model through the conformance kit (double and single blocks, both lists
chunked), input variants (a batch of two at its own timesteps on a non-square grid, with a LoRA scale in
``joint_attention_kwargs``; a key-padding mask through ``joint_attention_kwargs``), interval chunks that chain
both streams, the loop handing every block the same conditioning, why the single block has no FFN seam (and
that the ``-ffn`` backends are refused for the family, naming it), diffusers' own checkpointing flag, and the
preset at full size with its real input builder."""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

import pytest
import torch
from family_checks import check_chunks_run_whole, record_block_calls, sample_output

import gradseam
from gradseam.errors import UnsupportedStrategyError
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.registry import REGISTRY
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_bench_workload,
    check_builtin_flag,
    check_strategy,
    preset_model,
    randn,
)

DOUBLE, SINGLE, HEADS, HEAD_DIM = 4, 4, 2, 8
TEXT, TEXT_DIM, CHANNELS = 5, 12, 4

# 2 heads x 8 = 16 wide (RoPE axes 2 + 2 + 4 over a head), SwiGLU 64 wide, 4 double + 4 single blocks
TINY = dict(
    patch_size=1, in_channels=CHANNELS, out_channels=CHANNELS, num_layers=DOUBLE, num_single_layers=SINGLE,
    attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=TEXT_DIM, axes_dims_rope=(2, 2, 4),
)
CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
TORCH = {"gradient_checkpointing": True}


def ovis_model() -> torch.nn.Module:
    from diffusers import OvisImageTransformer2DModel

    return OvisImageTransformer2DModel(**TINY)


def _ids(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's position ids: ``[0, row, col]`` for the image, ``[0, i, i]`` for the text."""
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    img = torch.stack([torch.zeros_like(r), r, c], dim=-1).reshape(-1, 3).float()
    i = torch.arange(TEXT)
    return img, torch.stack([torch.zeros_like(i), i, i], dim=-1).float()


def ovis_inputs(g: torch.Generator, batch: int = 1, rows: int = 2, cols: int = 2) -> dict:
    img_ids, txt_ids = _ids(rows, cols)
    return {
        "hidden_states": randn(g, batch, rows * cols, CHANNELS, grad=True),
        "encoder_hidden_states": randn(g, batch, TEXT, TEXT_DIM, grad=True),
        "timestep": torch.full((batch,), 0.7),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
    }


def ovis_batch_inputs(g: torch.Generator) -> dict:
    # two samples at their own timesteps on a 2x3 grid; joint_attention_kwargs as a LoRA trainer passes them
    # (the decorator copies the dict once and pops the scale: every block gets that copy)
    inputs = ovis_inputs(g, batch=2, cols=3)
    return {**inputs, "timestep": torch.tensor([0.2, 0.9]), "joint_attention_kwargs": {"scale": 1.0}}


def _key_mask(batch: int, image_tokens: int) -> torch.Tensor:
    # a right-padded prompt in the second sample: its last two text tokens are not attended to
    keep = torch.ones(batch, TEXT + image_tokens, dtype=torch.bool)
    keep[-1, TEXT - 2:TEXT] = False
    return keep[:, None, None, :]


def ovis_mask_inputs(g: torch.Generator) -> dict:
    # the pipeline passes no mask (every prompt is padded to 256 and the padding's states zeroed); a trainer
    # can hand the processor a key mask through joint_attention_kwargs, which every block passes to attn
    inputs = ovis_inputs(g, batch=2)
    return {**inputs, "joint_attention_kwargs": {"attention_mask": _key_mask(2, 4)}}


OVIS = Case("ovis-image", ovis_model, ovis_inputs)
OVIS_BATCH = Case("ovis-image-batch", ovis_model, ovis_batch_inputs)
OVIS_MASK = Case("ovis-image-mask", ovis_model, ovis_mask_inputs)
CASES = [OVIS, OVIS_BATCH, OVIS_MASK]


# -- The conformance kit ------------------------------------------------------------------------
class TestOvisImage(ConformanceSuite):
    case = OVIS


class TestOvisImageBatch(ConformanceSuite):
    case = OVIS_BATCH
    reduced = True


class TestOvisImageMask(ConformanceSuite):
    case = OVIS_MASK
    reduced = True


# -- Chunks and the loop's arguments ---------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_interval_chunks_chain_both_streams_in_both_lists(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back): every chunk must run whole, and the text stream,
    # which no output reads after the last single block, must still get its gradient through them.
    report = check_chunks_run_whole(case, CHUNKED, [
        "single_transformer_blocks[0, 1]", "single_transformer_blocks[2, 3]",
        "transformer_blocks[0, 1]", "transformer_blocks[2, 3]",
    ])
    assert report.saved_ratio < 1
    assert report.patched.input_grads["encoder_hidden_states"].abs().sum() > 0


@pytest.mark.parametrize("case", [OVIS_BATCH, OVIS_MASK], ids=lambda c: c.name)
def test_the_loop_hands_every_block_the_same_conditioning(case: Case) -> None:
    # What the carry relies on: temb, the RoPE tuple and joint_attention_kwargs are one object each for all
    # eight blocks (both lists), and the streams are what the previous block returned, across the lists too.
    model = case.fresh()
    seen, returned = record_block_calls([*model.transformer_blocks, *model.single_transformer_blocks])
    with torch.no_grad():
        model(**case.inputs(torch.Generator().manual_seed(1)))
    assert len(seen) == DOUBLE + SINGLE
    for name in ("temb", "image_rotary_emb", "joint_attention_kwargs"):
        assert all(kw[name] is seen[0][name] for kw in seen), name
    assert "scale" not in seen[0]["joint_attention_kwargs"]  # popped once by the LoRA-scale decorator
    for before, kw in zip(returned, seen[1:]):
        assert kw["encoder_hidden_states"] is before[0] and kw["hidden_states"] is before[1]


def test_variant_inputs_change_the_output() -> None:
    assert not torch.equal(sample_output(OVIS_MASK), sample_output(OVIS_MASK, joint_attention_kwargs=None))
    assert not torch.equal(sample_output(OVIS_BATCH), sample_output(OVIS_BATCH, timestep=torch.tensor([0.2, 0.2])))


def test_diffusers_own_checkpointing_flag() -> None:
    # the model's own path passes the blocks' arguments positionally, joint_attention_kwargs included
    check_builtin_flag(OVIS_MASK, CHUNKED)


# -- No FFN seam in the single block, hence none for the family ------------------------------------
def test_the_single_blocks_mlp_is_no_strict_chain() -> None:
    # act_mlp is called on a view of half of proj_mlp's output, not on the output itself; the other half
    # bypasses it and meets act_mlp's output in a product outside any module.
    model = OVIS.fresh()
    block = model.single_transformer_blocks[0]
    calls: dict[str, tuple] = {}

    def record(name: str) -> Any:
        def hook(_module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            calls.setdefault(name, (args[0], out))

        return hook

    for name in ("proj_mlp", "act_mlp"):
        getattr(block, name).register_forward_hook(record(name))
    with torch.no_grad():
        model(**ovis_inputs(torch.Generator().manual_seed(1)))
    proj_out, (act_in, _) = calls["proj_mlp"][1], calls["act_mlp"]
    assert act_in is not proj_out  # a view into the second half of proj_mlp's output
    assert act_in.untyped_storage().data_ptr() == proj_out.untyped_storage().data_ptr()
    assert act_in.data_ptr() > proj_out.data_ptr()
    assert act_in.shape[-1] * 2 == proj_out.shape[-1] == 2 * block.mlp_hidden_dim


def test_ffn_backends_are_refused_naming_the_single_block() -> None:
    family = REGISTRY.get("ovis-image")
    assert not family.has_ffn
    assert [bc.ffn for bc in family.block_classes] == [(("ff",), ("ff_context",)), ()]
    model = OVIS.fresh()
    dicts = {name: set(m.__dict__) for name, m in model.named_modules()}
    single_too = [{"blocks": f"single_transformer_blocks[0:{SINGLE}]", "gradient_checkpointing_backend": "torch-ffn"}]
    for config in ({**TORCH, "gradient_checkpointing_backend": "torch-ffn"},
                   {**TORCH, "gradient_checkpointing_backend": "unsloth-ffn"},
                   {**TORCH, "gradient_checkpointing_blocks": single_too}):
        with pytest.raises(UnsupportedStrategyError, match="declares none for \\['OvisImageSingleTransformerBlock'\\]"):
            gradseam.patch(model, config)
    assert gradseam.handle_of(model) is None
    assert {name: set(m.__dict__) for name, m in model.named_modules()} == dicts


def test_an_ffn_entry_for_the_double_blocks_alone_runs_their_seams_exactly() -> None:
    # what a kind asks of every block class is asked of the blocks an entry covers: the double blocks have seams
    double_only = [{"blocks": f"transformer_blocks[0:{DOUBLE}]", "gradient_checkpointing_backend": "torch-ffn"}]
    report = check_strategy(OVIS, {**TORCH, "gradient_checkpointing_blocks": double_only})
    kinds = {(r.label.split("[")[0], r.kind) for r in report.regions}
    assert kinds == {("transformer_blocks", "ffn-seam"), ("single_transformer_blocks", "whole-block")}, kinds


def _trial(monkeypatch: pytest.MonkeyPatch, single: tuple) -> None:
    """The family with the single blocks given ``single`` as their seams, for one test."""
    import gradseam.patcher as patcher

    family = REGISTRY.get("ovis-image")
    trial = replace(family, block_classes=(family.block_classes[0], replace(family.block_classes[1], ffn=single)))
    monkeypatch.setattr(patcher, "family_for", lambda _m: trial)


FFN = {**TORCH, "gradient_checkpointing_backend": "torch-ffn"}


def test_a_proj_mlp_act_mlp_seam_would_not_run_as_one_region(monkeypatch: pytest.MonkeyPatch) -> None:
    # Flux's single-block seam, tried here: exact (the chain falls back), but never whole
    _trial(monkeypatch, (("proj_mlp", "act_mlp"),))
    report = check_strategy(OVIS, FFN)
    single = [r for r in report.regions if r.label.startswith("single_transformer_blocks")]
    assert len(single) == SINGLE and not any(r.whole for r in single), single


@pytest.mark.parametrize("seam", ["proj_mlp", "act_mlp"])
def test_a_one_module_seam_would_save_nothing(monkeypatch: pytest.MonkeyPatch, seam: str) -> None:
    # Either module alone is a region that runs whole and exactly, yet a step keeps as many bytes as with the
    # single blocks left out of the -ffn plan: what it drops is kept outside it anyway.
    _trial(monkeypatch, ((seam,),))
    without = {**FFN, "gradient_checkpointing_blocks": [
        {"blocks": f"single_transformer_blocks[0:{SINGLE}]", "gradient_checkpointing": False}]}
    report = check_strategy(OVIS, FFN, whole=True)
    assert sum(r.label.startswith("single_transformer_blocks") for r in report.regions) == SINGLE
    assert report.patched.saved_bytes == check_strategy(OVIS, without).patched.saved_bytes


# -- The preset at full size ----------------------------------------------------------------------
def test_preset_plans_at_full_size() -> None:
    from diffusers import OvisImageTransformer2DModel

    family, preset, model = preset_model("ovis-image", "7b-1024")
    assert set(family.presets) == {"7b-1024"} and family_for(model) is family
    assert preset.config == {}  # the class defaults are the released Ovis-Image-7B config
    defaults = {k: v.default for k, v in inspect.signature(OvisImageTransformer2DModel.__init__).parameters.items()}
    assert [defaults[k] for k in ("in_channels", "num_layers", "num_single_layers", "num_attention_heads",
                                  "attention_head_dim", "joint_attention_dim")] == [64, 6, 27, 24, 128, 2048]
    assert 7.2e9 < sum(p.numel() for p in model.parameters()) < 7.5e9
    double, single = model.transformer_blocks[0], model.single_transformer_blocks[0]
    assert (len(model.transformer_blocks), len(model.single_transformer_blocks), double.attn.heads) == (6, 27, 24)
    assert double.ff.net[0].proj.out_features == single.proj_mlp.out_features == 2 * 12288
    for config, regions in ((TORCH, 33), (CHUNKED, 3 + 14)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert len(the_plan.regions) == regions


def test_preset_inputs_have_the_pipelines_sizes() -> None:
    _, preset, model = preset_model("ovis-image", "7b-1024")
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 4096, 64) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 256, 2048)
    assert x["img_ids"].shape == (4096, 3) and x["txt_ids"].shape == (256, 3) and x["timestep"].shape == (1,)
    assert preset.make_inputs(model, "meta", torch.bfloat16, 1024, **preset.inputs)["hidden_states"].shape[1] == 1024


def test_preset_input_builder_runs_the_model() -> None:
    family = REGISTRY.get("ovis-image")
    model = OVIS.fresh()
    x = family.presets["7b-1024"].make_inputs(model, "cpu", torch.float32, None, image_tokens=9, text_tokens=TEXT)
    assert x["txt_ids"].tolist() == _ids(1, 1)[1].tolist()  # [0, i, i], as the pipeline places the text
    assert x["img_ids"][:, 1:].tolist() == [[r, c] for r in range(3) for c in range(3)]
    out = model(**x).sample
    assert out.shape == (1, 9, CHANNELS)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_steps_and_patches_exactly() -> None:
    """`gradseam bench --family ovis-image --layers 2` on a tiny config with the real input builder."""
    check_bench_workload("ovis-image", TINY, {"image_tokens": 4, "text_tokens": TEXT}, sequence=4)
