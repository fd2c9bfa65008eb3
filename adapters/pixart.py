"""PixArt-α and PixArt-Σ text-to-image (diffusers' ``PixArtTransformer2DModel``: PixArt-alpha/PixArt-XL-2-512x512
and -1024-MS, PixArt-Sigma-XL-2-512-MS, -1024-MS and -2K-MS; their configs name the legacy ``Transformer2DModel``,
which diffusers loads as this class for ``norm_type="ada_norm_single"``). Subclasses match; SimpleTuner trains
PixArt-Σ through its own copy of the class (not a subclass, with its own loop), which this family does not claim.

One list, ``transformer_blocks``, of diffusers' generic ``BasicTransformerBlock``, built with
``norm_type="ada_norm_single"``: ``norm1`` (a LayerNorm without affine), self-attention ``attn1``,
cross-attention ``attn2`` to the projected T5 prompt (on the unnormalised stream: for this norm type the block
skips ``norm2`` there), ``norm2`` (a LayerNorm, in front of the feed-forward), ``ff``, and ``scale_shift_table``,
the block's own six modulation rows that it adds to the shared timestep embedding. It is the class the ``dit``
and ``latte`` families declare (DiT builds it adaLN-Zero without cross-attention, Latte like PixArt): one
declaration, ``BASIC_BLOCK``, imported from ``dit``.

Carry. Before the loop the model turns 2-D masks into additive biases ``(B, 1, L)`` once, projects the caption
once (``caption_projection``) and embeds the timestep once (``adaln_single``: a ``(B, 6·D)`` tensor, plus the
size and aspect-ratio conditions of the α-1024 checkpoint); then it calls every block by keyword with those same
objects, the caller's ``cross_attention_kwargs`` (the block copies the dict and never writes to it) and
``class_labels=None``, and nothing happens between blocks. Each block returns the new hidden states alone. So a
chunk carries ``hidden_states`` and nothing else: ``Carry({"hidden_states": None})``. diffusers' own
checkpointing path passes the same values positionally, in the order of the block's parameters. After the loop
the model uses only its own ``scale_shift_table``, ``norm_out`` and ``proj_out``: unlike DiT, it never calls
into a block's submodule outside that block, so weight streaming may stream any block.

No random numbers in released configs (``dropout=0.0``). With ``dropout > 0`` the attention output projections
and ``ff`` draw dropout masks inside the blocks; recomputes and chunks restore the generators (tested).

FFN seam: ``ff`` (a tanh-GELU ``FeedForward``, 1152 -> 4608 -> 1152 in XL/2). The block calls it on
``norm2(hidden_states) * (1 + scale_mlp) + shift_mlp``, a tensor made for it alone, and its return value only
goes into ``gate_mlp * ff_output + hidden_states``: checkpointing ``ff`` alone is exact and drops its 4·d-wide
pre-activation and GELU output. ``norm2`` cannot join (its output is scaled and shifted first). With
``block.set_chunk_feed_forward(size, dim)`` ``ff`` runs once per slice, each call a region of its own.

Attention side: ``attn1`` and ``attn2``, each with one SDPA call inside ``AttnProcessor2_0``. Every published
config sets ``cross_attention_dim=1152``, so every block has ``attn2``; the shared declaration keeps it optional
(a config with ``cross_attention_dim=None`` builds none). The prompt mask reaches ``attn2`` as the bias made
before the loop, repeated per head inside the processor; ``attention_mask`` goes to ``attn1`` (over the image
tokens, though the model's docstring says it applies to the prompt), and no pipeline passes one.
``attention_type="gated"`` (GLIGEN) would add a ``fuser`` with an attention of its own, outside the attention
side; no PixArt checkpoint has it, and kept attention would recompute that kernel (exact). At the real sizes the
prompt is short beside the image (300 or 120 keys for 4096 queries at 1024): gradseam keeps only kernels with at
least a quarter as many keys as queries, so kept attention keeps ``attn1``'s kernel and recomputes ``attn2``'s,
which is cheap (at 512 it keeps Σ's cross-attention, 300 keys for 1024 queries, and recomputes α's, 120).

Presets: the PixArt XL/2 trunk (28 blocks, 16 x 72 heads, 1152 wide, T5-XXL states 4096 wide, 4 latent channels
in, 8 out: noise and learned variance) as diffusers' conversion scripts build it
(``scripts/convert_pixart_alpha_to_diffusers.py`` and ``convert_pixart_sigma_to_diffusers.py``, read in the
diffusers repository at 58eb52c080: the installed wheel ships no scripts): ``sample_size`` is the image size / 8,
``interpolation_scale`` the positional-embedding scale of the original inference scripts (1 at 512, 2 at 1024,
4 at 2048; the α converter leaves it to the class, which derives the same ``sample_size // 64``). The α-1024
checkpoint is the one with the micro-conditions (the α converter loads the size and aspect-ratio embedders at
1024 only; the class switches them on for ``sample_size == 128`` unless told otherwise, and the α pipeline
passes them exactly then); PixArt-Σ has none (the Σ converter's ``--micro_condition`` is off for the released
checkpoints: ``PixArtSigmaPipeline`` always passes ``None`` for both, which a model with them fails on, and the
PixArt-sigma repo's configs keep ``micro_condition = False``; so ``use_additional_conditions=False``, spelled out
since the class would switch them on at 1024). Prompts: 120 T5 tokens for α, 300
for Σ (the pipelines' ``max_sequence_length``, the repos' ``model_max_length``), padded to that length, with the
mask. Batch 1 by default (a fine-tune on one GPU; the reference configs' per-GPU batches: α 40 at 512 and 12 at
1024 with checkpointing, Σ 2 at 512 and 1024, 4 at 2K).
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

from .dit import BASIC_BLOCK  # the same BasicTransformerBlock declaration: ff; attn1, attn2 (optional)

_M = "diffusers.models.transformers.pixart_transformer_2d"

# T5-XXL prompt lengths: PixArtAlphaPipeline and PixArtSigmaPipeline pad every prompt to these.
ALPHA_TEXT_TOKENS = 120
SIGMA_TEXT_TOKENS = 300


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, height: int = 1024, width: int = 1024,
    text_tokens: int = SIGMA_TEXT_TOKENS, prompt_tokens: int | None = None, batch: int = 1,
) -> dict:
    """One real-size training batch as the PixArt pipelines feed the transformer: ``batch`` VAE latents
    ``(batch, 4, H/8, W/8)`` (grad), the T5 prompt states ``(batch, text_tokens, caption_channels)`` with their
    keep-mask (``prompt_tokens`` valid, right-padded; all by default), one int64 timestep per image and, for a
    model with micro-conditions (α at 1024), each image's ``[height, width]`` and ``height / width``.

    ``tokens`` overrides the image token count (a square grid of 2x2 patches)."""
    import torch

    cfg = model.config
    if tokens:
        height = width = square_side(tokens) * cfg.patch_size * 8
    randn = tensor_maker(device, dtype)
    valid = text_tokens if prompt_tokens is None else prompt_tokens
    mask = torch.zeros(batch, text_tokens, device=device, dtype=torch.long)
    mask[:, :valid] = 1
    sizes: dict = {"resolution": None, "aspect_ratio": None}
    if model.use_additional_conditions:
        sizes = {
            "resolution": torch.tensor([[float(height), float(width)]] * batch, device=device, dtype=dtype),
            "aspect_ratio": torch.full((batch, 1), height / width, device=device, dtype=dtype),
        }
    return {
        "hidden_states": randn(batch, cfg.in_channels, height // 8, width // 8, grad=True),
        "encoder_hidden_states": randn(batch, text_tokens, cfg.caption_channels),
        "encoder_attention_mask": mask,
        "timestep": (torch.arange(batch, device=device, dtype=torch.long) * 997 + 500) % 1000,
        "added_cond_kwargs": sizes,
    }


# PixArt XL/2 as diffusers' conversion scripts build it, every constructor argument spelled out; the image size
# sets sample_size, interpolation_scale and (α only) the micro-conditions.
XL_2 = {
    "num_attention_heads": 16, "attention_head_dim": 72, "in_channels": 4, "out_channels": 8, "num_layers": 28,
    "dropout": 0.0, "norm_num_groups": 32, "cross_attention_dim": 1152, "attention_bias": True, "patch_size": 2,
    "activation_fn": "gelu-approximate", "num_embeds_ada_norm": 1000, "upcast_attention": False,
    "norm_type": "ada_norm_single", "norm_elementwise_affine": False, "norm_eps": 1e-6, "caption_channels": 4096,
    "attention_type": "default",
}


def _xl_2(size: int, micro_conditions: bool) -> dict:
    return {**XL_2, "sample_size": size // 8, "interpolation_scale": max(size // 512, 1),
            "use_additional_conditions": micro_conditions}


def _preset(model: str, size: int, micro_conditions: bool, text_tokens: int, label: str) -> Preset:
    grid = size // 8 // 2
    return Preset(
        f"{model} XL/2 (28 blocks, 16 x 72 heads, 0.6B) at {label} ({grid} x {grid} = {grid * grid} image + "
        f"{text_tokens} text tokens{', size and aspect-ratio conditions' if micro_conditions else ''})",
        config=_xl_2(size, micro_conditions),
        inputs={"height": size, "width": size, "text_tokens": text_tokens, "batch": 1},
        make_inputs=make_inputs,
    )


PIXART = Family(
    name="pixart",
    description="PixArt-α / PixArt-Σ text-to-image (PixArtTransformer2DModel)",
    models=(f"{_M}.PixArtTransformer2DModel",),
    block_lists=(BlockList("transformer_blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(BASIC_BLOCK,),
    presets={
        "sigma-xl-1024": _preset("PixArt-Σ", 1024, False, SIGMA_TEXT_TOKENS, "1024x1024"),
        "sigma-xl-512": _preset("PixArt-Σ", 512, False, SIGMA_TEXT_TOKENS, "512x512"),
        "sigma-xl-2k": _preset("PixArt-Σ", 2048, False, SIGMA_TEXT_TOKENS, "2048x2048"),
        "alpha-xl-1024": _preset("PixArt-α", 1024, True, ALPHA_TEXT_TOKENS, "1024x1024"),
        "alpha-xl-512": _preset("PixArt-α", 512, False, ALPHA_TEXT_TOKENS, "512x512"),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(PIXART)
