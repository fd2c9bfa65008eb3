"""DiT (DiTTransformer2DModel) through the conformance kit, plus its presets.

The plain case (one image, one class) runs the kit's whole matrix with the model's label dropout on:
in training mode every block draws its own random numbers to drop labels, so exactness covers the
generators' restore in recomputes and chunks. A batch of two (own timesteps and classes) and the
feed-forward chunking a user can switch on per block (``ff`` then runs once per slice) run the
reduced matrix. Then: the chunks run whole with the draws inside, the loop hands every block the
same conditioning, the seam and the attention side are what the adapter declares, diffusers' own
checkpointing flag, what weight streaming does to the model's call into block 0 after the loop,
and the presets at full size with their real input builder.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from family_checks import assert_plans_cover_every_block, record_block_calls

import gradseam
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
    preset_model,
    randn,
    run_step,
)

CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}
STREAM = "gradient_checkpointing_stream_weights"

# 2 heads x 8 = 16 wide, 4 blocks, 10 classes; an 8 x 8 latent in 2 x 2 patches: 16 tokens.
CLASSES = 10
TINY = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=4,
            sample_size=8, patch_size=2, num_embeds_ada_norm=CLASSES)
SLICES = 4  # feed-forward chunking: 16 tokens in slices of 4


def _reseed(_module: torch.nn.Module, _args: tuple) -> None:
    # Label dropout draws from torch's global generator; the kit runs the reference and the patched step at
    # different points of it. Reseeding when the model's forward starts makes every step drop the same labels
    # (recomputes and chunks must still restore the generators exactly in between).
    torch.manual_seed(1234)


def dit_model(chunk_ff: bool = False) -> torch.nn.Module:
    from diffusers import DiTTransformer2DModel

    model = DiTTransformer2DModel(**TINY)
    for block in model.transformer_blocks:
        # upstream drops a label with p=0.1; at 0.5 the four blocks and the final call draw both outcomes
        block.norm1.emb.class_embedder.dropout_prob = 0.5
        if chunk_ff:
            block.set_chunk_feed_forward(SLICES, 1)  # along the tokens
    model.register_forward_pre_hook(_reseed)
    return model


def dit_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": randn(g, 1, 4, 8, 8, grad=True),
        "timestep": torch.tensor([500]),
        "class_labels": torch.tensor([3]),
    }


def dit_batch_inputs(g: torch.Generator) -> dict:
    # two images at their own timesteps and classes, as a training batch (int64, as the pipeline passes them)
    return {
        "hidden_states": randn(g, 2, 4, 8, 8, grad=True),
        "timestep": torch.tensor([37, 912]),
        "class_labels": torch.tensor([3, 8]),
    }


def _sample(out: object) -> torch.Tensor:
    return out.sample  # type: ignore[attr-defined]


DIT = Case("dit", dit_model, dit_inputs, output=_sample)
DIT_BATCH = Case("dit-batch", dit_model, dit_batch_inputs, output=_sample)
DIT_CHUNKED_FF = Case("dit-chunked-ff", lambda: dit_model(chunk_ff=True), dit_batch_inputs, output=_sample)
CASES = [DIT, DIT_BATCH, DIT_CHUNKED_FF]


class TestDiT(ConformanceSuite):
    case = DIT


class TestDiTBatch(ConformanceSuite):
    case = DIT_BATCH
    reduced = True


class TestDiTChunkedFeedForward(ConformanceSuite):
    case = DIT_CHUNKED_FF
    reduced = True


# -- the carry -----------------------------------------------------------------------------------


def test_label_dropout_draws_inside_the_blocks_and_the_chunks_still_run_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The draws matter (training mode drops labels, eval mode does not) and happen inside every block: a chunk
    # runs its second block ahead, so it must put the generators back for the model's own call to be served.
    model = DIT_BATCH.fresh()
    draws: list[tuple] = []
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: draws.append(a) or real_rand(*a, **k))
    x = dit_batch_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        train = model(**x).sample
        # one draw per block and one for the final modulation, one number per label
        assert draws == [(2,)] * (4 + 1)
        assert not torch.equal(train, model.eval()(**x).sample)
    monkeypatch.undo()
    report = check_strategy(DIT_BATCH, CHUNKED, whole=True)
    assert sorted(r.label for r in report.regions if r.shape == "chunk") == [
        "transformer_blocks[0, 1]", "transformer_blocks[2, 3]"
    ]
    assert report.saved_ratio < 1


def test_the_loop_hands_every_block_the_same_conditioning() -> None:
    # What the carry relies on: timestep, class_labels and cross_attention_kwargs are the model's own objects
    # for every block, the masks and text None, and hidden_states is what the previous block returned.
    model = DIT_BATCH.fresh()
    seen, returned = record_block_calls(model.transformer_blocks)
    x = dit_batch_inputs(torch.Generator().manual_seed(1))
    kwargs = {"scale": None}
    with torch.no_grad():
        model(**x, cross_attention_kwargs=kwargs)
    assert len(seen) == 4
    for call in seen:
        assert call["timestep"] is x["timestep"] and call["class_labels"] is x["class_labels"]
        assert call["cross_attention_kwargs"] is kwargs
        for name in ("attention_mask", "encoder_hidden_states", "encoder_attention_mask"):
            assert call.get(name) is None
    for before, call in zip(returned, seen[1:]):
        assert call["hidden_states"] is before


# -- the seams -----------------------------------------------------------------------------------


def test_the_seam_is_ff_and_the_attention_side_attn1() -> None:
    model = DIT.fresh()
    family = family_for(model)
    assert family.name == "dit"
    assert all(b.attn2 is None and b.norm2 is None for b in model.transformer_blocks)  # no cross-attention
    the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.blocks, r.seam) for r in the_plan.regions] == [((i,), ("ff",)) for i in range(4)]
    sites = check_declared_sides(DIT)  # every kernel inside attn1, none inside ff
    assert sites.count == 4 and {s.module for s in sites.sites} == {"attn1"}


def test_chunked_feed_forward_runs_ff_once_per_slice() -> None:
    # With set_chunk_feed_forward, ff is called on each slice of the modulated norm3 output: every call is a
    # region of its own, all run, and the step is exact.
    report = check_strategy(DIT_CHUNKED_FF, FFN, whole=True)
    ff = [r for r in report.regions if r.shape == "ffn"]
    assert len(ff) == 4 and all(r.calls == (SLICES,) and r.runs == SLICES and r.whole for r in ff), ff


def test_the_builtin_flag_is_exact_and_owned_by_gradseam() -> None:
    # diffusers' flag passes the block's arguments positionally, in the order of its parameters
    check_builtin_flag(DIT_BATCH, CHUNKED)


# -- what weight streaming does to block 0 -------------------------------------------------------


def _frozen_dit() -> torch.nn.Module:
    model = dit_model()
    # streaming moves frozen weights only: the output layer trains, as a LoRA would
    model.requires_grad_(False)
    model.proj_out_2.requires_grad_(True)
    return model


FROZEN = Case("dit-frozen", _frozen_dit, dit_batch_inputs, output=_sample)


@pytest.mark.parametrize("stream", [1, 3, "all"])
def test_block_0_streams_but_the_norm1_emb_the_model_calls_after_the_loop_stays_resident(stream, monkeypatch) -> None:
    # After the loop the model calls transformer_blocks[0].norm1.emb itself, outside block 0's forward, where a
    # streamed block's weights are their host copies (on a GPU: a device mismatch). The family declares the call
    # (called_outside), so when block 0 streams (past half of the blocks: they are spread from the middle), that
    # submodule stays with the model and the rest of the block streams. A released weight is poisoned (NaN) here
    # instead of pointing at its host copy, so any use of a streamed weight outside its block's load would show.
    from test_weight_streaming import poison_releases

    want = run_step(FROZEN.fresh(), FROZEN, count_bytes=False)
    poison_releases(monkeypatch)
    model = FROZEN.fresh()
    first, second = model.transformer_blocks[0], model.transformer_blocks[1]
    with cpu_test_mode(), gradseam.patch(model, {"gradient_checkpointing": True, STREAM: stream}) as handle:
        streamed = {id(e.tensor) for b in handle.weights.blocks for e in b.tensors}
        got = run_step(model, FROZEN, count_bytes=False)
        said = str(handle.summary())
    emb = {id(p) for p in first.norm1.emb.parameters()}
    rest = {id(p) for p in first.parameters()} - emb
    assert not streamed & emb, "the submodule called after the loop streamed"
    assert (rest <= streamed) == (stream != 1), "block 0 streams past half of the blocks, apart from norm1.emb"
    kept_note = "not streamed (the model calls them outside their block): DiTTransformer2DModel.transformer_blocks[0]" \
        ".norm1.emb"
    assert (kept_note in said) == (stream != 1), said
    if stream == "all":  # only the call that is declared stays: block 1's norm1.emb streams
        assert {id(p) for p in second.norm1.emb.parameters()} <= streamed
    assert_same_step(want, got, what=f"stream {stream}, released weights poisoned")


def test_the_advice_counts_block_0_without_the_norm1_emb_that_stays_resident() -> None:
    # advise and auto price each block's streamed weights; block 0's norm1.emb never streams, so it is not in them
    from gradseam.tools.advise import frozen_block_gib

    model = FROZEN.fresh()
    got = frozen_block_gib(model, family_for(model))
    size = [sum(p.nbytes for p in block.parameters()) / 2**30 for block in model.transformer_blocks]
    emb = sum(p.nbytes for p in model.transformer_blocks[0].norm1.emb.parameters()) / 2**30
    assert emb > 0 and got == pytest.approx([size[0] - emb, *size[1:]], rel=0, abs=1e-15)


def test_the_kit_fails_dit_without_its_call_from_outside_block_0() -> None:
    # What the conformance kit watches (locate_kernels' call stack over every block submodule, in its unpatched
    # step): the call after the loop is the only one outside its block, and without its declaration the kit fails
    # the family, naming the call and the declaration to add; a declared path the block does not have fails too.
    from dataclasses import replace

    from gradseam.testing import locate_kernels
    from gradseam.testing.outside import assert_outside_calls_declared

    model = DIT.fresh()
    family = family_for(model)
    with torch.no_grad(), locate_kernels(model, family) as kernels:
        model(**DIT.inputs(torch.Generator().manual_seed(1)))
    found = kernels.outside
    assert found == {("transformer_blocks", 0, "norm1.emb")}
    assert_outside_calls_declared(found, family, model, what="dit")

    def declaring(calls) -> object:
        return replace(family, block_lists=tuple(replace(bl, called_outside=calls) for bl in family.block_lists))

    with pytest.raises(AssertionError, match=r"dit: the model calls transformer_blocks\[0\]\.norm1\.emb outside that "
                       r"block's own forward.*called_outside=\(\(0, 'norm1\.emb'\),\)"):
        assert_outside_calls_declared(found, declaring(()), model, what="dit")
    assert_outside_calls_declared(found, declaring(((-4, "norm1"),)), model, what="dit")  # a parent, from the end
    with pytest.raises(AssertionError, match=r"called_outside names 'norm1.embed', which block 0 does not have"):
        assert_outside_calls_declared(found, declaring(((0, "norm1.embed"),)), model, what="dit")


def test_the_kit_fails_a_model_reading_a_blocks_tensor_outside_it_until_declared() -> None:
    # A read, not a call: the model uses one of block 1's tensors itself (as a final layer reading a block's
    # modulation table would). locate_kernels' torch function mode sees it inside the model's forward while no
    # call into block 1 runs; the kit names the tensor and the declaration, which may name the tensor itself, and
    # streaming then keeps exactly that tensor resident.
    from dataclasses import replace

    from gradseam.offload.weights import kept_tensor_ids
    from gradseam.testing import locate_kernels
    from gradseam.testing.outside import assert_outside_calls_declared

    model = DIT.fresh()
    family = family_for(model)
    bias = model.transformer_blocks[1].ff.net[2].bias
    original = model.forward

    def reading(*args, **kwargs):
        out = original(*args, **kwargs)
        bias.mean()  # the read: block 1 is not running
        return out

    model.forward = reading
    with torch.no_grad(), locate_kernels(model, family) as kernels:
        model(**DIT.inputs(torch.Generator().manual_seed(1)))
    assert kernels.reads == {("transformer_blocks", 1, "ff.net.2.bias")}

    def declaring(calls) -> object:
        return replace(family, block_lists=tuple(replace(bl, called_outside=calls) for bl in family.block_lists))

    with pytest.raises(AssertionError, match=r"dit: the model reads transformer_blocks\[1\]\.ff\.net\.2\.bias outside "
                       r"that block's own forward.*called_outside=\(\(1, 'ff\.net\.2\.bias'\),\)"):
        assert_outside_calls_declared(kernels.outside, family, model, what="dit", reads=kernels.reads)
    for declared in ("ff.net.2.bias", "ff.net.2"):  # the tensor, or a submodule holding it
        assert_outside_calls_declared(kernels.outside, declaring(((0, "norm1.emb"), (1, declared))), model,
                                      what="dit", reads=kernels.reads)
    block = model.transformer_blocks[1]
    assert kept_tensor_ids(block, ["ff.net.2.bias"]) == {id(bias)}
    assert kept_tensor_ids(block, ["ff.net.2"]) == {id(bias), id(block.ff.net[2].weight)}


# -- presets at full size ------------------------------------------------------------------------

PRESETS = {"xl-2-256": 32, "xl-2-512": 64}  # latent side: resolution / 8


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_plan_at_full_size(name: str) -> None:
    from diffusers import DiTTransformer2DModel

    family, preset, model = preset_model("dit", name)
    assert set(family.presets) == set(PRESETS)
    assert family_for(model) is family
    params = set(inspect.signature(DiTTransformer2DModel.__init__).parameters) - {"self"}
    assert set(preset.config) == params  # every constructor argument, spelled out
    # DiT-XL/2 is 675M with one timestep and label embedder; diffusers gives every block its own copy: 750M
    embedders = sum(p.numel() for b in model.transformer_blocks for p in b.norm1.emb.parameters())
    assert 6.7e8 < sum(p.numel() for p in model.parameters()) - embedders * 27 // 28 < 6.8e8
    assert 7.4e8 < sum(p.numel() for p in model.parameters()) < 7.6e8
    block = model.transformer_blocks[0]
    shape = (len(model.transformer_blocks), block.attn1.heads, block.ff.net[0].proj.out_features)
    assert shape == (28, 16, 4608)
    assert model.proj_out_2.out_features == 2 * 2 * 8 and model.pos_embed.height == PRESETS[name] // 2
    assert_plans_cover_every_block(model, family, 28, (
        ({"gradient_checkpointing": True}, 28), (CHUNKED, 14), (FFN, 28)
    ))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_inputs_have_the_training_sizes(name: str) -> None:
    _, preset, model = preset_model("dit", name)
    side = PRESETS[name]
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (32, 4, side, side) and x["hidden_states"].requires_grad
    assert x["timestep"].shape == x["class_labels"].shape == (32,)
    assert x["timestep"].dtype == x["class_labels"].dtype == torch.int64
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 64, **preset.inputs)
    assert fewer["hidden_states"].shape == (32, 4, 16, 16)  # 8 x 8 patches of 2


def test_preset_input_builder_runs_the_model() -> None:
    preset = gradseam.registry.REGISTRY.get("dit").presets["xl-2-256"]
    model = DIT.fresh()
    x = preset.make_inputs(model, "cpu", torch.float32, None, resolution=64, batch=3)
    assert x["class_labels"].max() < CLASSES and x["timestep"].max() < 1000
    out = model(**x).sample
    assert out.shape == (3, 8, 8, 8)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_steps_and_patches_exactly() -> None:
    """`gradseam bench --family dit --layers 2` on a tiny preset with the real input builder. bench steps in
    training mode, where the blocks drop labels at random: a hook reseeds the generator at every forward of
    the model, so the reference step and the patched one drop the same labels."""
    from diffusers import DiTTransformer2DModel

    def reseed(module: torch.nn.Module, _args: tuple) -> None:
        if isinstance(module, DiTTransformer2DModel):
            torch.manual_seed(1234)

    hook = torch.nn.modules.module.register_module_forward_pre_hook(reseed)
    try:
        with warnings.catch_warnings():
            # bench casts with .to(bfloat16), on which diffusers comments
            warnings.filterwarnings("ignore", "There are modules in DiTTransformer2DModel")
            check_bench_workload("dit", TINY, {"resolution": 64, "batch": 2}, sequence=16)
    finally:
        hook.remove()
