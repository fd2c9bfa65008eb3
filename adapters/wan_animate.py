"""Wan 2.2 Animate, character animation and replacement (WanAnimateTransformer3DModel).

Not a subclass of ``WanTransformer3DModel``: the ``wan`` family does not match it, and this family
claims only the Animate class. Its trunk block is a copy of Wan's, defined in the Animate module
(``transformer_wan_animate.WanTransformerBlock``), so it is declared by that module's name.

One block list, **the trunk** (``blocks``): called positionally as ``block(hidden_states,
encoder_hidden_states, timestep_proj, rotary_emb)`` and returning the new hidden states. The text
(with the CLIP image tokens in front), the timestep projection and the RoPE table are the same
objects for every block, but **the trunk declares no carry**: after block 0 and every
``inject_face_latents_blocks``-th block after it (5 in the released model: blocks 0, 5, ..., 35) the
loop runs that block's output through a face adapter (``face_adapter[i]``, a cross-attention to
the face-motion features) and adds the result to ``hidden_states`` before the next block sees it.
A chunk in which a block other than the last feeds a face adapter would see that block's successor
receive a tensor other than the one it returned and fall back: exact, but computing the later
blocks twice in forward. With the released period of 5, an interval of 5 or
more never runs a chunk whole, and an interval of 2 loses every chunk starting at a multiple of 5;
whole chunks would have to end at the injected blocks (1-5, 6-10, ...), an offset the interval
cannot express. The trunk is therefore checkpointed block by block and
``gradient_checkpointing_interval`` is ignored, with a warning.

The face adapters themselves are no block list: each is a lone cross-attention module
(``WanAnimateFaceBlockCrossAttention``: pre-norms, projections, QK norms, attention, output
projection), with no feed-forward side and no residual of its own, run by the loop between two
trunk blocks. Declaring them would need a block class without an FFN seam, which would refuse the
``-ffn`` backends for the whole family, and without a submodule that holds their attention kernel
(it is called from the module's own forward), which would refuse attention offload too. They run
outside every region, unpatched, like the motion and face encoders before the trunk; a whole-block
backend therefore keeps their activations: about six tokens-by-width tensors per adapter (its
input, the normed query input, query, attention output...), so 8 adapters keep more than the 40
checkpointed block inputs do.

FFN seam: ``ffn`` (diffusers' ``FeedForward``), called on exactly the modulated ``norm3`` output,
gate and residual outside it. ``norm3`` cannot join (its output is modulated first); everything
before it is attention. Attention side: ``attn1`` and ``attn2`` (the latter also attends to the CLIP
image tokens through its added K/V projections).
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker, video_latent_size

_A = "diffusers.models.transformers.transformer_wan_animate"

# umT5 states: the cross-attention splits the image tokens off by assuming exactly 512 text tokens.
_TEXT_TOKENS = 512
_CLIP_TOKENS = 257


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, frames: int = 77, height: int = 720,
    width: int = 1280,
) -> dict:
    """One inference segment as ``WanAnimatePipeline`` builds it: ``frames`` video frames give ``T =
    (frames-1)/4+1`` latent frames; the model input ``(1, 36, T+1, H/8, W/8)`` (grad) is the noisy
    latents with the reference image's latent frame in front, stacked on channels with the reference
    and previous-segment conditioning latents and mask; the pose video latents ``(1, 16, T, H/8,
    W/8)``; the face crops in pixels ``(1, 3, frames, 512, 512)``; umT5 states (512 tokens) and the
    reference image's CLIP states (257 tokens).

    ``tokens`` overrides the video token count by changing ``T`` (and the face frames with it, which
    must give the face encoder one motion frame per latent frame).
    """
    import torch

    cfg = model.config
    latent_frames, h, w = video_latent_size(frames, height, width, patch=tuple(cfg.patch_size), tokens=tokens)
    if tokens:
        latent_frames = max(1, latent_frames - 1)  # the reference frame is part of the token count
    face_frames = 4 * (latent_frames - 1) + 1
    size = cfg.motion_encoder_size
    randn = tensor_maker(device, dtype)
    return {
        "hidden_states": randn(1, cfg.in_channels, latent_frames + 1, h, w, grad=True),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, _TEXT_TOKENS, cfg.text_dim),
        "encoder_hidden_states_image": randn(1, _CLIP_TOKENS, cfg.image_dim),
        "pose_hidden_states": randn(1, cfg.latent_channels, latent_frames, h, w),
        "face_pixel_values": randn(1, 3, face_frames, size, size),
    }


# The released Wan2.2-Animate-14B transformer (diffusers' conversion): the class defaults except for
# the CLIP image cross-attention's added K/V projections, which the class leaves off.
_RELEASED = {"added_kv_proj_dim": 5120}

WAN_ANIMATE = Family(
    name="wan-animate",
    description="Wan 2.2 Animate character animation / replacement (WanAnimateTransformer3DModel)",
    models=(f"{_A}.WanAnimateTransformer3DModel",),
    block_lists=(BlockList("blocks"),),  # no carry: face-adapter residuals between blocks (see above)
    block_classes=(BlockClass(f"{_A}.WanTransformerBlock", ffn=(("ffn",),), attention=("attn1", "attn2")),),
    presets={
        "14b-720p": Preset(
            "Wan 2.2 Animate 14B (40 blocks, 40 x 128 heads, FFN 13824; 8 face adapters) at 720x1280, one "
            "77-frame segment (21 x 45 x 80 = 75600 video tokens with the reference frame; 512 text + 257 "
            "CLIP tokens; 77 face crops of 512x512)",
            config=_RELEASED,
            inputs={"frames": 77, "height": 720, "width": 1280},
            make_inputs=make_inputs,
        ),
        "14b-480p": Preset(
            "Wan 2.2 Animate 14B (as '14b-720p') at 480x832, one 77-frame segment (21 x 30 x 52 = 32760 video "
            "tokens; 512 text + 257 CLIP tokens; 77 face crops of 512x512)",
            config=_RELEASED,
            inputs={"frames": 77, "height": 480, "width": 832},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(WAN_ANIMATE)
