"""Cosmos 3 (Cosmos3OmniTransformer): a tiny deterministic two-tower model through the conformance kit (one
packed sequence: a causal prompt prefix, then the generation tokens), input variants (two vision items, an
image-to-video conditioning frame and a latent side the model pads; the Nano heads' sound and action tokens;
Edge's Nemotron trunk with its squared-ReLU MLP and separate key norm), interval chunks that carry both
pathways, the loop handing every layer the same rotary tuple, one FFN seam per pathway, the latents'
gradients (list inputs the kit does not compare), diffusers' own checkpointing flag, and the presets at
full size with their real input builder."""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import replace
from functools import cache
from typing import Any

import pytest
import torch
from family_checks import assert_plans_cover_every_block, check_chunks_run_whole, record_block_calls

import gradseam
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import (
    Case,
    ConformanceSuite,
    check_builtin_flag,
    check_strategy,
    preset_model,
    randn,
)

CHUNKED = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}
SEAMS = [("post_attention_layernorm", "mlp"), ("post_attention_layernorm_moe_gen", "mlp_moe_gen")]

# 16 wide: 2 query heads over 1 KV head of 8 (GQA, as 32 over 8 in Nano), mRoPE 2 + 1 + 1 frequencies
# (time, rows, columns), SwiGLU 32; latents of 4 channels in 2x2 patches; four layers.
TEXT, CHANNELS = 5, 4
TINY: dict[str, Any] = dict(
    hidden_size=16, head_dim=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
    num_hidden_layers=4, vocab_size=32, latent_channel=CHANNELS, patch_latent_dim=CHANNELS * 4,
    rope_axes_dim=(2, 1, 1), rope_theta=10000.0,
)
TINY_OMNI = dict(TINY, sound_gen=True, sound_dim=3, action_gen=True, action_dim=5, num_embodiment_domains=3)
# Edge's trunk: Nemotron norms, relu2 MLP (no gate_proj), no QK norm on the prompt, a key norm for the
# generation pathway's view of the prompt keys
TINY_EDGE = dict(TINY, hidden_act="relu2", qk_norm_for_text=False, use_und_k_norm_for_gen=True, rms_norm_eps=1e-5)


def cosmos3_model(config: dict[str, Any]) -> torch.nn.Module:
    from diffusers import Cosmos3OmniTransformer

    return Cosmos3OmniTransformer(**config)


def pack(g: torch.Generator, items: list[tuple[int, int, int, bool]], *, sound: int = 0, action: int = 0,
         config: dict[str, Any] = TINY) -> dict[str, Any]:
    """The transformer's arguments for one packed sequence: TEXT prompt tokens, then one latent
    ``(1, C, frames, rows, cols)`` per item (``conditioned``: its first frame is clean, no timestep and no
    loss), then ``sound`` sound and ``action`` action tokens. mRoPE: text 0..TEXT-1, every modality from
    TEXT + 3 (a small temporal margin), rows and columns from 0."""
    latents, shapes, noisy, vision_at, loss_at, positions = [], [], [], [], [], [torch.arange(TEXT).expand(3, -1)]
    at, p = TEXT, 2
    for frames, height, width, conditioned in items:
        latents.append(randn(g, 1, CHANNELS, frames, height, width, grad=True))
        rows, cols = -(-height // p), -(-width // p)
        shapes.append((frames, rows, cols))
        keep = torch.arange(1 if conditioned else 0, frames)
        noisy.append(keep)
        vision_at.append(torch.arange(at, at + frames * rows * cols))
        loss_at.append((at + keep[:, None] * rows * cols + torch.arange(rows * cols)).flatten())
        grid = torch.stack(torch.meshgrid(torch.arange(frames) + TEXT + 3, torch.arange(rows), torch.arange(cols),
                                          indexing="ij")).flatten(1)
        positions.append(grid)
        at += frames * rows * cols
    inputs: dict[str, Any] = {
        "input_ids": torch.randint(0, config["vocab_size"], (TEXT,), generator=g),
        "text_indexes": torch.arange(TEXT),
        "und_len": TEXT,
        "vision_tokens": latents,
        "vision_token_shapes": shapes,
        "vision_sequence_indexes": torch.cat(vision_at),
        "vision_mse_loss_indexes": torch.cat(loss_at),
        "vision_timesteps": torch.rand(len(torch.cat(loss_at)), generator=g) * 1000,
        "vision_noisy_frame_indexes": noisy,
    }
    for name, n, dim in (("sound", sound, config.get("sound_dim")), ("action", action, config.get("action_dim"))):
        if n:
            tokens = randn(g, dim, n, grad=True) if name == "sound" else randn(g, n, dim, grad=True)
            inputs.update({
                f"{name}_tokens": [tokens], f"{name}_token_shapes": [(n, 1, 1)],
                f"{name}_sequence_indexes": torch.arange(at, at + n),
                f"{name}_mse_loss_indexes": torch.arange(at, at + n),
                f"{name}_timesteps": torch.rand(n, generator=g) * 1000,
                f"{name}_noisy_frame_indexes": [torch.arange(n)],
            })
            positions.append(torch.arange(n).expand(3, -1) + TEXT + 3)
            at += n
    if action:
        inputs["action_domain_ids"] = [torch.tensor([2])]
    inputs["position_ids"] = torch.cat(positions, dim=1)
    inputs["sequence_length"] = at
    return inputs


def plain_inputs(g: torch.Generator) -> dict[str, Any]:
    # text-to-video: 2 latent frames of 4x4 (2x2 patches): 8 generation tokens after 5 prompt tokens
    return pack(g, [(2, 4, 4, False)])


def items_inputs(g: torch.Generator) -> dict[str, Any]:
    # two vision items in one sequence: a 3-frame clip conditioned on its first frame, 4 x 3 latents (the
    # odd side padded to 2 x 2 patches), and a single-frame image
    return pack(g, [(3, 4, 3, True), (1, 4, 4, False)])


def omni_inputs(g: torch.Generator) -> dict[str, Any]:
    # Nano's heads: image-to-video with 4 sound and 3 action tokens after the video
    return pack(g, [(2, 4, 4, True)], sound=4, action=3, config=TINY_OMNI)


def outputs(out: Any) -> tuple[torch.Tensor, ...]:
    return (*out.sample, *(out.sound or ()), *(out.action or ()))


COSMOS3 = Case("cosmos3", lambda: cosmos3_model(TINY), plain_inputs, output=outputs)
COSMOS3_ITEMS = Case("cosmos3-i2v-two-items", lambda: cosmos3_model(TINY), items_inputs, output=outputs)
COSMOS3_OMNI = Case("cosmos3-sound-action", lambda: cosmos3_model(TINY_OMNI), omni_inputs, output=outputs)
COSMOS3_EDGE = Case("cosmos3-edge-nemotron", lambda: cosmos3_model(TINY_EDGE), plain_inputs, output=outputs)
CASES = [COSMOS3, COSMOS3_ITEMS, COSMOS3_OMNI, COSMOS3_EDGE]


class TestCosmos3(ConformanceSuite):
    case = COSMOS3


class TestCosmos3TwoItems(ConformanceSuite):
    case = COSMOS3_ITEMS
    reduced = True


class TestCosmos3SoundAction(ConformanceSuite):
    case = COSMOS3_OMNI
    reduced = True


class TestCosmos3EdgeNemotron(ConformanceSuite):
    case = COSMOS3_EDGE
    reduced = True


# -- the cuts -----------------------------------------------------------------------------------


def test_the_loop_hands_every_layer_the_same_rotary_tuple() -> None:
    # What the carry relies on: rotary_emb is one tuple object for every layer; und_seq and gen_seq are
    # exactly what the previous layer returned (positions 0 and 1).
    model = COSMOS3_OMNI.fresh()
    seen, returned = record_block_calls(model.layers)
    with torch.no_grad():
        model(**omni_inputs(torch.Generator().manual_seed(1)))
    assert len(seen) == 4 and set(seen[0]) == {"und_seq", "gen_seq", "rotary_emb"}
    assert all(kw["rotary_emb"] is seen[0]["rotary_emb"] for kw in seen)
    assert seen[0]["und_seq"].shape == (TEXT, 16) and seen[0]["gen_seq"].shape == (8 + 4 + 3, 16)
    for before, kw in zip(returned, seen[1:]):
        assert kw["und_seq"] is before[0] and kw["gen_seq"] is before[1]


@pytest.mark.parametrize("case", [COSMOS3_ITEMS, COSMOS3_OMNI], ids=lambda c: c.name)
def test_interval_chunks_carry_both_pathways(case: Case) -> None:
    # A wrong carry would still be exact (chunks fall back): both chunks must be served whole, and the
    # latents (list inputs, which the kit's input gradients leave out) must get the unpatched gradients.
    report = check_chunks_run_whole(case, CHUNKED, ["layers[0, 1]", "layers[2, 3]"])
    assert report.saved_ratio < 1
    assert_latent_grads_match(case, CHUNKED)


def test_one_ffn_seam_per_pathway_in_every_layer() -> None:
    model = COSMOS3_EDGE.fresh()
    family = family_for(model)
    assert family.name == "cosmos3" and family.has_ffn and family.has_attention and family.supports_interval
    layer = model.layers[0]
    assert layer.mlp.hidden_act == "relu2" and not hasattr(layer.mlp, "gate_proj")
    assert layer.self_attn.k_norm_und_for_gen is not None
    the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(FFN))
    assert [(r.blocks, r.seam) for r in the_plan.regions] == [((i,), s) for i in range(4) for s in SEAMS]
    report = check_strategy(COSMOS3_EDGE, FFN, whole=True)
    ffn = [r for r in report.regions if r.shape == "ffn"]
    assert len(ffn) == 8 and all(r.whole and r.runs == 1 for r in ffn), ffn
    assert report.saved_ratio < 1
    assert_latent_grads_match(COSMOS3_EDGE, FFN)


# -- the latents' gradients, and diffusers' own flag ----------------------------------------------


def _latents(inputs: dict[str, Any]) -> list[torch.Tensor]:
    return [t for k in ("vision_tokens", "sound_tokens", "action_tokens") for t in inputs.get(k) or ()]


def assert_latent_grads_match(case: Case, config: dict[str, Any]) -> None:
    plain, patched = case.twins()
    grads = []
    for model, patch in ((plain, None), (patched, config)):
        inputs = case.inputs(torch.Generator().manual_seed(1))
        with gradseam.patch(model, patch) if patch else nullcontext():
            sum(o.square().mean() for o in outputs(model(**inputs))).backward()
        grads.append([t.grad for t in _latents(inputs)])
    assert all(g is not None and g.abs().sum() > 0 for g in grads[0]), case.name
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True)), f"{case.name}: latent gradients differ"


def test_builtin_flag_set_before_patching_is_switched_off_and_exact() -> None:
    # the model's own checkpointing calls every layer positionally with (und_seq, gen_seq, rotary_emb)
    check_builtin_flag(COSMOS3_OMNI, CHUNKED)


def test_variant_inputs_reach_the_layers() -> None:
    # The variants exercise their paths: sound and action tokens share the video's attention, and the
    # conditioning frame is attended to but predicts nothing.
    model = COSMOS3_OMNI.fresh()
    inputs = omni_inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(**inputs)
        quiet = model(**{**inputs, "sound_tokens": [torch.zeros_like(inputs["sound_tokens"][0])]})
    assert not torch.equal(base.sample[0], quiet.sample[0]) and not torch.equal(base.action[0], quiet.action[0])
    assert torch.equal(base.sample[0][:, :, 0], torch.zeros_like(base.sample[0][:, :, 0]))


# -- the presets at full size ---------------------------------------------------------------------
# name: (layers, hidden, MLP width, billions of parameters, video tokens, sound tokens, action tokens)
PRESETS = {
    "nano-720p": (36, 4096, 12288, (15.0, 15.5), 48 * 23 * 40, 197, 0),
    "super-i2v-720p": (64, 5120, 25600, (63.5, 64.5), 24 * 23 * 40, 0, 0),
    "super-t2i-1024": (64, 5120, 25600, (63.5, 64.5), 32 * 32, 0, 0),
    "edge-720p": (28, 2048, 9216, (3.2, 3.5), 48 * 23 * 40, 0, 0),
}


@cache
def _preset_model(name: str) -> tuple[Any, Any, Any]:
    return preset_model("cosmos3", name)


@pytest.mark.parametrize("name", ["nano-720p", "super-i2v-720p", "edge-720p"])
def test_presets_plan_at_full_size(name: str) -> None:
    from diffusers import Cosmos3OmniTransformer

    family, preset, model = _preset_model(name)
    assert set(family.presets) == set(PRESETS)
    assert family_for(model) is family
    assert set(preset.config) <= set(inspect.signature(Cosmos3OmniTransformer.__init__).parameters)
    layers, hidden, mlp, (low, high), *_ = PRESETS[name]
    assert low < sum(p.numel() for p in model.parameters()) / 1e9 < high
    layer = model.layers[0]
    assert (len(model.layers), model.config.hidden_size, layer.mlp.up_proj.out_features) == (layers, hidden, mlp)
    assert layer.self_attn.num_key_value_heads == 8 and model.config.head_dim == 128
    assert_plans_cover_every_block(model, family, layers, (
        ({"gradient_checkpointing": True}, layers), (CHUNKED, layers // 2), (FFN, 2 * layers)
    ))


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_inputs_have_the_pipelines_sizes(name: str) -> None:
    preset = gradseam.registry.REGISTRY.get("cosmos3").presets[name]
    same = "super-i2v-720p" if name == "super-t2i-1024" else name  # one config: build the 64B model once
    _, other, model = _preset_model(same)
    assert preset.config == other.config
    *_, video, sound, action = PRESETS[name]
    x = preset.make_inputs(model, "meta", torch.bfloat16, None, **preset.inputs)
    (latent,) = x["vision_tokens"]
    assert latent.requires_grad and latent.dtype == torch.bfloat16 and latent.shape[:2] == (1, 48)
    assert x["und_len"] == 512 and x["input_ids"].shape == x["text_indexes"].shape == (512,)
    assert x["vision_sequence_indexes"].shape == (video,)
    conditioned = preset.inputs.get("image_condition", False)
    noisy = video - (23 * 40 if conditioned else 0)
    assert x["vision_mse_loss_indexes"].shape == x["vision_timesteps"].shape == (noisy,)
    assert x["sequence_length"] == 512 + video + sound + action and x["position_ids"].shape == (3, x["sequence_length"])
    assert ("sound_tokens" in x) == bool(sound)
    if sound:
        assert x["sound_tokens"][0].shape == (64, sound) and x["sound_tokens"][0].requires_grad
    fewer = preset.make_inputs(model, "meta", torch.bfloat16, 4 * 23 * 40, **preset.inputs)
    assert fewer["vision_tokens"][0].shape[2] == 4  # latent frames: the token count sets how many


def test_preset_input_builder_runs_the_model() -> None:
    # The builder's inputs are ones the model takes and lay out its sequence as pack() does: the tiny omni
    # model at a tiny size (latent 2 frames x 4 x 3: the odd side padded), conditioned, with sound and action.
    preset = gradseam.registry.REGISTRY.get("cosmos3").presets["nano-720p"]
    model = COSMOS3_OMNI.fresh()
    x = preset.make_inputs(model, "cpu", torch.float32, frames=5, height=64, width=48, text_tokens=TEXT,
                           image_condition=True, sound=True, action=3, domain=1)
    assert x["vision_token_shapes"] == [(2, 2, 2)] and x["vision_noisy_frame_indexes"][0].tolist() == [1]
    assert x["vision_mse_loss_indexes"].tolist() == list(range(TEXT + 4, TEXT + 8))
    assert x["sound_token_shapes"] == [(6, 1, 1)] and x["sequence_length"] == TEXT + 8 + 6 + 3
    positions = x["position_ids"]
    assert positions[:, :TEXT].tolist() == [list(range(TEXT))] * 3
    assert positions[0, TEXT].item() == TEXT + model.config.unified_3d_mrope_temporal_modality_margin
    out = model(**x)
    assert out.sample[0].shape == (1, CHANNELS, 2, 4, 3) and out.sound[0].shape == (3, 6) and out.action[0].shape == (3, 5)
    sum(o.square().mean() for o in outputs(out)).backward()
    assert all(t.grad is not None for t in _latents(x))


def test_preset_positions_are_the_pipelines() -> None:
    # The builder's mRoPE ids are the pipeline's own (its helpers, fed as Cosmos3OmniPipeline feeds them):
    # text, then video, sound and action from the same temporal offset, time scaled by base_fps / fps.
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import (
        get_3d_mrope_ids_text_tokens,
        get_3d_mrope_ids_vae_tokens,
    )

    preset = gradseam.registry.REGISTRY.get("cosmos3").presets["nano-720p"]
    model = COSMOS3_OMNI.fresh()
    cfg = model.config
    for fps, frames in ((24.0, 9), (16.0, 9), (24.0, 1)):
        x = preset.make_inputs(model, "cpu", torch.float32, frames=frames, height=64, width=48, text_tokens=TEXT,
                               fps=fps, sound=True, action=3)
        text, offset = get_3d_mrope_ids_text_tokens(TEXT, 0, use_float_positions=True)
        start = offset + cfg.unified_3d_mrope_temporal_modality_margin
        common = {"temporal_offset": start, "base_fps": float(cfg.base_fps)}
        (t, rows, cols), ((n, _, _),) = x["vision_token_shapes"][0], x["sound_token_shapes"]
        video, _ = get_3d_mrope_ids_vae_tokens(t, rows, cols, fps=fps, temporal_compression_factor=4, **common)
        sound, _ = get_3d_mrope_ids_vae_tokens(n, 1, 1, fps=cfg.sound_latent_fps, temporal_compression_factor=1,
                                               **common)
        action, _ = get_3d_mrope_ids_vae_tokens(3, 1, 1, fps=fps, temporal_compression_factor=1,
                                                base_temporal_compression_factor=4, start_frame_offset=1, **common)
        expected = torch.cat([ids.float() for ids in (text, video, sound, action)], dim=1)
        assert torch.equal(x["position_ids"], expected), (fps, frames)


@pytest.mark.parametrize(("config", "preset", "sizes"), [
    (TINY_OMNI, "nano-720p", {"frames": 5, "height": 64, "width": 64, "text_tokens": TEXT, "sound": True}),
    (TINY_EDGE, "edge-720p", {"frames": 5, "height": 64, "width": 64, "text_tokens": TEXT}),
], ids=["nano", "edge"])
def test_bench_workload_truncates_and_patches_exactly(config: dict, preset: str, sizes: dict) -> None:
    """What `gradseam bench --family cosmos3 --layers 2` does, with the preset's real input builder. The kit's
    check_bench_workload demands an input named hidden_states; this model's latents are lists
    (vision_tokens, sound_tokens), so the same steps are spelled out here."""
    from gradseam.family import Preset
    from gradseam.tools.checks import find_family
    from gradseam.tools.measure import forward_backward, grad_leaves
    from gradseam.tools.workloads import build

    family = find_family("cosmos3")
    tiny = replace(family, presets={"tiny": Preset("tiny", config, sizes, family.presets[preset].make_inputs)})
    torch.manual_seed(0)
    workload = build(tiny, "tiny", layers=2, device="cpu", dtype=torch.float32)
    assert workload.truncated == {"layers": (2, 4)}
    x = workload.inputs()
    leaves = grad_leaves(x)
    assert len(leaves) == (2 if sizes.get("sound") else 1)
    forward_backward(workload.model, x)()
    reference = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    with gradseam.patch(workload.model, CHUNKED) as handle:
        assert handle.family.name == "cosmos3"
        forward_backward(workload.model, x)()
    assert all(torch.equal(t.grad, r) for t, r in zip(leaves, reference, strict=True))
    assert workload.inputs(tokens=64) is not None
    torch.manual_seed(0)
    half = build(tiny, "tiny", layers=2, device="cpu", dtype=torch.bfloat16)
    with torch.no_grad():
        half.model(**half.inputs())
