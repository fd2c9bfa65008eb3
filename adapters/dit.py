"""DiT, the class-conditional ImageNet diffusion transformer (diffusers' ``DiTTransformer2DModel``:
facebook/DiT-XL-2-256 and DiT-XL-2-512, whose checkpoints say ``Transformer2DModel`` and load as this class).

One list, ``transformer_blocks``, of diffusers' generic ``BasicTransformerBlock``, built with
``norm_type="ada_norm_zero"`` and no ``cross_attention_dim``: an adaLN-Zero ``norm1`` that embeds the
timestep and the class label itself (``norm1.emb``: every block has its own timestep MLP and label table),
self-attention ``attn1``, then ``norm3`` and ``ff``. Without a cross-attention dimension the block builds no
``attn2`` and no ``norm2`` (both ``None``). Each block returns the new hidden states alone.

Carry. The loop calls every block by keyword with the model's own ``timestep``, ``class_labels`` and
``cross_attention_kwargs`` objects, untouched, and ``None`` for the masks and the text; nothing happens
between blocks. What differs per block (the conditioning each ``norm1`` embeds) is computed inside the
block from those shared arguments. So a chunk carries ``hidden_states`` and nothing else:
``Carry({"hidden_states": None})``.

Random numbers are drawn inside every block. In training mode each block's ``LabelEmbedding`` replaces
each label by the extra "null" class with probability ``class_dropout_prob`` (0.1, fixed by diffusers),
drawing ``torch.rand(batch)`` from the generator of the labels' device: independently in every block, and
once more after the loop. Nothing is drawn between blocks. A recompute is exact because checkpointing
restores the generators before it reruns a region, and a chunk puts them back where its first block alone
would have left them, each later block it serves moving them on to where its own run left them; the tests
run the kit with the draws on.

FFN seam: ``ff`` (a tanh-GELU ``FeedForward``, 4·d wide). It is called on
``norm3(hidden_states) * (1 + scale_mlp) + shift_mlp``, a tensor made for it alone, and its return value
goes only into ``gate_mlp * ff_output + hidden_states``: checkpointing ``ff`` alone is exact and drops its
4·d-wide activations. ``norm3`` cannot join, since its output is scaled and shifted before ``ff`` sees it.
With feed-forward chunking (``block.set_chunk_feed_forward(size, dim)``) ``ff`` runs once per slice of that
tensor and the outputs are concatenated: each call is a region of its own, exact the same way.

Attention side: ``attn1`` (projections and the SDPA call, inside its processor). ``attn2`` is declared too,
as optional: absent in every DiT block, present where other models build ``BasicTransformerBlock`` with
cross-attention (the ``latte`` family reuses this declaration).

One call outside every block: after the loop the model calls ``transformer_blocks[0].norm1.emb`` again,
for the final layer's modulation. It is an ordinary module call (gradseam replaces the blocks' ``forward``,
and no region wraps ``norm1.emb``), so checkpointing, chunks, FFN seams, offload and compiled blocks leave
it exact. Weight streaming would not: a streamed block's weights are in host memory outside its own
forward, so streaming block 0 whole would hand that call host weights (on a GPU, a device mismatch). The
block list declares the call (``called_outside=((0, "norm1.emb"),)``), so when block 0 streams its
``norm1.emb`` (the timestep MLP and the label table, ~2.8M parameters) stays on the GPU and the rest of
the block streams; the conformance kit's outside-call check fails the family without the declaration.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

_M = "diffusers.models.transformers.dit_transformer_2d"

# diffusers' generic block, shared with the latte family (which imports this declaration).
BASIC_BLOCK = BlockClass(
    "diffusers.models.attention.BasicTransformerBlock",
    ffn=(("ff",),),
    attention=("attn1", "attn2"),
    optional=("attn2",),
)

# DiT trains at a global batch of 256, 32 images on each of 8 GPUs (the reference training script).
TRAIN_BATCH = 32


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, resolution: int = 256,
    batch: int = TRAIN_BATCH,
) -> dict:
    """One real-size training batch as DiT's training loop feeds the transformer: ``batch`` SD-VAE latents
    ``(batch, 4, resolution/8, resolution/8)`` (grad), one timestep and one ImageNet class per image (the
    pipeline passes both as int64; the model drops labels itself in training mode).

    ``tokens`` overrides the tokens per image (a square grid of 2x2 patches: the model unpatchifies square
    grids only)."""
    import torch

    cfg = model.config
    side = (square_side(tokens) if tokens else resolution // 8 // cfg.patch_size) * cfg.patch_size
    randn = tensor_maker(device, dtype)
    return {
        "hidden_states": randn(batch, cfg.in_channels, side, side, grad=True),
        "timestep": (torch.arange(batch, device=device, dtype=torch.long) * 997 + 500) % 1000,
        "class_labels": torch.arange(batch, device=device, dtype=torch.long) * 37 % cfg.num_embeds_ada_norm,
    }


# DiT-XL/2 as facebook/DiT-XL-2-256 has it (diffusers' conversion: 28 blocks, 16 x 72 heads = 1152 wide,
# patch 2, a latent of resolution / 8; 1000 ImageNet classes; 8 output channels, the noise and the learned
# variance), as DiTTransformer2DModel arguments. The 512 model differs in sample_size alone.
XL_2 = {
    "num_attention_heads": 16, "attention_head_dim": 72, "in_channels": 4, "out_channels": 8,
    "num_layers": 28, "dropout": 0.0, "norm_num_groups": 32, "attention_bias": True, "sample_size": 32,
    "patch_size": 2, "activation_fn": "gelu-approximate", "num_embeds_ada_norm": 1000,
    "upcast_attention": False, "norm_type": "ada_norm_zero", "norm_elementwise_affine": False,
    "norm_eps": 1e-5,
}
TRUNK = ("DiT-XL/2 (28 blocks, 16 x 72 heads, 1000 classes; 750M, each block with its own label and "
         "timestep embedders)")

DIT = Family(
    name="dit",
    description="DiT class-conditional ImageNet diffusion transformer (DiTTransformer2DModel)",
    models=(f"{_M}.DiTTransformer2DModel",),
    # the final layer's modulation: block 0's norm1.emb, called again after the loop
    block_lists=(BlockList("transformer_blocks", carry=Carry({"hidden_states": None}),
                           called_outside=((0, "norm1.emb"),)),),
    block_classes=(BASIC_BLOCK,),
    presets={
        "xl-2-256": Preset(
            f"{TRUNK} at 256x256, batch {TRAIN_BATCH} (32 x 32 latent: 256 tokens per image)",
            config=XL_2,
            inputs={"resolution": 256, "batch": TRAIN_BATCH},
            make_inputs=make_inputs,
        ),
        "xl-2-512": Preset(
            f"{TRUNK} at 512x512, batch {TRAIN_BATCH} (64 x 64 latent: 1024 tokens per image)",
            config={**XL_2, "sample_size": 64},
            inputs={"resolution": 512, "batch": TRAIN_BATCH},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(DIT)
