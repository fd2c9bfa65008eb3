"""Kandinsky 5.0 Video Lite / Video Pro / Image Lite (Kandinsky5Transformer3DModel, the CrossDiT).

Two block lists, in the order the model runs them:

- ``text_transformer_blocks`` (``Kandinsky5TransformerEncoderBlock``, the "linguistic token
  refiner"): timestep-modulated self-attention blocks over the Qwen2.5-VL prompt tokens, called as
  ``block(text_embed, time_embed, text_rope)`` and returning the refined tokens. The block's first
  parameter is ``x``, so the list carries ``{"x": None}``.
- ``visual_transformer_blocks`` (``Kandinsky5TransformerDecoderBlock``): self-attention over the
  (optionally fractal-reordered) video tokens, cross-attention to the refined prompt, MLP; called as
  ``block(visual_embed, text_embed, time_embed, visual_rope, sparse_params)``, carrying
  ``{"visual_embed": None}``.

In both loops every argument but the carried one is computed once before the loop (the refined
``text_embed`` is the text list's final output, fixed before the visual loop starts) and handed to
every block as the same object; ``sparse_params`` is one dict (or ``None``) for all blocks, and its
NABLA mask is rebuilt inside each block's attention from that block's own queries and keys with
deterministic operations (pooling, softmax, sort, cumsum), so a recompute rebuilds the same mask.
Nothing is added between blocks, so interval chunks run whole in both lists.

FFN seams ``("feed_forward",)``: each block's last branch is
``x + gate * feed_forward(norm(x) * (scale + 1) + shift)``: ``feed_forward`` (``in_layer`` to
``ff_dim``, GELU, ``out_layer``) is called on exactly the modulated norm output, gate and residual
outside it. The norm cannot join: its output is scaled and shifted (in fp32) before the MLP sees it.
Recomputing the seam drops the ``ff_dim``-wide projection and its GELU for every token.

Attention side: ``self_attention`` in the text blocks; ``self_attention`` and ``cross_attention`` in
the visual blocks (projections, QK norms, RoPE and the attention call all live in those modules).
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker, video_latent_size

_M = "diffusers.models.transformers.transformer_kandinsky"


def make_inputs(
    model, device, dtype, tokens=None, *, frames=121, height=512, width=768, text_tokens=256,
    scale_factor=(1.0, 2.0, 2.0),
) -> dict:
    """One real-size batch as the Kandinsky 5 pipelines build it: a channels-last latent video
    ``(1, (frames-1)/4+1, H/8, W/8, C)`` (grad; with ``visual_cond`` the channels also hold the
    conditioning frames and their mask), Qwen2.5-VL prompt states of ``text_tokens`` tokens, the pooled
    CLIP vector, and the RoPE positions of both. ``frames=1`` is an image (the T2I pipeline). ``tokens``
    overrides the visual token count: by the number of latent frames for video, by the square side for
    an image."""
    import torch

    cfg = model.config
    pt, ph, pw = cfg.patch_size
    if frames == 1:
        side = square_side(tokens) if tokens else None
        t, h, w = 1, (side * ph if side else height // 8), (side * pw if side else width // 8)
    else:
        t, h, w = video_latent_size(frames, height, width, patch=(pt, ph, pw), tokens=tokens)
    channels = 2 * cfg.in_visual_dim + 1 if cfg.visual_cond else cfg.in_visual_dim
    randn = tensor_maker(device, dtype)

    def arange(n):
        return torch.arange(n, device=device)

    return {
        "hidden_states": randn(1, t, h, w, channels, grad=True),
        "encoder_hidden_states": randn(1, text_tokens, cfg.in_text_dim),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "pooled_projections": randn(1, cfg.in_text_dim2),
        "visual_rope_pos": [arange(t // pt), arange(h // ph), arange(w // pw)],
        "text_rope_pos": arange(text_tokens),
        "scale_factor": tuple(scale_factor),
    }


_LITE = {
    "in_visual_dim": 16, "out_visual_dim": 16, "time_dim": 512, "model_dim": 1792, "ff_dim": 7168,
    "num_text_blocks": 2, "num_visual_blocks": 32, "axes_dims": (16, 24, 24), "visual_cond": True,
}
_PRO = {
    "in_visual_dim": 16, "out_visual_dim": 16, "time_dim": 1024, "model_dim": 4096, "ff_dim": 16384,
    "num_text_blocks": 4, "num_visual_blocks": 60, "axes_dims": (32, 48, 48), "visual_cond": True,
}
_IMAGE_LITE = {
    "in_visual_dim": 16, "out_visual_dim": 16, "time_dim": 512, "model_dim": 2560, "ff_dim": 10240,
    "num_text_blocks": 2, "num_visual_blocks": 50, "axes_dims": (32, 48, 48),
}
_SD_VIDEO = {"frames": 121, "height": 512, "width": 768, "text_tokens": 256}

KANDINSKY5 = Family(
    name="kandinsky5",
    description="Kandinsky 5.0 Video Lite / Video Pro / Image Lite (Kandinsky5Transformer3DModel)",
    models=(f"{_M}.Kandinsky5Transformer3DModel",),
    block_lists=(
        BlockList("text_transformer_blocks", carry=Carry({"x": None})),
        BlockList("visual_transformer_blocks", carry=Carry({"visual_embed": None})),
    ),
    block_classes=(
        BlockClass(f"{_M}.Kandinsky5TransformerEncoderBlock", ffn=(("feed_forward",),), attention=("self_attention",)),
        BlockClass(
            f"{_M}.Kandinsky5TransformerDecoderBlock", ffn=(("feed_forward",),),
            attention=("self_attention", "cross_attention"),
        ),
    ),
    presets={
        "video-lite-5s": Preset(
            "Kandinsky 5.0 Video Lite 2B (2 text + 32 visual blocks, dim 1792, 28 x 64 heads, MLP 7168; the "
            "released 5s config, not the class defaults) at 512x768, 121 frames (31 x 32 x 48 = 47616 video "
            "tokens) with 256 Qwen2.5-VL tokens and full attention (the 5s checkpoints)",
            config=_LITE,
            inputs=_SD_VIDEO,
            make_inputs=make_inputs,
        ),
        "video-pro-5s": Preset(
            "Kandinsky 5.0 Video Pro 19B (4 text + 60 visual blocks, dim 4096, 32 x 128 heads, MLP 16384; the "
            "released config) at 512x768, 121 frames (47616 video tokens), 256 Qwen2.5-VL tokens, full "
            "attention (the SD checkpoints; the HD and 10s ones use NABLA sparse attention, not set up here)",
            config=_PRO,
            inputs=_SD_VIDEO,
            make_inputs=make_inputs,
        ),
        "image-lite-1024": Preset(
            "Kandinsky 5.0 Image Lite 6B (2 text + 50 visual blocks, dim 2560, 20 x 128 heads, MLP 10240; the "
            "released T2I config) at 1024x1024 (4096 image tokens) with 512 Qwen2.5-VL tokens",
            config=_IMAGE_LITE,
            inputs={"frames": 1, "height": 1024, "width": 1024, "text_tokens": 512, "scale_factor": (1.0, 1.0, 1.0)},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(KANDINSKY5)
