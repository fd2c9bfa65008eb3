"""HiDream-I1 Full / Dev / Fast (HiDreamImageTransformer2DModel; HiDream-E1 shares the class).

Two block lists, ``double_stream_blocks`` and ``single_stream_blocks``. Every entry of both is a
``HiDreamBlock``, a thin wrapper whose ``block`` attribute holds the real
``HiDreamImageTransformerBlock`` (double stream) or ``HiDreamImageSingleTransformerBlock``
(single stream). gradseam patches the wrapper, the module the model's loop calls, so one
``BlockClass`` for ``HiDreamBlock`` reaches the inner modules through dotted paths.

**No carry, in either list** (``gradient_checkpointing_interval`` is ignored with a warning and every
selected block is its own region). The loop does not hand one block's outputs straight to the next:

- double stream: before each block it builds ``encoder_hidden_states`` afresh as
  ``cat([text so far, Llama-3.1 states of layer llama_layers[i]])`` (a different Llama layer per
  block), and after it slices the returned text stream back to the T5 + first-Llama part;
- single stream: before each block it concatenates that block's own Llama layer to the joint
  sequence, and after it cuts the sequence back to its previous length.

So the next block's input is a new tensor the model makes between the blocks, from a per-block
argument; a chunk would need it before the model has built it.

FFN seams. Both inner blocks apply the feed-forward as ``gate * ff(norm3(x) * (1 + scale) + shift)``
with the residual outside; ``norm3`` cannot join (its output is modulated first). The image stream's
``ff_i`` is a seam in both blocks (``block.ff_i``), the text stream's ``ff_t`` in the double block
(``block.ff_t``, optional, since single blocks have none).

``ff_i`` is a mixture of experts (``MOEFeedForwardSwiGLU``: a shared SwiGLU expert plus four routed
ones, two active per token; with ``num_routed_experts=0`` it is a plain SwiGLU), and a recompute is
exact only if it routes every token as the forward did. It does: the gate is a softmax over a linear
map of the seam's input, followed by ``torch.topk``, a deterministic function of that input (no noise,
no capacity limit, no token dropping, nothing drawn from a generator), and recomputation sees the
identical input tensor. The gate's load-balancing ``aux_loss`` is computed in training mode but
only returned to the MoE module, which discards it (its ``AddAuxiliaryLoss`` hook is commented out
upstream): nothing is accumulated on a module or global during forward, so a second forward leaves no
state behind. In training mode each routed expert runs on a boolean-mask gather of its tokens and
writes into a fresh buffer; in eval mode (or with ``force_inference_output``) the routed experts run
in ``moe_infer`` under ``torch.no_grad()`` (a diffusers quirk: then only the shared expert receives
gradients), so a recompute reproduces a constant. Recomputing ``ff_i`` drops the
``repeat_interleave``-d copy of the tokens, every expert's SwiGLU activations and the weighted sum,
which dominate what a HiDream block keeps.

Attention side: ``block.attn1`` (the joint attention of both streams in the double block, the
single-stream attention in the single block; QK RMSNorms and RoPE included).
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

_M = "diffusers.models.transformers.transformer_hidream_image"

# The released transformer config (HiDream-ai/HiDream-I1-Full, -Dev and -Fast share it). The class
# defaults leave patch_size, caption_channels and llama_layers unset and cannot build a model.
RELEASED = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 16,
    "num_single_layers": 32,
    "attention_head_dim": 128,
    "num_attention_heads": 20,
    "caption_channels": [4096, 4096],
    "text_emb_dim": 2048,
    "num_routed_experts": 4,
    "num_activated_experts": 2,
    "axes_dims_rope": [64, 32, 32],
    "max_resolution": [128, 128],
    "llama_layers": list(range(32)) + [31] * 16,
}


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, image_tokens: int = 4096,
    t5_tokens: int = 128, llama_tokens: int = 128,
) -> dict:
    """One real-size batch as ``HiDreamImagePipeline`` builds it: a square VAE latent ``(1, 16, H/8, W/8)``
    (grad) of about ``tokens`` 2x2 patches, the T5 states, every Llama-3.1 hidden state stacked
    ``(layers, 1, L, 4096)`` (the model picks one per block through ``llama_layers``), and the pooled
    CLIP-L + CLIP-G vector. The pipeline pads both prompts to 128 tokens."""
    import torch

    cfg = model.config
    randn = tensor_maker(device, dtype)
    side = square_side(tokens or image_tokens) * cfg.patch_size
    llama_layers = max(cfg.llama_layers) + 1
    return {
        "hidden_states": randn(1, cfg.in_channels, side, side, grad=True),
        "timesteps": torch.full((1,), 500.0, device=device, dtype=dtype),
        "encoder_hidden_states_t5": randn(1, t5_tokens, cfg.caption_channels[0]),
        "encoder_hidden_states_llama3": randn(llama_layers, 1, llama_tokens, cfg.caption_channels[1]),
        "pooled_embeds": randn(1, cfg.text_emb_dim),
    }


HIDREAM = Family(
    name="hidream",
    description="HiDream-I1 Full / Dev / Fast (HiDreamImageTransformer2DModel)",
    models=(f"{_M}.HiDreamImageTransformer2DModel",),
    block_lists=(
        BlockList("double_stream_blocks"),  # no carry: the loop rebuilds the text input per block
        BlockList("single_stream_blocks"),  # no carry: the loop appends a per-block Llama layer
    ),
    block_classes=(
        BlockClass(
            f"{_M}.HiDreamBlock",
            ffn=(("block.ff_i",), ("block.ff_t",)),
            attention=("block.attn1",),
            optional=("block.ff_t",),
        ),
    ),
    presets={
        "i1-1024": Preset(
            "HiDream-I1 17B (16 double + 32 single MoE blocks, 20 x 128 heads, 4 routed experts, 2 active; "
            "the released config: the class defaults cannot build a model) at 1024x1024: 4096 image tokens; "
            "128 T5 + 128 Llama-3.1 tokens carried through the blocks plus 128 of each block's own Llama layer",
            config=RELEASED,
            inputs={"image_tokens": 4096},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(HIDREAM)
