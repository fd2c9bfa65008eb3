"""Wan 2.1 VACE, all-in-one video creation and editing (WanVACETransformer3DModel).

Not a subclass of ``WanTransformer3DModel``: the ``wan`` family does not match it, and this family
claims only the VACE model class. It declares the same trunk block class as ``wan``, which two
families may do. Two block lists, in the order the model runs them:

- **Control blocks** (``vace_blocks``, ``WanVACETransformerBlock``), run first, over the control
  latents. The loop is ``hint, control = block(hidden_states, encoder_hidden_states, control,
  timestep_proj, rotary_emb)``: the patch-embedded video ``hidden_states``, the text states, the
  timestep projection and the RoPE table are the same objects for every control block, and only
  ``control_hidden_states`` (returned at position 1) feeds the next one. The hint (position 0,
  from ``proj_out``) is set aside for the trunk and feeds no later control block. So chunks are
  safe: ``Carry({"control_hidden_states": 1})``. The first control block alone has ``proj_in``
  (adding ``hidden_states`` to the projected control); no seam or attention path touches it.
- **Trunk** (``blocks``, ``WanTransformerBlock``, as in ``wan``): called positionally as
  ``block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)``, returning the new
  hidden states. **No carry**: after every block listed in ``config.vace_layers`` the loop adds
  that layer's scaled control hint to ``hidden_states`` before the next block sees it. A chunk
  spanning such a block would see its successor receive a different tensor than it returned and
  fall back (exact, but its later blocks computed twice in forward), and with the published
  layouts that is most chunks: every 5th block in 14B (from block 0, so an interval of 5 or more
  never runs a chunk whole), every 2nd in 1.3B (no interval-2 chunk ever runs whole). The trunk is
  therefore checkpointed block by block whatever the interval; the interval still groups the
  control blocks.

In both block classes ``ffn`` (diffusers' ``FeedForward``) is called on exactly the modulated
``norm3`` output, gate and residual outside it: the seam. ``norm3`` cannot join (its output is
modulated first) and everything before it is attention. The attention side is ``attn1`` and
``attn2`` in both. ``control_hidden_states_scale``, shorter control videos (padded by the model
before the loop) and image states only change what the loops are given, not how.
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl

from .wan import make_inputs as wan_inputs  # the same latent video and prompt, plus the control latents

_M = "diffusers.models.transformers.transformer_wan"
_V = "diffusers.models.transformers.transformer_wan_vace"


def make_inputs(model, device, dtype, tokens=None, *, frames=81, height=480, width=832, text_tokens=512) -> dict:
    """One real-size batch: the VAE latent video ``(1, 16, (frames-1)/4+1, H/8, W/8)`` (grad), control
    latents of the same length and size (``vace_in_channels``: the VACE pipeline's encoded control
    video and mask), and T5 states.

    ``tokens`` overrides the video token count by changing the number of latent frames.
    """
    import torch

    inputs = wan_inputs(model, device, dtype, tokens, frames=frames, height=height, width=width,
                        text_tokens=text_tokens)
    _, _, latent_frames, h, w = inputs["hidden_states"].shape
    inputs["control_hidden_states"] = torch.randn(
        1, model.config.vace_in_channels, latent_frames, h, w, device=device, dtype=dtype
    )
    return inputs


WAN_VACE = Family(
    name="wan-vace",
    description="Wan 2.1 VACE video creation and editing (WanVACETransformer3DModel)",
    models=(f"{_V}.WanVACETransformer3DModel",),
    block_lists=(
        BlockList("vace_blocks", carry=Carry({"control_hidden_states": 1})),
        BlockList("blocks"),  # no carry: the loop adds control hints between blocks (see above)
    ),
    block_classes=(
        BlockClass(f"{_V}.WanVACETransformerBlock", ffn=(("ffn",),), attention=("attn1", "attn2")),
        BlockClass(f"{_M}.WanTransformerBlock", ffn=(("ffn",),), attention=("attn1", "attn2")),
    ),
    presets={
        "14b-480p": Preset(
            "Wan 2.1 VACE 14B (40 blocks + 8 control blocks, 40 x 128 heads, FFN 13824) at 480x832, 81 frames",
            config={},  # the class defaults are the published 14B transformer
            inputs={"frames": 81, "height": 480, "width": 832},
            make_inputs=make_inputs,
        ),
        "1.3b-480p": Preset(
            "Wan 2.1 VACE 1.3B (30 blocks + 15 control blocks, 12 x 128 heads, FFN 8960) at 480x832, 81 frames",
            config={
                "num_layers": 30, "num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 8960,
                "vace_layers": list(range(0, 30, 2)),
            },
            inputs={"frames": 81, "height": 480, "width": 832},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(WAN_VACE)
