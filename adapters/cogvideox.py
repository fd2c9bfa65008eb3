"""CogVideoX 1.0 (2B, 5B, 5B-I2V) and 1.5 (5B, 5B-I2V): diffusers' ``CogVideoXTransformer3DModel``.

One block list, ``transformer_blocks``, all ``CogVideoXBlock``: an expert-adaLN block in which the
text and the video tokens are two streams of one sequence. ``norm1`` modulates each stream with its
own shift, scale and gate from ``temb``; ``attn1`` attends over the text and video tokens together
(the RoPE, when given, only touches the video queries and keys); ``norm2`` modulates again, and ``ff``
runs once over the concatenated streams. The block returns ``(hidden_states, encoder_hidden_states)``.

The model splits the patch-embedded sequence into the two streams once, then calls every block by
keyword with ``temb=emb`` (the timestep embedding, plus the ``ofs`` embedding of CogVideoX 1.5 I2V,
computed once before the loop), the caller's ``image_rotary_emb`` tuple (5B and 1.5; ``None`` for the
2B, whose sinusoidal or learned positional embedding is added in ``patch_embed``) and the caller's
``attention_kwargs``: the same objects for every block. Nothing is added between blocks, so a chunk
carries the two streams and nothing else: ``Carry({"hidden_states": 0, "encoder_hidden_states": 1})``.
(The model's own ``gradient_checkpointing`` flag calls blocks positionally; gradseam switches it off.)

FFN seam ``("ff",)``: the block calls ``ff`` exactly once, on one tensor,
``cat([norm_encoder_hidden_states, norm_hidden_states])`` (the two ``norm2``-modulated streams), and
only slices its return value (text part, video part), gates and adds it outside. So a region around
``ff`` sees exactly what the block sees; recomputing it drops the 4·d-wide tanh-GELU activations of
every token of both streams. ``norm2`` cannot join: it returns four tensors (two modulated streams and
two gates), and the concatenation sits between it and ``ff``. The dropouts inside ``ff`` are built with
the model's ``dropout`` (0.0 in every published checkpoint), which draws no random numbers.

Attention side: ``attn1``, the one attention module (``CogVideoXAttnProcessor2_0``: joint QKV
projections, the QK LayerNorms, the RoPE and the SDPA call all run inside it).
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker, video_latent_size

_M = "diffusers.models.transformers.cogvideox_transformer_3d"


def rotary_embedding(model, frames: int, grid_h: int, grid_w: int, device) -> tuple[Any, Any]:
    """The ``image_rotary_emb`` the CogVideoX pipelines build for ``frames`` latent frames on a
    ``grid_h x grid_w`` patch grid: ``(cos, sin)``, each ``(tokens, attention_head_dim)`` in float32.

    Made by diffusers' own functions, with the arguments its pipeline passes: CogVideoX 1.0 spreads the
    grid over the part of the training grid (``sample_height/width // patch_size``) it covers after a
    resize-and-center-crop; 1.5 (``patch_size_t`` set) slices integer positions, one per temporal patch."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

    cfg = model.config
    base_h, base_w = cfg.sample_height // cfg.patch_size, cfg.sample_width // cfg.patch_size
    if cfg.patch_size_t is None:
        crops = get_resize_crop_region_for_grid((grid_h, grid_w), base_w, base_h)
        return get_3d_rotary_pos_embed(cfg.attention_head_dim, crops, (grid_h, grid_w), frames, device=device)
    return get_3d_rotary_pos_embed(cfg.attention_head_dim, None, (grid_h, grid_w),
                                   (frames + cfg.patch_size_t - 1) // cfg.patch_size_t, grid_type="slice",
                                   max_size=(base_h, base_w), device=device)


def make_inputs(
    model, device, dtype, tokens=None, *, frames=49, height=480, width=720, text_tokens=None,
) -> dict:
    """One real-size batch as the CogVideoX pipelines (and diffusers' fine-tuning scripts) build it:
    the latent video ``(1, (frames-1)/4+1, C, H/8, W/8)`` (grad; frames first, and I2V's 32 channels
    are the noisy and the image latents together), T5-XXL states padded to ``max_text_seq_length``
    (226) tokens, an integer timestep, ``ofs = 2.0`` where the model embeds one (1.5 I2V), and the
    rotary table where the model uses RoPE (5B, 1.5). CogVideoX 1.5 pads the latent frames to a
    multiple of ``patch_size_t``, as its pipeline does. ``tokens`` overrides the video token count by
    changing the number of latent frames."""
    import torch

    cfg = model.config
    pt = cfg.patch_size_t or 1
    t, h, w = video_latent_size(frames, height, width, patch=(pt, cfg.patch_size, cfg.patch_size), tokens=tokens)
    t = -(-t // pt) * pt
    randn = tensor_maker(device, dtype)
    inputs = {
        "hidden_states": randn(1, t, cfg.in_channels, h, w, grad=True),
        "encoder_hidden_states": randn(1, text_tokens or cfg.max_text_seq_length, cfg.text_embed_dim),
        "timestep": torch.full((1,), 500, device=device, dtype=torch.int64),
    }
    if cfg.ofs_embed_dim:
        inputs["ofs"] = torch.full((1,), 2.0, device=device, dtype=dtype)
    if cfg.use_rotary_positional_embeddings:
        inputs["image_rotary_emb"] = rotary_embedding(model, t, h // cfg.patch_size, w // cfg.patch_size, device)
    return inputs


_5B = {"num_attention_heads": 48, "num_layers": 42, "use_rotary_positional_embeddings": True}
_V15 = {**_5B, "patch_size_t": 2, "patch_bias": False, "sample_frames": 81, "sample_height": 300,
        "sample_width": 300}
_480P = {"frames": 49, "height": 480, "width": 720}
_768P = {"frames": 81, "height": 768, "width": 1360}

COGVIDEOX = Family(
    name="cogvideox",
    description="CogVideoX 1.0 (2B, 5B, 5B-I2V) and 1.5 (5B, 5B-I2V) text/image-to-video (CogVideoXTransformer3DModel)",
    models=(f"{_M}.CogVideoXTransformer3DModel",),
    block_lists=(
        BlockList("transformer_blocks", carry=Carry({"hidden_states": 0, "encoder_hidden_states": 1})),
    ),
    block_classes=(BlockClass(f"{_M}.CogVideoXBlock", ffn=(("ff",),), attention=("attn1",)),),
    presets={
        "2b-480p": Preset(
            "CogVideoX-2B (30 blocks, 30 x 64 heads, FFN 7680, sinusoidal positions; the class defaults) at "
            "720x480, 49 frames (13 x 30 x 45 = 17550 video tokens, 226 text tokens)",
            config={},
            inputs=_480P,
            make_inputs=make_inputs,
        ),
        "5b-480p": Preset(
            "CogVideoX-5B (42 blocks, 48 x 64 heads, FFN 12288, 3-D RoPE; diffusers' conversion config) at "
            "720x480, 49 frames (17550 video tokens, 226 text tokens)",
            config=_5B,
            inputs=_480P,
            make_inputs=make_inputs,
        ),
        "1.5-5b-768p": Preset(
            "CogVideoX1.5-5B (42 blocks, 48 x 64 heads, 2x2x2 patches, 3-D RoPE; the published config) at "
            "1360x768, 81 frames (21 latent frames padded to 22: 11 x 48 x 85 = 44880 video tokens, 226 text "
            "tokens)",
            config=_V15,
            inputs=_768P,
            make_inputs=make_inputs,
        ),
        "1.5-5b-i2v-768p": Preset(
            "CogVideoX1.5-5B-I2V (as 1.5-5B, plus the image latents as 16 more input channels and the ofs "
            "embedding; the published config) at 1360x768, 81 frames (44880 video tokens, 226 text tokens)",
            config={**_V15, "in_channels": 32, "ofs_embed_dim": 512},
            inputs=_768P,
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(COGVIDEOX)
