"""HunyuanVideo (T2V, and both I2V variants) through the conformance kit, plus its presets.

The T2V case (guidance-distilled, a padded prompt) runs the kit's whole matrix: exact outputs and
every parameter and input gradient for ``torch`` / ``torch-ffn`` x interval x stride, kept
attention, the offload backends through the engine's CPU test mode, ``no_grad``, refusals. The
``latent_concat`` I2V case and the ``token_replace`` I2V case (other block classes, with the
token-replace embedding and first-frame token count passed to every block) run a reduced matrix.
Then: the chunks of all three lists run whole, a wrong carry is caught, the inputs really reach
the blocks, and every preset builds on the meta device and plans at full size.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from family_checks import blocks_per_list, chunks_served_whole

import gradseam
from gradseam.family import Carry
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_strategy,
    randn,
)

CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}

# Head width 8 split 2 + 2 + 4 over (frame, row, column) for RoPE; patch 1 keeps the video tiny.
# Three dual-stream blocks (a chunk and a lone block at interval 2), four single-stream blocks (two
# chunks; stride 4 leaves two alone), two refiner blocks (one chunk).
_TINY = {
    "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 3,
    "num_single_layers": 4, "num_refiner_layers": 2, "patch_size": 1, "text_embed_dim": 12,
    "pooled_projection_dim": 8, "rope_axes_dim": (2, 2, 4),
}
LISTS = ("context_embedder.token_refiner.refiner_blocks", "transformer_blocks", "single_transformer_blocks")


def _model(**overrides):
    def build():
        from diffusers import HunyuanVideoTransformer3DModel

        return HunyuanVideoTransformer3DModel(**{**_TINY, **overrides})

    return build


def hv_inputs(g: torch.Generator, *, channels: int = 4, guidance: bool = True) -> dict:
    # 2 latent frames x 2 x 2 video tokens; 6 prompt tokens, the last two padding
    inputs = {
        "hidden_states": randn(g, 1, channels, 2, 2, 2, grad=True),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": randn(g, 1, 6, 12, grad=True),
        "encoder_attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]]),
        "pooled_projections": randn(g, 1, 8, grad=True),
    }
    if guidance:
        inputs["guidance"] = torch.tensor([6000.0])
    return inputs


def hv_i2v_inputs(g: torch.Generator) -> dict:
    # latent_concat: latents, image latents and mask on channels (2 x 4 + 1); no guidance embedding
    return hv_inputs(g, channels=9, guidance=False)


HUNYUANVIDEO = Case("hunyuanvideo", _model(), hv_inputs)
HUNYUANVIDEO_I2V = Case(
    "hunyuanvideo-i2v", _model(in_channels=9, guidance_embeds=False, image_condition_type="latent_concat"),
    hv_i2v_inputs,
)
HUNYUANVIDEO_TOKEN_REPLACE = Case(
    "hunyuanvideo-token-replace", _model(image_condition_type="token_replace"), hv_inputs
)


class TestHunyuanVideo(ConformanceSuite):
    case = HUNYUANVIDEO


class TestHunyuanVideoI2V(ConformanceSuite):
    case = HUNYUANVIDEO_I2V
    reduced = True


class TestHunyuanVideoTokenReplace(ConformanceSuite):
    case = HUNYUANVIDEO_TOKEN_REPLACE
    reduced = True


# -- the chunks chain ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", [HUNYUANVIDEO, HUNYUANVIDEO_I2V, HUNYUANVIDEO_TOKEN_REPLACE], ids=lambda c: c.name)
def test_every_chunk_of_every_list_runs_whole(case: Case) -> None:
    # The token-replace embedding and the first frame's token count go to every block positionally,
    # as the same objects: they must not make a chunk fall back.
    assert chunks_served_whole(case, CHUNKED) == {
        "refiner_blocks[0, 1]": True, "transformer_blocks[0, 1]": True,
        "single_transformer_blocks[0, 1]": True, "single_transformer_blocks[2, 3]": True,
    }


def test_a_wrong_carry_is_caught(monkeypatch) -> None:
    # A carry that forgets the text stream is still exact (the later block, run ahead on the first
    # block's text input, sees the model pass it another one and computes alone), so only the
    # whole-region check can tell.
    torch.manual_seed(0)
    family = family_for(HUNYUANVIDEO.build())
    video_only = Carry({"hidden_states": 0})  # forgets the text stream
    wrong = replace(family, block_lists=tuple(
        replace(bl, carry=video_only) if bl.path == "transformer_blocks" else bl for bl in family.block_lists
    ))
    import gradseam.patcher as patcher

    monkeypatch.setattr(patcher, "family_for", lambda m: wrong)
    chunks = chunks_served_whole(HUNYUANVIDEO, CHUNKED)
    assert chunks["transformer_blocks[0, 1]"] is False
    assert chunks["single_transformer_blocks[0, 1]"] is True
    with pytest.raises(AssertionError, match=r"transformer_blocks\[0, 1\] \(chunk\) did not run as one region"):
        check_strategy(HUNYUANVIDEO, CHUNKED, whole=True)


def test_regions_cover_every_list_and_seam() -> None:
    torch.manual_seed(0)
    for case, dual, single in (
        (HUNYUANVIDEO, "HunyuanVideoTransformerBlock", "HunyuanVideoSingleTransformerBlock"),
        (HUNYUANVIDEO_TOKEN_REPLACE, "HunyuanVideoTokenReplaceTransformerBlock",
         "HunyuanVideoTokenReplaceSingleTransformerBlock"),
    ):
        model = case.build()
        family = family_for(model)
        assert family.name == "hunyuanvideo"
        assert type(model.transformer_blocks[0]).__name__ == dual
        assert type(model.single_transformer_blocks[0]).__name__ == single
        ffn = plan(model, family, gradseam.CheckpointConfig.coerce(
            gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn"))
        assert [r.seam for r in ffn.regions if r.blocks == (0,)] == [
            ("norm2", "ff"), ("ff",), ("ff_context",), ("proj_mlp", "act_mlp")
        ]
        chunks = plan(model, family, gradseam.CheckpointConfig.coerce(CHUNKED))
        assert [(r.list_path.rsplit(".", 1)[-1], r.blocks) for r in chunks.regions] == [
            ("refiner_blocks", (0, 1)), ("transformer_blocks", (0, 1)), ("transformer_blocks", (2,)),
            ("single_transformer_blocks", (0, 1)), ("single_transformer_blocks", (2, 3)),
        ]


# -- the inputs reach the blocks ----------------------------------------------------------------


def _output(case: Case, **changes) -> torch.Tensor:
    torch.manual_seed(case.seed)
    model = case.build()
    inputs = {**case.inputs(torch.Generator().manual_seed(1)), **changes}
    with torch.no_grad():
        return model(**inputs)[0]


def test_padding_guidance_and_token_replace_change_the_output() -> None:
    # The cases' optional inputs must matter, or their conformance runs would test nothing extra.
    plain = _output(HUNYUANVIDEO)
    assert not torch.equal(plain, _output(HUNYUANVIDEO, encoder_attention_mask=torch.ones(1, 6, dtype=torch.int64)))
    assert not torch.equal(plain, _output(HUNYUANVIDEO, guidance=torch.tensor([1000.0])))
    # token replace: the first latent frame is modulated with the timestep-0 embedding
    torch.manual_seed(0)
    plain_model, replace_model = HUNYUANVIDEO.build(), HUNYUANVIDEO_TOKEN_REPLACE.build()
    replace_model.load_state_dict(plain_model.state_dict())
    inputs = hv_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = plain_model(**inputs)[0], replace_model(**inputs)[0]
    assert not torch.equal(a[:, :, :1], b[:, :, :1])


def test_the_i2v_image_channels_get_gradients_through_the_chunks() -> None:
    report = check_strategy(HUNYUANVIDEO_I2V, CHUNKED, whole=True)
    assert report.patched.input_grads["hidden_states"][:, 4:].abs().sum() > 0  # image latents and mask


# -- presets at full size -----------------------------------------------------------------------

PRESETS = {
    "13b-720p": "HunyuanVideoTransformerBlock",
    "13b-540p": "HunyuanVideoTransformerBlock",
    "i2v-720p": "HunyuanVideoTransformerBlock",
    "i2v-16ch-720p": "HunyuanVideoTokenReplaceTransformerBlock",
}


def _meta_model(preset):
    from diffusers import HunyuanVideoTransformer3DModel

    with torch.device("meta"):
        return HunyuanVideoTransformer3DModel(**preset.config)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_plan_at_full_size(name: str) -> None:
    family = gradseam.registry.REGISTRY.get("hunyuanvideo")
    assert set(family.presets) == set(PRESETS)
    model = _meta_model(family.presets[name])
    assert family_for(model) is family
    assert type(model.transformer_blocks[0]).__name__ == PRESETS[name]
    expected = {LISTS[0]: 2, LISTS[1]: 20, LISTS[2]: 40}
    for config, regions in (({"gradient_checkpointing": True}, 62), (CHUNKED, 1 + 10 + 20),
                            ({"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"},
                             2 + 2 * 20 + 40)):
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert blocks_per_list(the_plan.regions) == expected
        assert len(the_plan.regions) == regions


def test_preset_inputs_have_the_published_sizes() -> None:
    family = gradseam.registry.REGISTRY.get("hunyuanvideo")
    t2v = family.presets["13b-720p"]
    model = _meta_model(t2v)
    block = model.transformer_blocks[0]
    assert (block.attn.heads, block.ff.net[0].proj.out_features) == (24, 4 * 3072)
    x = t2v.make_inputs(model, torch.device("meta"), torch.bfloat16, **t2v.inputs)
    assert x["hidden_states"].shape == (1, 16, 33, 90, 160) and x["hidden_states"].requires_grad
    assert x["encoder_hidden_states"].shape == (1, 256, 4096) and x["pooled_projections"].shape == (1, 768)
    assert x["guidance"].shape == (1,)
    assert t2v.make_inputs(model, "meta", torch.bfloat16, 2 * 3600, **t2v.inputs)["hidden_states"].shape[2] == 2
    small = family.presets["13b-540p"]
    assert small.make_inputs(model, "meta", torch.bfloat16, **small.inputs)["hidden_states"].shape == (
        1, 16, 33, 68, 120
    )
    i2v = family.presets["i2v-720p"]
    i2v_model = _meta_model(i2v)
    x = i2v.make_inputs(i2v_model, "meta", torch.bfloat16, **i2v.inputs)
    assert x["hidden_states"].shape[1] == 33 and "guidance" not in x
    assert x["encoder_hidden_states"].shape[1] == 576 + 256


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_inputs_run_through_the_full_width_model_on_meta(name: str) -> None:
    # every real-size input reaches the output: the full-width model, one block per list, on the meta device
    from diffusers import HunyuanVideoTransformer3DModel

    preset = gradseam.registry.REGISTRY.get("hunyuanvideo").presets[name]
    with torch.device("meta"):
        model = HunyuanVideoTransformer3DModel(**preset.config, num_layers=1, num_single_layers=1, num_refiner_layers=1)
    out = model(**preset.make_inputs(model, "meta", torch.float32, **preset.inputs), return_dict=False)[0]
    assert out.shape == ((1, 16, 33, 90, 160) if "720p" in name else (1, 16, 33, 68, 120))


@pytest.mark.parametrize("case", [HUNYUANVIDEO, HUNYUANVIDEO_I2V, HUNYUANVIDEO_TOKEN_REPLACE], ids=lambda c: c.name)
def test_preset_input_builder_runs_the_model(case: Case) -> None:
    # the builder's inputs must be ones the model takes: the tiny model, at a tiny size
    family = gradseam.registry.REGISTRY.get("hunyuanvideo")
    torch.manual_seed(0)
    model = case.build()
    inputs = family.presets["13b-540p"].make_inputs(model, "cpu", torch.float32, frames=5, height=16, width=16,
                                                    text_tokens=5)
    out = model(**inputs, return_dict=False)[0]
    assert out.shape == (1, 4, 2, 2, 2)
    out.square().mean().backward()
    assert inputs["hidden_states"].grad is not None
