"""Ovis-Image (diffusers' ``OvisImageTransformer2DModel``, the 7B text-to-image MMDiT conditioned on the
Qwen3 language model of Ovis 2.5): a Flux layout whose MLPs are SwiGLUs.

Two block lists, in the order the model runs them:

- ``transformer_blocks`` (``OvisImageTransformerBlock``): image and text streams, each with its own
  adaLN-zero modulation (``norm1``, ``norm1_context``) and SwiGLU ``FeedForward`` (``ff``,
  ``ff_context``), meeting in one joint attention ``attn``; returns ``(encoder_hidden_states,
  hidden_states)``.
- ``single_transformer_blocks`` (``OvisImageSingleTransformerBlock``): concatenates ``[text, image]``
  inside the block, runs attention and a SwiGLU MLP beside it on the modulated norm, projects both with
  ``proj_out`` and splits the result again on return, so it also returns ``(encoder_hidden_states,
  hidden_states)`` (two views of one tensor).

The loop calls every block by keyword with ``hidden_states``, ``encoder_hidden_states``, ``temb``,
``image_rotary_emb`` and ``joint_attention_kwargs``. ``temb`` (the timestep embedding; there is no pooled
text vector and no guidance embedding) and the ``(cos, sin)`` RoPE of the text and image ids are computed
once before the loops, ``joint_attention_kwargs`` is the one dict the LoRA-scale decorator made for this
call, and nothing happens between blocks or between the lists. So both lists carry
``{"encoder_hidden_states": 0, "hidden_states": 1}`` and interval chunks run whole (the single blocks'
returned views are what the next block is handed, unchanged).

FFN seams, double blocks: ``ff`` and ``ff_context``, each called on exactly its stream's ``norm2`` output
scaled and shifted (a fresh tensor), its return value only gated and added to the residual; the norms
cannot join (their output is modulated before the MLP sees it). Inside, diffusers' ``SwiGLU`` projects to
2·4·d, splits, gates and projects back; every dropout has ``p = 0``.

**The single blocks have no FFN seam, so the family has none**: the block computes
``a, b = split(proj_mlp(x)); mlp = act_mlp(b) * a``. ``act_mlp`` is called on a view of ``proj_mlp``'s
output, not on the output itself, and the other half bypasses it, so ``proj_mlp -> act_mlp`` is not a
strict chain (Flux's single block, whose ``act_mlp`` takes ``proj_mlp``'s whole output, is). Either
module alone would be exact and save nothing: ``proj_mlp``'s input is the normed stream attention keeps
anyway, and ``act_mlp``'s input is a view that the product outside keeps alive, with the SiLU output.
A seam is declared per class and ``-ffn`` needs one in every class, so ``torch-ffn`` and ``unsloth-ffn``
are refused for the whole family, naming the single block; the double blocks' seams are declared all the
same, because they are exact.

Attention side: ``attn`` in both classes (QKV projections, QK RMSNorms, the text stream's added
projections in double blocks, RoPE, the dispatched SDPA call and the output projections, all inside
``OvisImageAttnProcessor``). A mask reaches it only through ``joint_attention_kwargs["attention_mask"]``
(the pipeline passes none: it pads every prompt to 256 tokens and zeroes the padding's states).
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import grid_ids, square_side, tensor_maker

_M = "diffusers.models.transformers.transformer_ovis_image"
_STREAMS = Carry({"encoder_hidden_states": 0, "hidden_states": 1})

# OvisImagePipeline pads (and truncates) every prompt to max_sequence_length, 256 at most and by default,
# after dropping the system prompt's 28 tokens: the transformer always sees 256 text tokens.
TEXT_TOKENS = 256


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, image_tokens: int = 4096,
    text_tokens: int = TEXT_TOKENS,
) -> dict:
    """One real-size batch as ``OvisImagePipeline`` feeds the transformer: the packed latents ``(1, N, 64)``
    (grad; a square grid of ``N`` 2x2 patches of the 16-channel 8x VAE latent, 4096 at 1024x1024), the Qwen3
    text encoder's last hidden states for ``text_tokens`` tokens (2048 wide), the timestep on the 0-1 scale (the
    model multiplies it by 1000), the image ids ``[0, row, col]`` and the text ids ``[0, i, i]`` (the pipeline
    places text on the diagonal, not at zero as Flux does). ``tokens`` overrides the image token count."""
    import torch

    cfg = model.config
    img_ids = grid_ids(square_side(tokens or image_tokens), device)
    position = torch.arange(text_tokens, device=device)
    txt_ids = torch.stack([torch.zeros_like(position), position, position], dim=-1)
    randn = tensor_maker(device, dtype)
    return {
        "hidden_states": randn(1, img_ids.shape[0], cfg.in_channels, grad=True),
        "encoder_hidden_states": randn(1, text_tokens, cfg.joint_attention_dim),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "img_ids": img_ids.to(dtype),
        "txt_ids": txt_ids.to(dtype),
    }


OVIS_IMAGE = Family(
    name="ovis-image",
    description="Ovis-Image 7B (OvisImageTransformer2DModel)",
    models=(f"{_M}.OvisImageTransformer2DModel",),
    block_lists=(
        BlockList("transformer_blocks", carry=_STREAMS),
        BlockList("single_transformer_blocks", carry=_STREAMS),
    ),
    block_classes=(
        BlockClass(f"{_M}.OvisImageTransformerBlock", ffn=(("ff",), ("ff_context",)), attention=("attn",)),
        # no FFN seam: act_mlp runs on half of proj_mlp's split output (see above)
        BlockClass(f"{_M}.OvisImageSingleTransformerBlock", attention=("attn",)),
    ),
    presets={
        "7b-1024": Preset(
            "Ovis-Image 7B (6 double + 27 single blocks, 24 x 128 heads, SwiGLU 12288; the released config, "
            "which the class defaults stand for) at 1024x1024: 4096 image tokens + 256 text tokens (the "
            "pipeline pads every prompt to 256)",
            config={},
            inputs={"image_tokens": 4096, "text_tokens": TEXT_TOKENS},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(OVIS_IMAGE)
