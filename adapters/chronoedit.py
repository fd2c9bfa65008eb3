"""ChronoEdit, image editing as a two-frame video (ChronoEditTransformer3DModel).

NVIDIA's ChronoEdit-14B is Wan 2.1 I2V 14B fine-tuned to edit: the input image is the first latent
frame and the edited image the last, conditioned like Wan's I2V (the image's VAE latents and a mask
as 20 extra input channels, its CLIP states through added K/V projections in the cross-attention).
The model class is a modified copy of ``WanTransformer3DModel``, not a subclass: the ``wan`` family
does not match it, and this family claims only the ChronoEdit class. Apart from the RoPE its
forward is Wan's: with exactly two latent frames (editing without temporal reasoning) their
temporal positions are 0 and ``rope_temporal_skip_len - 1`` instead of 0 and 1. With temporal
reasoning the pipeline first denoises in-between reasoning frames too (29 frames: 8 latent
frames), then drops them.

Its blocks are a copy of Wan's defined in the ChronoEdit module
(``transformer_chronoedit.WanTransformerBlock``, the same code under Wan's name, not Wan's class), so
they are declared by that module's name. One block list, ``blocks``, called positionally as
``block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)`` and returning the new
hidden states. Everything but ``hidden_states`` is built once before the loop and is the same
object for every block: the text states with the embedded CLIP image tokens concatenated in front,
the timestep projection and the RoPE tuple (the two-frame one included). Nothing is added between
blocks, so ``Carry({"hidden_states": None})`` and interval chunks run whole.

FFN seam: ``ffn`` (diffusers' ``FeedForward``), called on exactly the modulated ``norm3`` output,
its gate and residual outside it. ``norm3`` cannot join (its output is modulated first); everything
before it is attention. Attention side: ``attn1`` (self-attention with the RoPE) and ``attn2`` (text,
and the CLIP image tokens through ``add_k_proj`` / ``add_v_proj``: both attention calls of the
cross-attention run inside it).
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl

from .wan import make_inputs as wan_inputs  # the same latent video, timestep and umT5 states

_M = "diffusers.models.transformers.transformer_chronoedit"

# The cross-attention splits the image tokens off by assuming exactly 512 text tokens (the pipeline's
# max_sequence_length); the CLIP ViT-H/14 penultimate states of one 224x224 image are 257 tokens.
_TEXT_TOKENS = 512
_CLIP_TOKENS = 257


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, frames: int = 5, height: int = 720,
    width: int = 1280,
) -> dict:
    """One editing step as ``ChronoEditPipeline`` calls the transformer: ``frames`` video frames give
    ``(frames-1)/4+1`` latent frames (5 frames: 2, the input and the edited image; 29 with temporal
    reasoning: 8); the model input ``(1, in_channels, T, H/8, W/8)`` (grad) is the noisy latents
    stacked on channels with the input image's mask and latents; umT5 states (512 tokens) and the
    input image's CLIP states (257 tokens), when the model has image conditioning.

    ``tokens`` overrides the video token count by changing the number of latent frames (as temporal
    reasoning does).
    """
    import torch

    inputs = wan_inputs(model, device, dtype, tokens, frames=frames, height=height, width=width,
                        text_tokens=_TEXT_TOKENS)
    if model.config.image_dim is not None:
        inputs["encoder_hidden_states_image"] = torch.randn(
            1, _CLIP_TOKENS, model.config.image_dim, device=device, dtype=dtype
        )
    return inputs


# The released ChronoEdit-14B transformer is Wan 2.1 I2V 14B's (diffusers' conversion config): the
# class defaults (40 blocks, 40 x 128 heads, FFN 13824, umT5 4096) plus the I2V conditioning the class
# leaves off: 36 input channels (16 noise + 4 mask + 16 image latents), CLIP ViT-H states (1280 wide)
# and the cross-attention's added K/V projections for them.
_RELEASED = {"in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}

CHRONOEDIT = Family(
    name="chronoedit",
    description="ChronoEdit image editing on Wan 2.1 I2V (ChronoEditTransformer3DModel)",
    models=(f"{_M}.ChronoEditTransformer3DModel",),
    block_lists=(BlockList("blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(BlockClass(f"{_M}.WanTransformerBlock", ffn=(("ffn",),), attention=("attn1", "attn2")),),
    presets={
        "14b-720p": Preset(
            "ChronoEdit-14B (40 blocks, 40 x 128 heads, FFN 13824) editing at 720x1280, the pipeline's 5 "
            "frames (2 x 45 x 80 = 7200 video tokens; 512 text + 257 CLIP tokens)",
            config=_RELEASED,
            inputs={"frames": 5, "height": 720, "width": 1280},
            make_inputs=make_inputs,
        ),
        "14b-1024": Preset(
            "ChronoEdit-14B (as '14b-720p') at 1024x1024, 5 frames, the LoRA fine-tuning size (2 x 64 x 64 "
            "= 8192 video tokens; 512 text + 257 CLIP tokens)",
            config=_RELEASED,
            inputs={"frames": 5, "height": 1024, "width": 1024},
            make_inputs=make_inputs,
        ),
        "14b-720p-reasoning": Preset(
            "ChronoEdit-14B (as '14b-720p') during its temporal-reasoning steps at 720x1280, 29 frames "
            "(8 x 45 x 80 = 28800 video tokens; 512 text + 257 CLIP tokens)",
            config=_RELEASED,
            inputs={"frames": 29, "height": 720, "width": 1280},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(CHRONOEDIT)
