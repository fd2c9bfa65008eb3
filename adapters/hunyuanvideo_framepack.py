"""FramePack on HunyuanVideo, image-to-video in sections (HunyuanVideoFramepackTransformer3DModel).

Not a subclass of ``HunyuanVideoTransformer3DModel``, so the ``hunyuanvideo`` family does not match
it; this family claims only the FramePack class. Its blocks are HunyuanVideo's own classes (the
FramePack module imports them), so it takes HunyuanVideo's declarations from ``adapters/hunyuanvideo.py``
(two families may declare the same block classes): the same three block lists with the same carries,
and the plain model's block classes with their seams and attention paths (FramePack never builds the
token-replace classes). What FramePack adds (the clean-history patch embedders
``clean_x_embedder``, the SigLIP ``image_projection``, the packing of 1x/2x/4x history tokens in front
of the section's latents and of their RoPE tables) all happens before the first block; the blocks
only see a longer video stream and a text stream with the image tokens in front.

Why HunyuanVideo's carries hold here too:

- **Token refiner** (``context_embedder.token_refiner.refiner_blocks``): ``hidden_states =
  block(hidden_states, temb, self_attn_mask)`` with ``temb`` and the mask built once before the
  loop, so ``Carry({"hidden_states": None})``.
- **Dual-stream** and **single-stream blocks** (``transformer_blocks``,
  ``single_transformer_blocks``): both loops call ``block(hidden_states, encoder_hidden_states,
  temb, attention_mask, image_rotary_emb)`` positionally and take back ``(hidden_states,
  encoder_hidden_states)``. ``temb``, the mask (None at batch 1, where the model instead trims the
  text stream to its valid tokens once before the loop) and the packed RoPE table are the same
  objects for every block, and nothing is added between blocks:
  ``Carry({"hidden_states": 0, "encoder_hidden_states": 1})`` for both.

Seams and attention as in HunyuanVideo: ``norm2 → ff`` in the refiner, ``ff`` and ``ff_context`` in
the dual-stream blocks, ``proj_mlp → act_mlp`` in the single blocks; ``attn`` in every block class.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker

# the same blocks and prompt as HunyuanVideo; FramePack's section and history inputs come on top
from .hunyuanvideo import BLOCK_CLASSES, BLOCK_LISTS, TEXT_TOKENS, TRUNK, prompt_inputs

_F = "diffusers.models.transformers.transformer_hunyuan_video_framepack"

# The released checkpoints' history: 1 prefix (start image) + 1 frame at 1x, 2 frames at 2x and 16 at 4x
# downsampling (HunyuanVideoFramepackPipeline's history_sizes), in front of a section of latent frames.
_HISTORY_2X, _HISTORY_4X = 2, 16


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, window: int = 9, height: int = 480,
    width: int = 832, text_tokens: int = TEXT_TOKENS, image_tokens: int = 729,
) -> dict:
    """One training batch of one FramePack section, as ``HunyuanVideoFramepackPipeline`` lays it out
    (the F1 "vanilla" order): ``window`` noisy latent frames ``(1, 16, window, H/8, W/8)`` (grad), the
    clean start frame plus one 1x history frame, 2 frames of 2x and 16 of 4x history with their frame
    indices, LLaVA-Llama prompt states and mask, the CLIP pooled vector, the start image's SigLIP
    states (729 tokens) and the distilled ``guidance`` (scale 10 x 1000, the FramePack demo's).

    ``tokens`` overrides the section's token count by changing ``window``; the history stays.
    """
    import torch

    cfg = model.config
    h, w = height // 8, width // 8
    if tokens:
        window = max(1, round(tokens / ((h // cfg.patch_size) * (w // cfg.patch_size))))
    randn = tensor_maker(device, dtype)
    # frame indices: [prefix | 4x history | 2x history | 1x history | section]
    indices = torch.arange(1 + _HISTORY_4X + _HISTORY_2X + 1 + window, device=device)
    prefix, history_4x, history_2x, history_1x, section = indices.split([1, _HISTORY_4X, _HISTORY_2X, 1, window])
    inputs = {
        "hidden_states": randn(1, cfg.in_channels, window, h, w, grad=True),
        **prompt_inputs(cfg, randn, device, dtype, text_tokens),
        "image_embeds": randn(1, image_tokens, cfg.image_proj_dim),
        "indices_latents": section,
        "latents_clean": randn(1, cfg.in_channels, 2, h, w),
        "indices_latents_clean": torch.cat([prefix, history_1x]),
        "latents_history_2x": randn(1, cfg.in_channels, _HISTORY_2X, h, w),
        "indices_latents_history_2x": history_2x,
        "latents_history_4x": randn(1, cfg.in_channels, _HISTORY_4X, h, w),
        "indices_latents_history_4x": history_4x,
    }
    if cfg.guidance_embeds:
        inputs["guidance"] = torch.full((1,), 10000.0, device=device, dtype=dtype)
    return inputs


# The released FramePackI2V_HY / FramePack_F1_I2V_HY transformer: HunyuanVideo's 13B trunk plus both
# FramePack embedders (the class defaults leave them off, and the forward cannot run without them).
_RELEASED = {"has_image_proj": True, "image_proj_dim": 1152, "has_clean_x_embedder": True}

HUNYUANVIDEO_FRAMEPACK = Family(
    name="hunyuanvideo-framepack",
    description="FramePack image-to-video on HunyuanVideo (HunyuanVideoFramepackTransformer3DModel)",
    models=(f"{_F}.HunyuanVideoFramepackTransformer3DModel",),
    block_lists=BLOCK_LISTS,
    block_classes=BLOCK_CLASSES,  # not the token-replace classes: FramePack builds only the plain blocks
    presets={
        "13b-480p": Preset(
            f"FramePack (FramePackI2V_HY / F1 config) {TRUNK}, one section of 9 latent frames (33 video "
            "frames) at 480x832 with the 1x/2x/4x history: 14040 section + 3120 clean + 390 + 416 history "
            "tokens; 729 SigLIP + 256 text tokens",
            config=_RELEASED,
            inputs={"window": 9, "height": 480, "width": 832},
            make_inputs=make_inputs,
        ),
        "13b-720p": Preset(
            "FramePack (as '13b-480p') at 720x1280, the pipeline's default size: 32400 section + 7200 clean "
            "+ 920 + 960 history tokens; 729 SigLIP + 256 text tokens",
            config=_RELEASED,
            inputs={"window": 9, "height": 720, "width": 1280},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(HUNYUANVIDEO_FRAMEPACK)
