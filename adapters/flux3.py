"""Flux 3 (Flux3Transformer2DModel: FLUX.3 text-to-image and reference-image generation, and the
step-distilled flow-map checkpoints, ``flow_map=True``, which share the class).

Three token modes share one model: the noisy image tokens, the optional VAE-encoded reference image
tokens (``image_cond_hidden_states``) and the Qwen3-VL text context. Each mode first runs its own
per-mode blocks, self-attending within that mode only, then the joint single blocks run over
``[text, image, references]``. Four block lists, in the order the model runs them:

- **Text mode blocks** (``txt_mode_blocks``), **image mode blocks** (``mode_blocks.image``) and
  **reference mode blocks** (``mode_blocks.image_cond``, a ``ModuleDict`` entry reached by a dotted
  path), all ``Flux3ModeTransformerBlock``. Each loop is
  ``states = block(states, <mode>_early_mod, <mode>_rotary_emb)``: the per-token modulation
  (one projection of the mode's timestep embedding) and the RoPE table are computed once before the
  loop and are the same objects for every block, nothing is added between blocks, and a block
  returns the new states alone, so each list carries ``{"hidden_states": None}``. The reference list
  always exists but only runs when reference images are passed; with text-to-image inputs its
  regions simply never run.
- **Joint single blocks** (``single_transformer_blocks``, ``Flux3SingleTransformerBlock``): called
  as ``block(hidden_states=content, encoder_hidden_states=text, temb_mod=, temb_mod_context=,
  image_rotary_emb=)`` and returning ``(encoder_hidden_states, hidden_states)``. The content
  modulation, the text modulation and the joint RoPE tuple are built once before the loop (the
  concatenation with the reference tokens happens there too), so the carry is
  ``{"encoder_hidden_states": 0, "hidden_states": 1}``.

Flow-map checkpoints add the target timestep's embedding to every mode's embedding before any of
these modulations are computed: the blocks still receive one shared object each.

FFN seams. Both classes are *parallel* blocks: attention and MLP read the same modulated
``norm`` output and their sum is gated once (``x + gate * (attn(h) + ff(h))``). Unlike Flux 2's
single block, the MLP is not fused into the QKV projection: ``ff`` is a ``Flux3FeedForward`` module of
its own (``linear_in`` to ``2·3·d``, SwiGLU, ``linear_out``), called on exactly the modulated
value, with the sum, gate and residual outside it. So ``("ff",)`` is a strict one-module seam in both
classes; recomputing it drops the ``6·d``-wide ``linear_in`` output, the SiLU and the ``3·d``-wide
gated product for every token, while its input stays kept (attention keeps the same tensor
anyway). ``norm`` cannot join: its output is scaled and shifted before ``ff`` sees it.

Attention side: ``attn`` (projections, fp32 QK norms, RoPE and the kernel) in both classes.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import grid_ids, square_side, tensor_maker

_M = "diffusers.models.transformers.transformer_flux3"
_ONE = Carry({"hidden_states": None})

# The pipeline's RoPE scale on the image rows and columns, and the multiple it right-pads the text
# window to (Flux3PrepareLatentsStep / Flux3TextEncoderStep in diffusers' modular pipeline).
_IMAGE_ROPE_SCALE = 0.5
_TEXT_PAD_MULTIPLE = 80


def image_ids(side: int, device: Any, *, layer: int = 0) -> Any:
    """Flux 3's 4-axis ids ``(t, h, w, l)`` of a square ``side x side`` latent grid: ``t = 0``, the rows
    and columns scaled by the image RoPE scale, ``l = 0`` for the generated image and ``-(1 + i)`` for
    reference image ``i``."""
    ids = grid_ids(side, device, channels=4).float()
    ids[:, 1:3] *= _IMAGE_ROPE_SCALE
    ids[:, 3] = layer
    return ids


def text_ids(n_text: int, device: Any) -> Any:
    """``[0, 0, 0, i]`` for text token ``i``: the text advances along the ``l`` axis."""
    import torch

    ids = torch.zeros(n_text, 4, device=device)
    ids[:, 3] = torch.arange(n_text, device=device)
    return ids


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, image_tokens: int = 4096,
    text_tokens: int = 480, images: int = 0,
) -> dict:
    """One real-size batch as the modular pipeline builds it: packed latents (grad) on a square grid of
    about ``tokens`` image tokens, stacked Qwen3-VL states for ``text_tokens`` (the pipeline pads the
    window to a multiple of 80 and the transformer attends to the padding), 4-axis ids, and for
    ``images`` > 0 as many reference images of the same size; ``target_timestep`` for a flow map."""
    import torch

    cfg = model.config
    randn = tensor_maker(device, dtype)
    side = square_side(tokens or image_tokens)
    n = side * side
    inputs = {
        "hidden_states": randn(1, n, cfg.in_channels, grad=True),
        "encoder_hidden_states": randn(1, text_tokens, cfg.joint_attention_dim),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "img_ids": image_ids(side, device),
        "txt_ids": text_ids(text_tokens, device),
    }
    if images:
        inputs["image_cond_hidden_states"] = randn(1, images * n, cfg.cond_in_channels)
        inputs["image_cond_ids"] = torch.cat([image_ids(side, device, layer=-(1 + i)) for i in range(images)])
    if cfg.flow_map:
        inputs["target_timestep"] = torch.full((1,), 0.25, device=device, dtype=dtype)
    return inputs


FLUX3 = Family(
    name="flux3",
    description="FLUX.3 text-to-image / reference images / flow-map distilled (Flux3Transformer2DModel)",
    models=(f"{_M}.Flux3Transformer2DModel",),
    block_lists=(
        BlockList("txt_mode_blocks", carry=_ONE),
        BlockList("mode_blocks.image", carry=_ONE),
        BlockList("mode_blocks.image_cond", carry=_ONE),
        BlockList("single_transformer_blocks", carry=Carry({"encoder_hidden_states": 0, "hidden_states": 1})),
    ),
    block_classes=(
        BlockClass(f"{_M}.Flux3ModeTransformerBlock", ffn=(("ff",),), attention=("attn",)),
        BlockClass(f"{_M}.Flux3SingleTransformerBlock", ffn=(("ff",),), attention=("attn",)),
    ),
    presets={
        "1024": Preset(
            "FLUX.3 (5 text + 5 image + 5 reference mode blocks, 28 single blocks, 24 x 128 heads, SwiGLU 3x; "
            "diffusers' class defaults, assumed to be the released config) at 1024x1024: 4096 image tokens "
            f"and {6 * _TEXT_PAD_MULTIPLE} text tokens (assumed: a long prompt, six 80-token windows)",
            config={},  # the class defaults (see the description)
            inputs={"image_tokens": 4096, "text_tokens": 6 * _TEXT_PAD_MULTIPLE},
            make_inputs=make_inputs,
        ),
        "edit-1024": Preset(
            "FLUX.3 (as '1024') at 1024x1024 with one 1024x1024 reference image: 4096 image + 4096 reference "
            f"+ {6 * _TEXT_PAD_MULTIPLE} text tokens in the single blocks",
            config={},
            inputs={"image_tokens": 4096, "text_tokens": 6 * _TEXT_PAD_MULTIPLE, "images": 1},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(FLUX3)
