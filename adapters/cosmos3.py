"""NVIDIA Cosmos 3 omnimodal world models (Cosmos3OmniTransformer: Cosmos3-Edge, -Nano and -Super and
their Text2Image / Image2Video / Policy checkpoints).

Not the ``cosmos`` family's architecture, and no class in common with it: Cosmos 1.0 / Predict 2 /
Predict 2.5 (``CosmosTransformer3DModel``) is a DiT whose ``CosmosTransformerBlock`` modulates a batched
video stream with adaLN-zero and cross-attends to T5 states. Cosmos 3 is a two-tower Mixture-of-Transformers
language model (a Qwen3-VL text trunk for Nano and Super, a Nemotron one with squared-ReLU MLPs for Edge)
over ONE packed sequence with no batch axis: the prompt's token ids ("understanding" tokens, a causal
prefix of ``und_len``), then the patchified vision latents of every item, then optionally sound and
action latents ("generation" tokens). The timestep embedding is added to the noisy generation tokens
once, before the loop; there is no modulation inside a block. So nothing of ``adapters/cosmos.py`` is
reused (its blocks, seams and input builder describe a different model), and the two families claim
different classes.

One block list, ``layers``, all ``Cosmos3VLTextMoTDecoderLayer``. Each pathway has its own weights in
every layer: the understanding tokens go through ``input_layernorm``, the ``to_q/k/v/out`` half of
``self_attn``, ``post_attention_layernorm`` and ``mlp``; the generation tokens through
``input_layernorm_moe_gen``, the ``add_*_proj`` / ``to_add_out`` half of ``self_attn``,
``post_attention_layernorm_moe_gen`` and ``mlp_moe_gen``. The model's loop calls every layer
positionally as ``layer(und_seq, gen_seq, rotary_emb)`` and gets ``(und_seq, gen_seq)`` back.
``rotary_emb`` is one tuple ``(cos_und, sin_und, cos_gen, sin_gen)`` built before the loop and handed to
every layer as the same object, and nothing happens between two layers (the final norms run after the
loop), so the list carries ``{"und_seq": 0, "gen_seq": 1}`` and interval chunks run whole. The
optional context-parallel hooks (``_cp_shard_fn`` / ``_cp_gather_fn``) act before and after the loop,
not between layers.

FFN seams: each pathway's MLP branch is ``residual + mlp(post_attention_layernorm(residual))``, where
``residual`` is the attention output already added to the stream (a fresh tensor) and no modulation or
gate touches either side: the norm is called on that tensor alone, the MLP on exactly the norm's
output, and the MLP's output only feeds the residual add. So ``post_attention_layernorm → mlp`` and
``post_attention_layernorm_moe_gen → mlp_moe_gen`` are strict chains, one seam per pathway, both in
every layer. ``Cosmos3VLTextMLP`` is a SwiGLU (``gate_proj``, ``up_proj`` to ``intermediate_size``,
SiLU, product, ``down_proj``) or, in the Nemotron trunk, ``down_proj(relu(up_proj(x))²)``; both norms
(diffusers' ``RMSNorm`` or the float32 ``Cosmos3NemotronRMSNorm``) are stateless. Recomputing a seam
drops the normalised copy and the MLP's ``intermediate_size``-wide tensors (three times the width in
Nano and Super, 4.5 times in Edge) for every token of its pathway; only the residual, which the add
keeps anyway, is kept. Nothing in a layer draws random numbers (``attention_dropout`` is never used).

Attention side: ``self_attn`` (``Cosmos3PackedMoTAttention``): both pathways' projections, the
per-head QK norms (and Edge's ``k_norm_und_for_gen``), the interleaved 3-D mRoPE, and both attention
calls (the causal one over the understanding tokens, and the generation tokens' full attention to the
understanding and generation keys, GQA in both) live in its processor.

Presets give the checkpoints' transformer configs as their differences from the class defaults (Nano's
published one; Edge's as public copies give it; Super's inferred from its Qwen3-VL-32B towers, see its
description) and one packed sequence laid out and positioned as ``Cosmos3OmniPipeline`` lays it out,
with Wan 2.2's VAE (48 channels, 16x spatial, 4x temporal) and 2x2 latent patches.
"""

from __future__ import annotations

import math
from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker, video_latent_size

_M = "diffusers.models.transformers.transformer_cosmos3"
_SPATIAL, _TEMPORAL = 16, 4  # Wan 2.2's VAE, which every Cosmos 3 checkpoint encodes video with


def _positions(frames: int, rows: int, cols: int, offset: float, *, step: float, reset: bool) -> Any:
    """mRoPE ids ``(3, frames * rows * cols)`` of a latent grid that starts at temporal ``offset``: time
    advances ``step`` per latent frame (the pipeline's fps modulation, ``base_fps / fps``; 1 for a single
    frame), rows and columns count from 0 (or from ``offset`` when spatial ids are not reset)."""
    import torch

    t = (torch.arange(frames, dtype=torch.float32) * step + offset).repeat_interleave(rows * cols)
    h = torch.arange(rows, dtype=torch.float32).repeat_interleave(cols).repeat(frames)
    w = torch.arange(cols, dtype=torch.float32).repeat(frames * rows)
    if not reset:
        h, w = h + int(offset), w + int(offset)
    return torch.stack([t, h, w])


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, frames: int = 189, height: int = 720,
    width: int = 1280, text_tokens: int = 512, fps: float = 24.0, image_condition: bool = False,
    sound: bool = False, action: int = 0, domain: int = 8, timestep: float = 500.0,
) -> dict[str, Any]:
    """One real-size training step as ``Cosmos3OmniPipeline`` packs it for the transformer: ``text_tokens``
    prompt token ids (the understanding prefix), then the video latent ``(1, 48, (frames-1)/4+1, H/16,
    W/16)`` (grad) as 2x2 patches (a latent side that is odd is padded, as the model pads it); with
    ``image_condition`` the first latent frame is the clean conditioning frame (image-to-video: its tokens
    get no timestep and no loss). ``sound`` adds the audio latent of the clip (``sound_latent_fps`` tokens
    a second, all noisy) when the model generates sound; ``action`` adds that many action tokens of
    embodiment ``domain`` when it generates actions. Position ids follow the pipeline's unified 3-D
    mRoPE (text from 0; every modality from the text's end plus the temporal margin, time scaled by
    ``base_fps / fps``). ``tokens`` overrides the vision token count by changing the latent frames."""
    import torch

    cfg = model.config
    p = cfg.latent_patch_size
    t, h, w = video_latent_size(frames, height, width, patch=(1, p, p), tokens=tokens, temporal=_TEMPORAL,
                                spatial=_SPATIAL)
    rows, cols = -(-h // p), -(-w // p)
    per_frame = rows * cols
    randn = tensor_maker(device, dtype)
    start = text_tokens + cfg.unified_3d_mrope_temporal_modality_margin

    def rate(n: int, per_second: float) -> float:
        """Latent time per token: the pipeline's fps modulation (``base_fps`` over the stream's rate)."""
        return cfg.base_fps / per_second if cfg.enable_fps_modulation and n > 1 else 1.0

    def place(n: int, offset: float, step: float, r: int = 1, c: int = 1) -> Any:
        return _positions(n, r, c, offset, step=step, reset=cfg.unified_3d_mrope_reset_spatial_ids)

    def arange(a: int, b: int) -> Any:
        return torch.arange(a, b, device=device)

    def stream(name: str, latent: Any, n: int, at: int) -> dict[str, Any]:
        """A 1-D generation stream (sound, action) of ``n`` tokens from ``at``, every token noisy."""
        return {
            f"{name}_tokens": [latent], f"{name}_token_shapes": [(n, 1, 1)],
            f"{name}_sequence_indexes": arange(at, at + n), f"{name}_mse_loss_indexes": arange(at, at + n),
            f"{name}_timesteps": torch.full((n,), timestep, device=device),
            f"{name}_noisy_frame_indexes": [arange(0, n)],
        }

    noisy = arange(1 if image_condition and t > 1 else 0, t)
    positions = [torch.arange(text_tokens, dtype=torch.float32).expand(3, -1),
                 place(t, start, rate(t, fps), rows, cols)]
    length = text_tokens + t * per_frame
    inputs: dict[str, Any] = {
        "input_ids": torch.randint(0, cfg.vocab_size, (text_tokens,), device=device),
        "text_indexes": arange(0, text_tokens),
        "und_len": text_tokens,
        "vision_tokens": [randn(1, cfg.latent_channel, t, h, w, grad=True)],
        "vision_token_shapes": [(t, rows, cols)],
        "vision_sequence_indexes": arange(text_tokens, length),
        "vision_mse_loss_indexes": (text_tokens + noisy[:, None] * per_frame + arange(0, per_frame)).flatten(),
        "vision_timesteps": torch.full((len(noisy) * per_frame,), timestep, device=device),
        "vision_noisy_frame_indexes": [noisy],
    }
    if sound and cfg.sound_gen:
        n = math.ceil(frames / fps * cfg.sound_latent_fps)
        positions.append(place(n, start, rate(n, cfg.sound_latent_fps)))
        inputs.update(stream("sound", randn(cfg.sound_dim, n, grad=True), n, length))
        length += n
    if action and cfg.action_gen:
        # one action per video frame transition: a video frame is 1/4 of a latent frame, and the first
        # action sits one step in (the pipeline's start_frame_offset)
        step = rate(action, fps * _TEMPORAL)
        positions.append(place(action, start + step, step))
        inputs.update(stream("action", randn(action, cfg.action_dim, grad=True), action, length))
        inputs["action_domain_ids"] = [torch.tensor([domain], device=device)]
        length += action
    inputs["position_ids"] = torch.cat(positions, dim=1).to(device)
    inputs["sequence_length"] = length
    return inputs


# Cosmos3-Nano's transformer/config.json (two Qwen3-VL-8B towers, 16B): the class defaults (36 layers,
# 4096 wide, 32 x 128 heads over 8 KV heads, SwiGLU 12288, rope_theta 5e6, mRoPE 24/20/20, vocab
# 151936, base_fps 24) plus its sound and action heads.
_NANO = {"sound_gen": True, "sound_dim": 64, "action_gen": True, "action_dim": 64}
# Cosmos3-Super (two Qwen3-VL-32B towers, 64B): the Qwen3-VL-32B text config (64 layers, 5120 wide, 64 x
# 128 heads over 8 KV heads, SwiGLU 25600) with the Super checkpoints' base_fps of 16 and no sound head.
_SUPER = {
    "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64,
    "num_key_value_heads": 8, "base_fps": 16,
}
# Cosmos3-Edge's transformer/config.json, as public copies of it give it (the "2B" model; 3.4B parameters
# with both towers and the 131072-token embedding): a Nemotron trunk (squared-ReLU MLP 9216, float32
# RMSNorms, no QK norm on the understanding pathway but a separate key norm for the generation
# pathway's view of it), 28 layers, 2048 wide, 16 x 128 heads over 8 KV heads, and an action head.
_EDGE = {
    "hidden_size": 2048, "intermediate_size": 9216, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "hidden_act": "relu2", "qk_norm_for_text": False, "use_und_k_norm_for_gen": True,
    "rms_norm_eps": 1e-5, "rope_theta": 1.0e8, "vocab_size": 131072, "action_gen": True, "action_dim": 64,
}
_T2V_720P = {"frames": 189, "height": 720, "width": 1280, "text_tokens": 512, "fps": 24.0}

COSMOS3 = Family(
    name="cosmos3",
    description="NVIDIA Cosmos 3 Edge / Nano / Super omnimodal world models (Cosmos3OmniTransformer)",
    models=(f"{_M}.Cosmos3OmniTransformer",),
    block_lists=(BlockList("layers", carry=Carry({"und_seq": 0, "gen_seq": 1})),),
    block_classes=(
        BlockClass(
            f"{_M}.Cosmos3VLTextMoTDecoderLayer",
            ffn=(("post_attention_layernorm", "mlp"), ("post_attention_layernorm_moe_gen", "mlp_moe_gen")),
            attention=("self_attn",),
        ),
    ),
    presets={
        "nano-720p": Preset(
            "Cosmos3-Nano (36 MoT layers of two Qwen3-VL-8B towers, 32 x 128 heads, 8 KV heads, SwiGLU 12288, "
            "15.2B parameters; its published config, sound and action heads included) generating video with "
            "sound as the pipeline does by default: 720x1280, 189 frames at 24 fps (48 x 23 x 40 = 44160 "
            "video tokens) + 197 sound tokens after 512 prompt tokens (assumed: a JSON-upsampled prompt; the "
            "pipeline pads nothing)",
            config=_NANO,
            inputs={**_T2V_720P, "sound": True},
            make_inputs=make_inputs,
        ),
        "super-i2v-720p": Preset(
            "Cosmos3-Super Image2Video (64 MoT layers of two Qwen3-VL-32B towers, 64 x 128 heads, 8 KV heads, "
            "SwiGLU 25600, 64.0B parameters; inferred from Qwen3-VL-32B's text config, base_fps 16, no sound head) at "
            "720x1280, 93 frames at 16 fps: 24 x 23 x 40 = 22080 video tokens, the first latent frame the "
            "conditioning image, after 512 prompt tokens (assumed)",
            config=_SUPER,
            inputs={"frames": 93, "height": 720, "width": 1280, "text_tokens": 512, "fps": 16.0,
                    "image_condition": True},
            make_inputs=make_inputs,
        ),
        "super-t2i-1024": Preset(
            "Cosmos3-Super Text2Image (as 'super-i2v-720p') at 1024x1024: one latent frame of 32 x 32 = 1024 "
            "image tokens after 512 prompt tokens (assumed)",
            config=_SUPER,
            inputs={"frames": 1, "height": 1024, "width": 1024, "text_tokens": 512, "fps": 16.0},
            make_inputs=make_inputs,
        ),
        "edge-720p": Preset(
            "Cosmos3-Edge (28 MoT layers of a Nemotron trunk, squared-ReLU MLP 9216, 16 x 128 heads, 8 KV "
            "heads; the '2B' model, 3.4B parameters with both towers; its config as public copies give it) at "
            "the pipeline's default 720x1280, 189 frames at 24 fps: 44160 video tokens after 512 prompt "
            "tokens (assumed)",
            config=_EDGE,
            inputs=_T2V_720P,
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(COSMOS3)
