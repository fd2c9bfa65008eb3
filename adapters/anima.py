"""Anima's text conditioner (diffusers' ``AnimaTextConditioner``, the "LLM adapter" that turns Qwen3-0.6B
states and the prompt's T5 token ids into the text context of Anima's Cosmos transformer).

Anima's transformer is a ``CosmosTransformer3DModel`` (family ``cosmos``); this family is the other
trainable model of the pipeline, which trainers fine-tune next to it (ai-toolkit's
``train_text_conditioner``). The conditioner embeds the T5 ids as learned queries, then runs one list,
``blocks``, of ``AnimaTextConditionerBlock`` s: RMS-normed self-attention ``self_attn`` over the T5
tokens (RoPE on queries and keys), cross-attention ``cross_attn`` from them to the Qwen3 states (RoPE
on each side with its own positions), and an MLP, each a pre-norm residual. Each block returns the
new hidden states alone.

Carry. The loop calls every block with ``hidden_states`` and ``source_hidden_states`` positionally
and the rest by keyword: both attention masks (turned into boolean ``(B, 1, 1, S)`` masks once,
before the loop, or None) and the two RoPE ``(cos, sin)`` tuples (computed once from the target and
source positions, before the loop). The Qwen3 states are the caller's tensor. All of them are the
same objects for every block, nothing runs between blocks and nothing draws random numbers (no
dropout): a chunk carries ``hidden_states`` only, ``Carry({"hidden_states": None})``. Under its own
checkpointing flag (which gradseam switches off while patched) the loop passes the same values
positionally, in the order of the block's parameters.

FFN seam: ``norm_mlp → mlp``. The block's last line is ``h + mlp(norm_mlp(h))``: ``norm_mlp`` (an
``RMSNorm``, or a ``LayerNorm`` with ``use_layer_norm``) is called on the residual stream, ``mlp``
(``Linear → GELU → Linear``, 4·d wide) on ``norm_mlp``'s return value alone, which nothing else
reads, and ``mlp``'s return value only reaches the residual add. A strict chain, so checkpointing it
as one region is exact; it drops the normed copy, the 4·d-wide projection and the GELU output, and
keeps only the residual stream it starts from.

Attention side: ``self_attn`` and ``cross_attn`` (``AnimaTextConditionerAttention``: the projections,
the per-head QK RMS norms, the RoPE and one attention call through diffusers' dispatcher, all inside
the processor). A config with ``use_self_attention=False`` builds no ``self_attn``, so it is optional;
the released config builds it in every block.

Before the loop, ``embed`` (and ``in_proj``, an identity when ``model_dim == target_dim``, as
released) and the RoPE tables; after it, ``out_proj``, ``norm``, the mask multiply and the zero
padding to ``min_sequence_length``: all outside every region.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker

_M = "diffusers.models.condition_embedders.condition_embedder_anima"

# The pipeline tokenizes each prompt with Qwen3's and T5's tokenizers, both capped at max_sequence_length
# (512 by default) and padded to the longest prompt of the batch.
PROMPT_TOKENS = 512

# The released LLM adapter (the net.llm_adapter.* weights of Anima's checkpoint, whose shapes
# scripts/convert_anima_to_diffusers.py reads the config from): Qwen3-0.6B states (1024 wide) into 6 blocks
# 1024 wide, 16 heads of 64, MLP 4096, T5's vocabulary of 32128; 135M parameters. diffusers' class defaults
# reproduce it; spelled out so that a change of default upstream does not move the preset.
ANIMA_CONDITIONER = {
    "source_dim": 1024, "target_dim": 1024, "model_dim": 1024, "num_layers": 6, "num_attention_heads": 16,
    "mlp_ratio": 4.0, "target_vocab_size": 32128, "use_self_attention": True, "use_layer_norm": False,
    "min_sequence_length": 512,
}


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, t5_tokens: int = PROMPT_TOKENS,
    qwen_tokens: int = PROMPT_TOKENS,
) -> dict:
    """One real-size batch as Anima's pipeline calls the conditioner: the Qwen3 last hidden states
    ``(1, qwen_tokens, source_dim)`` (grad: the input a frozen-weights benchmark differentiates
    through), the T5 token ids ``(1, t5_tokens)`` and both tokenizers' masks (int64, all valid: one
    prompt is never padded).

    ``tokens`` overrides both counts at once (one prompt through both tokenizers); the T5 count is the
    sequence the blocks carry.
    """
    import torch

    cfg = model.config
    if tokens:
        t5_tokens = qwen_tokens = tokens
    randn = tensor_maker(device, dtype)
    return {
        "source_hidden_states": randn(1, qwen_tokens, cfg.source_dim, grad=True),
        "target_input_ids": torch.randint(0, cfg.target_vocab_size, (1, t5_tokens), device=device),
        "target_attention_mask": torch.ones(1, t5_tokens, device=device, dtype=torch.int64),
        "source_attention_mask": torch.ones(1, qwen_tokens, device=device, dtype=torch.int64),
    }


ANIMA_TEXT_CONDITIONER = Family(
    name="anima-text-conditioner",
    description="Anima's text conditioner, the LLM adapter before its Cosmos transformer (AnimaTextConditioner)",
    models=(f"{_M}.AnimaTextConditioner",),
    block_lists=(BlockList("blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(
        BlockClass(
            f"{_M}.AnimaTextConditionerBlock",
            ffn=(("norm_mlp", "mlp"),),
            attention=("self_attn", "cross_attn"),
            optional=("self_attn",),
        ),
    ),
    presets={
        "anima-512": Preset(
            "Anima's released LLM adapter (6 blocks, 1024 wide, 16 x 64 heads, MLP 4096; 135M parameters) at "
            "the pipeline's cap: 512 T5 token queries cross-attending to 512 Qwen3-0.6B states",
            config=ANIMA_CONDITIONER,
            inputs={"t5_tokens": PROMPT_TOKENS, "qwen_tokens": PROMPT_TOKENS},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(ANIMA_TEXT_CONDITIONER)
