"""Motif-Video (MotifVideoTransformer3DModel) through the conformance kit, plus its presets.

The plain case (text cross-attention on in every encoder block, a right-padded prompt, two
single-stream encoder blocks then two decoder blocks) runs the kit's whole matrix. Image-to-video
(SigLIP tokens in front of the prompt, so ``image_embed_seq_len`` reaches every encoder block) as a
batch of two with their own timesteps and padding, and a model whose decoder starts at an odd block
(an interval-2 chunk then spans the encoder/decoder boundary and falls back, exactly) run the reduced
matrix. Then: the chunks run whole, the boundary chunk is the only one that falls back, what the loop
hands each block (shared in the encoder, the clone and no mask in the decoder), the declared seams and
attention sides, diffusers' own checkpointing flag, and the presets at full size.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch
from family_checks import prompt_mask, record_block_calls

import gradseam
from gradseam.adapters.motif_video import MOTIF_VIDEO_2B
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    ParityReport,
    check_bench_workload,
    check_builtin_flag,
    check_strategy,
    preset_model,
    randn,
    reduced_configs,
    reduced_offload_configs,
)

CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}

# 2 heads of 8 (16 wide; RoPE 2 + 2 + 4 over frame, row, column), prompt states 16 wide, SigLIP states 8.
# Two dual blocks (one chunk at interval 2), four single blocks: two encoder blocks, then two decoder blocks
# (the boundary falls between the interval-2 chunks). 2 latent frames of 4 x 4 in patches of 2: 8 video tokens.
TEXT, IMAGE = 6, 3
TINY = {
    "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 2,
    "num_single_layers": 4, "num_decoder_layers": 2, "patch_size": 2, "text_embed_dim": 16, "image_embed_dim": 8,
    "rope_axes_dim": (2, 2, 4), "enable_text_cross_attention_dual": True, "enable_text_cross_attention_single": True,
}
ODD = {**TINY, "num_decoder_layers": 1}  # three encoder blocks, one decoder block: chunk [2, 3] spans the boundary


def _model(**config: object) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        from diffusers import MotifVideoTransformer3DModel

        return MotifVideoTransformer3DModel(**config)

    return build


def motif_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": randn(g, 1, 4, 2, 4, 4, grad=True),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": randn(g, 1, TEXT, 16, grad=True),
        "encoder_attention_mask": prompt_mask(TEXT, 4),
    }


def motif_i2v_inputs(g: torch.Generator) -> dict:
    # the first frame's SigLIP states go in front of the prompt (the model widens the mask with ones)
    return {
        "hidden_states": randn(g, 2, 4, 2, 4, 4, grad=True),
        "timestep": torch.tensor([150.0, 850.0]),
        "encoder_hidden_states": randn(g, 2, TEXT, 16, grad=True),
        "encoder_attention_mask": prompt_mask(TEXT, 6, 3),
        "image_embeds": randn(g, 2, IMAGE, 8, grad=True),
    }


MOTIF = Case("motif-video", _model(**TINY), motif_inputs)
MOTIF_I2V = Case("motif-video-i2v-batch", _model(**TINY), motif_i2v_inputs)
MOTIF_ODD = Case("motif-video-odd-decoder", _model(**ODD), motif_inputs)


class TestMotifVideo(ConformanceSuite):
    case = MOTIF


class TestMotifVideoI2VBatch(ConformanceSuite):
    case = MOTIF_I2V
    reduced = True


class TestMotifVideoOddDecoder(ConformanceSuite):
    case = MOTIF_ODD
    whole_regions = False  # the chunk across the encoder/decoder boundary computes block by block, on purpose
    # the chunk rows only (kept and offloaded attention; the plain row is the test below): the seams are the
    # plain case's
    configs = reduced_configs(ffn=False, blocks=False)
    offload = reduced_offload_configs(ffn=False)
    quantized_bases = ()


# -- the chunks ---------------------------------------------------------------------------------


def _chunks(report: ParityReport) -> dict[str, bool]:
    return {r.label: r.whole for r in report.regions if r.shape == "chunk"}


def test_chunks_run_whole_on_both_sides_of_the_decoder_boundary() -> None:
    # A wrong carry would still be exact (chunks fall back), so parity alone cannot tell: every chunk, the
    # encoder's and the decoder's, must be served whole (the plain case's suite checks the same), and the
    # text stream gets its gradient.
    report = check_strategy(MOTIF_I2V, CHUNKED, whole=True)
    assert _chunks(report) == {
        "transformer_blocks[0, 1]": True, "single_transformer_blocks[0, 1]": True,
        "single_transformer_blocks[2, 3]": True,
    }
    assert report.saved_ratio < 1
    assert report.patched.input_grads["encoder_hidden_states"].abs().sum() > 0


def test_a_chunk_across_the_decoder_boundary_falls_back_exactly() -> None:
    # With the decoder starting at block 3, chunk [2, 3] runs block 3 ahead as an encoder block; the model
    # then calls it with the clone of the embedded latents, so it computes alone. Exact (check_strategy
    # demands it), and the only chunk that does not run whole.
    report = check_strategy(MOTIF_ODD, CHUNKED)
    assert _chunks(report) == {
        "transformer_blocks[0, 1]": True, "single_transformer_blocks[0, 1]": True,
        "single_transformer_blocks[2, 3]": False,
    }
    assert report.saved_ratio < 1


def test_what_the_loop_hands_each_block() -> None:
    # What the carry relies on, and why the boundary breaks a chunk: in the encoder (dual and single blocks)
    # temb, the mask, the RoPE tuple and the image token count are one object each and the streams are the
    # previous block's outputs; the decoder gets a clone made before the loop, the encoder's video output as
    # its second stream, no mask and the default image token count.
    model = MOTIF_I2V.fresh()
    seen, returned = record_block_calls([*model.transformer_blocks, *model.single_transformer_blocks])
    with torch.no_grad():
        model(**motif_i2v_inputs(torch.Generator().manual_seed(1)))
    assert len(seen) == 6
    encoder, decoder = seen[:4], seen[4:]
    for name in ("temb", "attention_mask", "image_rotary_emb"):
        assert all(kw[name] is encoder[0][name] for kw in encoder), name
    assert all(kw["image_embed_seq_len"] == IMAGE for kw in encoder)
    assert encoder[0]["attention_mask"].shape == (2, 1, 1, 8 + IMAGE + TEXT)
    for before, kw in zip(returned[:3], encoder[1:]):
        assert kw["hidden_states"] is before[0] and kw["encoder_hidden_states"] is before[1]
    first = decoder[0]
    assert first["hidden_states"] is not returned[3][0] and first["encoder_hidden_states"] is returned[3][0]
    assert all(kw["attention_mask"] is None and "image_embed_seq_len" not in kw for kw in decoder)
    assert decoder[1]["hidden_states"] is returned[4][0] and decoder[1]["encoder_hidden_states"] is returned[4][1]
    assert decoder[1]["temb"] is first["temb"] and decoder[1]["image_rotary_emb"] is first["image_rotary_emb"]


# -- the cuts -----------------------------------------------------------------------------------


def test_seams_and_attention_sides_are_as_declared() -> None:
    model = MOTIF.fresh()
    family = family_for(model)
    assert family.name == "motif-video" and family.has_ffn and family.has_attention and family.supports_interval
    # decoder blocks are built without the text cross-attention, whatever the flag says
    assert [b.cross_attn is not None for b in model.single_transformer_blocks] == [True, True, False, False]
    ffn = plan(model, family, gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.list_path, r.blocks, r.seam) for r in ffn.regions] == [
        *[("transformer_blocks", (i,), s) for i in range(2) for s in (("ff",), ("ff_context",))],
        *[("single_transformer_blocks", (i,), ("proj_mlp", "act_mlp")) for i in range(4)],
    ]
    # without cross-attention (the class defaults) the same seams, and attention offload is still allowed
    plain = _model(**{**TINY, "enable_text_cross_attention_dual": False,
                      "enable_text_cross_attention_single": False})()
    assert all(b.cross_attn is None for b in [*plain.transformer_blocks, *plain.single_transformer_blocks])
    assert len(plan(plain, family, gradseam.CheckpointConfig.coerce(FFN)).regions) == 8


def test_variant_inputs_change_the_output() -> None:
    # each input the cases vary reaches the blocks: the prompt padding, the image tokens, the cross-attention
    def output(case: Case, **changes: object) -> torch.Tensor:
        model = case.fresh()
        with torch.no_grad():
            return model(**{**case.inputs(torch.Generator().manual_seed(1)), **changes}).sample

    plain = output(MOTIF)
    assert not torch.equal(plain, output(MOTIF, encoder_attention_mask=None))
    i2v = output(MOTIF_I2V)
    assert not torch.equal(i2v, output(MOTIF_I2V, image_embeds=None))
    assert not torch.equal(i2v[1], output(MOTIF_I2V, encoder_attention_mask=prompt_mask(TEXT, 6, 6))[1])
    model = MOTIF.fresh()
    for block in model.single_transformer_blocks[:2]:
        block.cross_attn = None
    with torch.no_grad():
        assert not torch.equal(plain, model(**motif_inputs(torch.Generator().manual_seed(1))).sample)


def test_the_builtin_flag_is_exact_and_owned_by_gradseam() -> None:
    # diffusers' flag passes every argument positionally (five in the decoder loop, six before it)
    check_builtin_flag(MOTIF_I2V, CHUNKED)


# -- presets at full size -----------------------------------------------------------------------

PRESETS = {"2b-720p": (31, 92, 160, 0), "2b-i2v-720p": (31, 92, 160, 4096), "2b-480p": (31, 60, 104, 0)}


def test_presets_plan_at_full_size() -> None:
    # the three presets share one trunk: one config, planned once at full size on the meta device
    from diffusers import MotifVideoTransformer3DModel

    family, _, model = preset_model("motif-video", "2b-720p")
    assert set(family.presets) == set(PRESETS) and family_for(model) is family
    assert all(dict(p.config) == MOTIF_VIDEO_2B for p in family.presets.values())
    params = set(inspect.signature(MotifVideoTransformer3DModel.__init__).parameters) - {"self"}
    assert set(MOTIF_VIDEO_2B) <= params and params - set(MOTIF_VIDEO_2B) == {"rope_theta"}
    assert 2.0e9 < sum(p.numel() for p in model.parameters()) < 2.1e9
    block = model.transformer_blocks[0]
    assert (len(model.transformer_blocks), len(model.single_transformer_blocks), model.num_decoder_layers) == (12, 24, 8)
    assert (block.attn.heads, block.ff.net[0].proj.out_features) == (12, 4 * 1536)
    assert [b.cross_attn is not None for b in model.single_transformer_blocks] == [True] * 16 + [False] * 8
    for config, regions in (({"gradient_checkpointing": True}, 36), (CHUNKED, 6 + 12), (FFN, 2 * 12 + 24)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert len(the_plan.regions) == regions
        assert {(r.list_path, i) for r in the_plan.regions for i in r.blocks} == {
            *(("transformer_blocks", i) for i in range(12)), *(("single_transformer_blocks", i) for i in range(24))
        }
    # at interval 2 (and 4, 8) the released 16 + 8 split falls between chunks: no chunk spans it
    chunks = plan(model, family, gradseam.CheckpointConfig.coerce(CHUNKED)).regions
    assert ("single_transformer_blocks", (16, 17)) in [(r.list_path, r.blocks) for r in chunks]


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_inputs_have_the_pipelines_sizes(name: str) -> None:
    _, preset, model = preset_model("motif-video", name)
    frames, h, w, image = PRESETS[name]
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    assert x["hidden_states"].shape == (1, 33, frames, h, w) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 512, 2560)
    assert x["encoder_attention_mask"].shape == (1, 512) and x["timestep"].shape == (1,)
    assert ("image_embeds" in x) == bool(image)
    if image:
        assert x["image_embeds"].shape == (1, image, 1152)
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 4 * (h // 2) * (w // 2), **preset.inputs)
    assert fewer["hidden_states"].shape == (1, 33, 4, h, w)


def test_preset_input_builder_runs_the_model() -> None:
    # the builder's inputs must be ones the model takes: the tiny model, at a tiny size, a short prompt
    preset = gradseam.registry.REGISTRY.get("motif-video").presets["2b-i2v-720p"]
    model = MOTIF.fresh()
    x = preset.make_inputs(model, "cpu", torch.float32, frames=5, height=32, width=32, text_tokens=TEXT,
                           prompt_tokens=4, image_tokens=IMAGE)
    assert x["hidden_states"].shape == (1, 4, 2, 4, 4) and int(x["encoder_attention_mask"].sum()) == 4
    out = model(**x).sample
    assert out.shape == (1, 4, 2, 4, 4)
    out.square().mean().backward()
    assert x["hidden_states"].grad is not None


def test_bench_workload_truncates_and_patches_exactly() -> None:
    """`gradseam bench --family motif-video --layers 2` on a tiny preset with the real input builder."""
    check_bench_workload("motif-video", TINY, {"frames": 5, "height": 32, "width": 32, "text_tokens": TEXT},
                         preset="2b-720p", sequence=2 * 2 * 2)
