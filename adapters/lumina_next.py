"""Lumina-Next (diffusers' ``LuminaNextDiT2DModel``; Lumina-Next-SFT and Lumina-Next-T2I, the 2B Next-DiT).

One list, ``layers``, of ``LuminaNextDiTBlock`` s (24 in the released 2B). Before the loop the model
patchifies the SDXL-VAE latent, builds the token mask (``torch.ones`` of ``(B, N)``, int32), slices
the caller's complex RoPE table to the patch grid, and computes ``temb`` (timestep plus the
mask-pooled Gemma caption) once; it turns the caption mask into a bool tensor once. It then calls
every block as ``layer(hidden_states, mask, image_rotary_emb, encoder_hidden_states, encoder_mask,
temb=temb, cross_attention_kwargs=...)``: the four positional arguments after the first and both
keywords are the same objects for every block (the kwargs dict is the caller's own), and nothing
happens between blocks. Each block returns the new ``hidden_states`` alone, so the list carries
``{"hidden_states": None}`` and interval chunks run whole, padded caption batches and the
pipeline's proportional-attention kwargs included.

The block's attention is split oddly, and the split decides the attention side. Self-attention
``attn1`` has ``to_out`` replaced by ``nn.Identity``, and ``LuminaAttnProcessor2_0`` never calls
``to_out`` anyway: both ``attn1`` and ``attn2`` return the per-head SDPA output ``(B, N, H, d)``.
The block then gates the cross-attention heads by ``tanh(gate)``, adds the two, flattens, and calls
``attn2.to_out[0]`` itself on the mix, outside ``attn2``'s forward. Declaring ``attn1`` and ``attn2``
as the attention side is still exact: each module's forward holds its projections, the QK
LayerNorms, the complex RoPE and its one SDPA call, and the shared output projection is an ordinary
op of the block. Attention offload moves what the two forwards save (the projections, the RoPE'd
query and key, the kernel outputs) and leaves ``to_out[0]``'s saved input, the mix, in the block,
where whole-block checkpointing drops it like any other block activation. Nothing calls
``attn2.to_out`` inside a region of its own, so no region has to see it.

FFN seam ``("feed_forward", "ffn_norm2")``: the MLP branch is
``h + tanh(gate_mlp) * ffn_norm2(feed_forward(ffn_norm1(h) * (1 + scale_mlp)))``. ``feed_forward``
(``LuminaFeedForward``: ``linear_1`` and ``linear_3`` to ``4·2d/3`` rounded up to ``multiple_of``,
float32 SiLU, product, ``linear_2``) is called on that fresh modulated tensor alone, ``ffn_norm2`` on
exactly ``feed_forward``'s return value, which nothing else reads, and ``ffn_norm2``'s output only
goes to the gated residual: a strict chain, recomputed as one region exactly. It drops the SwiGLU's
wide tensors (both 6144-wide projections at full size, the float32 SiLU and the product) and
RMSNorm's copies of the MLP output; the seam keeps only its input. ``ffn_norm1`` cannot join: its
output is scaled by ``1 + scale_mlp`` before ``feed_forward`` sees it. The FFN is dense, so the
replay is plain.

The forward's ``cross_attention_kwargs`` defaults to ``None``, but the block spreads it with ``**``
into both attention calls, so ``None`` raises ``TypeError`` in the first block, patched or not; the
pipeline always passes a dict (``{}``, or ``{"base_sequence_length": ...}`` for its default
proportional attention), and so does the input builder. diffusers gives this class no
``_supports_gradient_checkpointing``: its own ``enable_gradient_checkpointing()`` raises, and gradseam
is the only checkpointing path.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

_M = "diffusers.models.transformers.lumina_nextdit2d"

# Alpha-VLLM/Lumina-Next-SFT-diffusers' transformer (the config diffusers' conversion script writes for
# the 2B Next-DiT): 24 layers, 32 heads of 72 with 8 KV heads, Gemma-2B captions (2048 wide), the 4-channel
# SDXL VAE latent with learned sigma; every constructor argument spelled out.
SFT_2B = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 4,
    "hidden_size": 2304,
    "num_layers": 24,
    "num_attention_heads": 32,
    "num_kv_heads": 8,
    "multiple_of": 256,
    "ffn_dim_multiplier": None,
    "norm_eps": 1e-5,
    "learn_sigma": True,
    "qk_norm": True,
    "cross_attention_dim": 2048,
    "scaling_factor": 1.0,
}

# LuminaText2ImgPipeline's RoPE table: 384 x 384 patch positions, of which the model slices the grid it sees.
ROPE_SIDE = 384


def rotary_table(head_dim: int, side: int = ROPE_SIDE, device: Any = None) -> Any:
    """The complex 2-D RoPE table ``(side, side, head_dim / 2)`` the pipeline hands the model (no
    resolution scaling: the training resolution, ``linear_factor = ntk_factor = 1``)."""
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

    table = get_2d_rotary_pos_embed_lumina(head_dim, side, side)
    return table if device is None else table.to(device)


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, height: int = 1024, width: int = 1024,
    text_tokens: int = 256, caption_tokens: int | None = None, proportional_attn: bool = True,
) -> dict:
    """One real-size batch as ``LuminaText2ImgPipeline`` feeds the model: the SDXL-VAE latent
    ``(1, 4, H/8, W/8)`` (grad), the flow timestep in ``[0, 1]``, Gemma-2B caption states padded to
    ``text_tokens`` (256 is the pipeline's ``max_sequence_length``, what the longest prompts reach) with
    ``caption_tokens`` of them valid (default all), the 384 x 384 RoPE table, and the pipeline's default
    proportional attention (``base_sequence_length`` = the token count of its default image size).

    ``tokens`` overrides the image token count (rounded to a square grid of patches).
    """
    import torch

    cfg = model.config
    if tokens:
        height = width = square_side(tokens) * cfg.patch_size * 8
    latent_h, latent_w = height // 8, width // 8
    side = max(ROPE_SIDE, latent_h // cfg.patch_size, latent_w // cfg.patch_size)
    valid = text_tokens if caption_tokens is None else caption_tokens
    mask = torch.zeros(1, text_tokens, device=device, dtype=torch.int64)
    mask[:, :valid] = 1
    randn = tensor_maker(device, dtype)
    kwargs: dict[str, Any] = {}
    if proportional_attn:
        kwargs["base_sequence_length"] = (cfg.sample_size * 8 // 16) ** 2
    return {
        "hidden_states": randn(1, cfg.in_channels, latent_h, latent_w, grad=True),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, text_tokens, cfg.cross_attention_dim),
        "encoder_mask": mask,
        "image_rotary_emb": rotary_table(cfg.hidden_size // cfg.num_attention_heads, side, device),
        "cross_attention_kwargs": kwargs,
    }


LUMINA_NEXT = Family(
    name="lumina-next",
    description="Lumina-Next-SFT / Lumina-Next-T2I (LuminaNextDiT2DModel)",
    models=(f"{_M}.LuminaNextDiT2DModel",),
    block_lists=(BlockList("layers", carry=Carry({"hidden_states": None})),),
    block_classes=(
        BlockClass(f"{_M}.LuminaNextDiTBlock", ffn=(("feed_forward", "ffn_norm2"),), attention=("attn1", "attn2")),
    ),
    presets={
        "sft-2b-1024": Preset(
            "Lumina-Next-SFT 2B (24 layers, dim 2304, 32 x 72 heads with 8 KV heads, SwiGLU 6144, Gemma-2B "
            "captions 2048 wide) at 1024x1024 (4096 image + 256 caption tokens, proportional attention)",
            config=SFT_2B,
            inputs={"height": 1024, "width": 1024, "text_tokens": 256},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(LUMINA_NEXT)
