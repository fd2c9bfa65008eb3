"""Nucleus-Image (NucleusMoEImageTransformer2DModel: the 17B sparse mixture-of-experts DiT, ~2B active).

One block list, ``transformer_blocks``, all ``NucleusMoEImageTransformerBlock``. Only the image tokens
run through the blocks: the text (Qwen3-VL hidden states, RMS-normed once before the loop) never
becomes a stream of its own. Each block projects it with its own ``encoder_proj`` and hands the
result to ``attn`` as extra keys and values (no text queries), so a block returns the new image
``hidden_states`` alone. The model's loop calls every block as ``block(hidden_states=,
encoder_hidden_states=, temb=, image_rotary_emb=, attention_kwargs=)`` (positionally, in the same
order, under diffusers' own checkpointing flag). The normed text, ``temb`` (timestep embedding),
the RoPE ``(image, text)`` frequency tuple and ``block_attention_kwargs`` (one dict per forward,
holding the joint key mask when a text mask is given) are built once before the loop and are the
same objects for every block; nothing is added between blocks. So the list carries
``hidden_states`` and nothing else: ``Carry({"hidden_states": None})``.

FFN seam: ``img_mlp``. The block computes ``h + tanh(gate2) * img_mlp(n * (1 + scale2), n, timestep=temb)``
with ``n = pre_mlp_norm(h)`` in MoE blocks (``img_mlp(n * (1 + scale2))`` in dense ones), so
``img_mlp`` gets only tensors made for it or shared read-only (``n``, ``temb``), and its return
value goes only to the gated residual. ``pre_mlp_norm`` cannot join: ``img_mlp``'s first argument
is its output modulated, not its output. One path serves both kinds of block: the released config
leaves the first three blocks dense (a SwiGLU ``FeedForward``) and makes the other 29 a
``NucleusMoELayer`` under the same attribute name.

The MoE layer recomputes exactly. Its routing is *expert choice*: a linear ``gate`` over
``[temb, n]`` (the timestep and the unmodulated norm, the "decoupled routing" of the paper), a
softmax (or sigmoid) over experts, then for every expert ``torch.topk`` of its affinities over the
sequence with a capacity of ``ceil(capacity_factor * tokens / experts)`` tokens. Every step of that
is a deterministic function of the seam's inputs and the gate's weight: no noise, no generator, no
jitter, no training-only branch (train and eval route alike), no load-balancing loss (expert choice
needs none, and none is computed), no running statistics, no buffer or attribute written in forward.
A recompute sees the identical input tensors, so it picks the same tokens for every expert, in the
same order, with the same gating weights; the routed experts then run either as a per-expert loop
(``use_grouped_mm=False``) or as ``F.grouped_mm`` (the released config), both on the same gathered
rows. Recomputing ``img_mlp`` drops the router's ``(tokens, experts)`` scores, the gathered copy of
the routed tokens (``capacity_factor`` times the sequence: 4x in blocks 3-4 and 2x in the rest of the
released model), the SwiGLU activations of every routed expert and of the shared one, and the
scatter-added sum, which together dominate what a MoE block keeps. The checkpoint keeps only the seam's inputs. On a
GPU the two ``scatter_add`` calls that normalise the gating weights and sum the routed outputs
accumulate with atomics, so two unpatched steps already differ in the last bits; the routing (the
``topk`` indices) does not. Seen on an H200 (bf16, ``grouped_mm``, four blocks, 1024 image tokens,
a padded batch of two): with ``torch.use_deterministic_algorithms(True)`` every strategy (``torch``,
``torch-ffn``, interval 2, ``unsloth``, ``unsloth-ffn``) gave the unpatched step's outputs and
gradients bit for bit and the recompute routed every token as the forward did; without it, each
stayed within the spread of two unpatched steps.

Attention side: ``attn`` (the image Q/K/V projections, the text's ``add_k_proj`` / ``add_v_proj``, the
QK RMSNorms, RoPE on the image queries and keys and on the text keys, GQA head repetition and the SDPA
over ``[image, text]`` keys). ``encoder_proj`` runs outside it, a plain linear layer.

diffusers' text KV cache (``TextKVCacheConfig``, ``diffusers.hooks.text_kv_cache``) is an inference
feature: a hook per block that computes the text keys and values once, keyed on a data pointer, and
writes them into the shared ``attention_kwargs`` dict as ``cached_txt_key`` / ``cached_txt_value``
before the block runs. Under ``no_grad`` gradseam adds no work, so inference with the cache on a
patched model is unchanged (tested); training with it is not meaningful (the cache
would hold the first step's graph) and is not something gradseam claims.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker

_M = "diffusers.models.transformers.transformer_nucleusmoe_image"

# The released transformer config (NucleusAI/Nucleus-Image, transformer/config.json): 32 blocks, the
# first three dense, the other 29 with 64 routed experts (plus a shared one) of width 1344; expert
# capacity 4x the sequence in blocks 3-4 and 2x after (the dense blocks' 0.0 is unused). 16 query
# heads over 4 key-value heads of 128, Qwen3-VL-8B text states (4096 wide), 16-channel latents
# packed 2x2 (64 in, 16 out per patch position).
RELEASED: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 32,
    "attention_head_dim": 128,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "joint_attention_dim": 4096,
    "axes_dims_rope": (16, 56, 56),
    "mlp_ratio": 4.0,
    "moe_enabled": True,
    "dense_moe_strategy": "leave_first_three_blocks_dense",
    "num_experts": 64,
    "moe_intermediate_dim": 1344,
    "capacity_factors": [0.0, 0.0, 0.0, 4.0, 4.0] + [2.0] * 27,
    "use_sigmoid": False,
    "route_scale": 2.5,
    "use_grouped_mm": True,
}

# Prompt length: the pipeline and ai-toolkit pad a batch to its longest prompt (a multiple of 8, at
# most 1024), and every prompt carries the pipeline's ~70-token system prompt and chat template. 256
# tokens stands for a long caption; it is an assumption, not a fixed size of the model.
TEXT_TOKENS = 256


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, height: int = 1024, width: int = 1024,
    text_tokens: int = TEXT_TOKENS, prompt_tokens: int | None = None,
) -> dict:
    """One real-size batch as ai-toolkit feeds the transformer: the packed latent ``(1, H/16 * W/16,
    in_channels)`` (grad; the Qwen-Image VAE's 8x downsampling, then 2x2 patches), its
    ``img_shapes`` ``[(1, H/16, W/16)]``, the Qwen3-VL states ``(1, text_tokens, 4096)`` with the
    tokenizer's mask (``prompt_tokens`` valid tokens, right-padded; all valid by default) and a
    timestep in ``[0, 1]`` (the scheduler's timestep / 1000).

    ``tokens`` overrides the image token count with a square grid of about that many patches.
    """
    import torch

    cfg = model.config
    scale = 8 * cfg.patch_size
    if tokens:
        rows = cols = square_side(tokens)
    else:
        rows, cols = height // scale, width // scale
    randn = tensor_maker(device, dtype)
    valid = text_tokens if prompt_tokens is None else prompt_tokens
    mask = torch.zeros(1, text_tokens, device=device, dtype=torch.long)
    mask[:, :valid] = 1
    return {
        "hidden_states": randn(1, rows * cols, cfg.in_channels, grad=True),
        "img_shapes": [(1, rows, cols)],
        "encoder_hidden_states": randn(1, text_tokens, cfg.joint_attention_dim),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
    }


def _preset(size: int) -> Preset:
    side = size // 16
    return Preset(
        f"Nucleus-Image 17B (32 blocks: 3 dense + 29 MoE with 64 experts of 1344 and a shared one, expert-choice "
        f"routing at 4x / 2x capacity; 16 x 128 query heads over 4 KV heads) at {size}x{size}: "
        f"{side * side} image tokens attending to {TEXT_TOKENS} Qwen3-VL text tokens",
        config=RELEASED,
        inputs={"height": size, "width": size},
        make_inputs=make_inputs,
    )


NUCLEUS_MOE = Family(
    name="nucleus-moe",
    description="Nucleus-Image, sparse MoE DiT (NucleusMoEImageTransformer2DModel)",
    models=(f"{_M}.NucleusMoEImageTransformer2DModel",),
    block_lists=(BlockList("transformer_blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(
        BlockClass(f"{_M}.NucleusMoEImageTransformerBlock", ffn=(("img_mlp",),), attention=("attn",)),
    ),
    presets={"17b-1024": _preset(1024), "17b-512": _preset(512)},
)


@hookimpl
def register_families(register: Any) -> None:
    register(NUCLEUS_MOE)
