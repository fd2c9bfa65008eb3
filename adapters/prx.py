"""Photoroom's PRX text-to-image models: diffusers' ``PRXTransformer2DModel``, one class for the
latent-space PRX (1.17B parameters, "1.3B" in Photoroom's cards; Flux VAE or DC-AE latents, T5Gemma
text states) and the 7B pixel-space PRXPixel (raw RGB in 16x16 patches, a bottleneck ``img_in``,
Qwen3-VL text states, the generation resolution added to the timestep vector), which ai-toolkit
fine-tunes.

The model and the block are named by **bare class name** (``PRXTransformer2DModel``, ``PRXBlock``),
so they match from whatever module defines them. ai-toolkit's ``prx_pixel`` arch does not import
diffusers' class: it trains a vendored copy of it (``prx_pixel_t2i/src/transformer_prx.py``, written
while diffusers' PRXPixel support was an unmerged pull request), whose blocks, attention and forward
loop are the same code (only the text mask is expanded over heads and queries instead of broadcast). A full diffusers path
would refuse that copy; a bare name patches both, and everything below holds for both.

One block list, ``blocks``, every entry a ``PRXBlock``. The text stream is never updated: the model
projects the text states once (``txt_in``) and hands that same tensor to every block as the keys and
values its image queries attend to, beside the image tokens. Before the loop it also computes, once,
the timestep vector ``vec`` (plus the resolution embedding in PRXPixel) and the 2-D RoPE table ``pe``;
the caller's ``(batch, text_tokens)`` boolean mask is passed on untouched. The loop then calls every
block by keyword, ``block(hidden_states=img, encoder_hidden_states=txt, temb=vec,
image_rotary_emb=pe, attention_mask=attention_mask)`` (positionally through
``_gradient_checkpointing_func`` when diffusers' own flag is on, which gradseam suspends while
patched), and each block returns the new image tokens alone. Every argument but ``hidden_states`` is
therefore the same object for every block, and nothing happens between two blocks: the list carries
``Carry({"hidden_states": None})`` and chunks run whole. Each block computes its own modulation from
``temb`` inside itself (``modulation``), so nothing per block is made in the loop.

**No FFN seam** (the ``-ffn`` backends refuse the family): the block writes its gated MLP inline,
``down_proj(mlp_act(gate_proj(x)) * up_proj(x))``, with ``gate_proj``, ``up_proj`` and ``down_proj``
bare ``nn.Linear`` layers of the block and no module around them. ``down_proj`` is called on a
product the block computes itself, never on another submodule's return value, and ``up_proj`` is
called on ``x`` beside ``gate_proj``, not on its output, so no seam can span the MLP. The only strict
chain inside it is ``gate_proj → mlp_act``; checkpointed alone it would be exact, but its output feeds
the product, not the residual, so the GELU output, ``up_proj``'s output and the product (three of the
four ``3.5·d``-wide tensors the MLP saves) stay saved by the ops outside it (on a tiny model with the
real 3.5x ratio, a ``torch-ffn`` step with that seam kept 92% of the unpatched step's saved bytes,
against 10% with whole blocks). ``post_attention_layernorm`` cannot join either: its output is scaled
and shifted by the block before the projections see it. A seam that keeps most of what ``-ffn``
promises to drop would mislead, so none is declared; whole-block checkpointing and interval chunks
recompute the MLP with everything else.

Attention side: ``attention`` (``PRXAttention``): the image QKV and text KV projections, the QK RMS
norms, the RoPE on the image queries and keys, the joint ``[text, image]`` key/value concatenation,
the boolean text mask made broadcastable over heads and queries, the dispatched attention call and
``to_out``, all inside its processor. It is the block's only attention module; ``img_pre_norm``, the
modulation, the MLP and the residuals stay outside.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

# T5Gemma's tokenizer is saved with model_max_length = 256 by diffusers' conversion script, and
# PRXPixel's pipeline pads to 256 (PRX_PIXEL_DEFAULT_MAX_TOKENS); both pipelines pad to max_length.
TEXT_TOKENS = 256


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, height: int = 512, width: int = 512,
    downscale: int = 8, text_tokens: int = TEXT_TOKENS, prompt_tokens: int | None = None,
) -> dict:
    """One real-size batch as ``PRXPipeline`` / ``PRXPixelPipeline`` and ai-toolkit feed the transformer:
    the latent ``(1, in_channels, H / downscale, W / downscale)`` (grad; ``downscale`` is the
    autoencoder's: 8 for the Flux VAE, 32 for DC-AE, 1 in pixel space), the text encoder's last hidden
    states ``(1, text_tokens, context_in_dim)`` padded to ``text_tokens`` with their boolean mask
    (``prompt_tokens`` valid tokens, right-padded; all valid by default), and the flow time in
    ``[0, 1]`` in float32 (the pipelines divide the scheduler's timestep by 1000; the model scales it
    back by ``time_factor``).

    ``tokens`` overrides the image token count (rounded to a square grid of patches).
    """
    import torch

    cfg = model.config
    p = cfg.patch_size
    if tokens:
        h = w = square_side(tokens) * p
    else:
        h, w = height // downscale // p * p, width // downscale // p * p
    randn = tensor_maker(device, dtype)
    valid = text_tokens if prompt_tokens is None else prompt_tokens
    mask = torch.zeros(1, text_tokens, device=device, dtype=torch.bool)
    mask[:, :valid] = True
    return {
        "hidden_states": randn(1, cfg.in_channels, h, w, grad=True),
        "timestep": torch.full((1,), 0.5, device=device, dtype=torch.float32),
        "encoder_hidden_states": randn(1, text_tokens, cfg.context_in_dim),
        "attention_mask": mask,
    }


# The published PRX configs (Photoroom/prx-*-t2i, diffusers' scripts/convert_prx_to_diffusers.py):
# 16 blocks, 1792 wide (28 x 64 heads, RoPE 32 + 32), MLP 3.5x (6272), T5Gemma-2B states 2304 wide. The
# class defaults are the Flux-VAE variant; the DC-AE variant differs in its latent (32 channels, patch 1).
PRX_FLUX = {
    "in_channels": 16, "patch_size": 2, "context_in_dim": 2304, "hidden_size": 1792, "mlp_ratio": 3.5,
    "num_heads": 28, "depth": 16, "axes_dim": [32, 32], "theta": 10000, "time_factor": 1000.0,
    "time_max_period": 10000,
}
PRX_DC_AE = {**PRX_FLUX, "in_channels": 32, "patch_size": 1}
# Photoroom/prxpixel-t2i (the conversion script's ``pixel`` variant): 24 blocks, 3584 wide (28 x 128
# heads, RoPE 64 + 64), MLP 12544, RGB in 16x16 patches through a 768-wide bottleneck, Qwen3-VL-2B states
# 2048 wide, and the resolution embedder.
PRX_PIXEL = {
    **PRX_FLUX, "in_channels": 3, "patch_size": 16, "context_in_dim": 2048, "hidden_size": 3584, "depth": 24,
    "axes_dim": [64, 64], "bottleneck_size": 768, "resolution_embeds": True,
}
_TRUNK = "PRX 1.17B (16 blocks, 28 x 64 heads, MLP 6272, T5Gemma states 2304 wide)"


def _latent(name: str, side: int, downscale: int, patch: int, config: dict) -> Preset:
    grid = side // downscale // patch
    return Preset(
        f"{_TRUNK} with the {name} at {side}x{side} ({grid} x {grid} = {grid * grid} image + {TEXT_TOKENS} "
        "text tokens)",
        config=config,
        inputs={"height": side, "width": side, "downscale": downscale, "text_tokens": TEXT_TOKENS},
        make_inputs=make_inputs,
    )


PRX = Family(
    name="prx",
    description="Photoroom PRX and PRXPixel 7B text-to-image (PRXTransformer2DModel)",
    models=("PRXTransformer2DModel",),  # bare: diffusers' class and ai-toolkit's vendored copy (see above)
    block_lists=(BlockList("blocks", carry=Carry({"hidden_states": None})),),
    # no FFN seam: the gated MLP is inline tensor arithmetic between bare Linears (see above)
    block_classes=(BlockClass("PRXBlock", attention=("attention",)),),
    presets={
        # Photoroom/prx-512-t2i(-sft), the resolution most released checkpoints are trained at
        "prx-512": _latent("Flux VAE", 512, 8, 2, PRX_FLUX),
        # Photoroom/prx-1024-t2i-beta, the same trunk at 1024
        "prx-1024": _latent("Flux VAE", 1024, 8, 2, PRX_FLUX),
        # Photoroom/prx-512-t2i-dc-ae(-sft): 32x compression, patch 1
        "prx-dc-ae-512": _latent("DC-AE", 512, 32, 1, PRX_DC_AE),
        # ai-toolkit's prx_pixel arch trains this one, on 16-pixel-divisible buckets at its native 1024
        "prxpixel-1024": Preset(
            "PRXPixel 7B (24 blocks, 28 x 128 heads, MLP 12544, Qwen3-VL states 2048 wide, 768-wide patch "
            f"bottleneck, resolution embedding) on 1024x1024 RGB (64 x 64 = 4096 image + {TEXT_TOKENS} text tokens)",
            config=PRX_PIXEL,
            inputs={"height": 1024, "width": 1024, "downscale": 1, "text_tokens": TEXT_TOKENS},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(PRX)
