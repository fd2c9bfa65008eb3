"""Bria 3.2 and Bria FIBO: diffusers' ``BriaTransformer2DModel`` (family ``bria``) and
``BriaFiboTransformer2DModel`` (family ``bria-fibo``), two Flux-layout MMDiTs with classes of their own.

**bria** (Bria 3.1 / 3.2 text-to-image, T5-XXL prompts). Two block lists, in the order the model runs
them:

- ``transformer_blocks`` (``BriaTransformerBlock``): image and text streams, each with its own
  adaLN-zero modulation and tanh-GELU ``FeedForward`` (``ff``, ``ff_context``), meeting in one joint
  attention ``attn``; returns ``(encoder_hidden_states, hidden_states)``.
- ``single_transformer_blocks`` (``BriaSingleTransformerBlock``): concatenates ``[text, image]`` inside
  the block, runs attention and the MLP in parallel and splits the result again on return, so it also
  returns ``(encoder_hidden_states, hidden_states)`` (two views of one tensor).

The loop calls every block by keyword with ``hidden_states``, ``encoder_hidden_states``, ``temb`` and
``image_rotary_emb``. ``temb`` (timestep embedding) and the ``(cos, sin)`` RoPE of the text and image ids
are computed once before the loops and are the same objects for every block, and nothing happens
between blocks, so both lists carry ``{"encoder_hidden_states": 0, "hidden_states": 1}`` and interval
chunks run whole. ControlNet residuals (``controlnet_block_samples`` /
``controlnet_single_block_samples``; diffusers ships no Bria ControlNet, but the model takes them) are
applied between blocks: after a double block out of place (``hidden_states + sample``, a new object),
after a single block *in place* into the returned image view. Either way the next block of a chunk sees
an object other than the one its predecessor returned, or the same one with a newer version, so the
chunk computes block by block, exactly (the tests check both fall-backs, gradients of the residuals
included).

The eager loop passes no ``attention_kwargs`` to the blocks (the forward takes the argument only for its
LoRA scale), while diffusers' own checkpointing path passes it as the blocks' fifth positional argument:
with a non-empty dict the two paths differ upstream. gradseam wraps the blocks the model calls, so a
patched model computes what the eager one does.

**bria-fibo** (Bria FIBO, SmolLM3-3B prompts, Wan 2.2 VAE latents). Two block lists:
``transformer_blocks`` (``BriaFiboTransformerBlock``, returning ``(encoder_hidden_states,
hidden_states)``) and ``single_transformer_blocks`` (``BriaFiboSingleTransformerBlock``, which takes the
already concatenated ``[text, image]`` sequence and returns one tensor). **No carry, in either list**:
before every block the loop rebuilds the text stream (DimFusion) as ``cat([text[..., :D/2],
caption_projection[i](text_encoder_layers[i])], -1)``, a fresh tensor from that block's own projected
LLM layer; before each single block it also concatenates text and image, and after it slices them
apart again. A chunk would need those tensors before the model has made them, so every selected block
is its own region and ``gradient_checkpointing_interval`` is ignored, with a warning (as in ``hidream``
and ``chroma``). Everything else the loop passes (``temb``, the RoPE, ``joint_attention_kwargs``, which
holds the mask: the pipeline's key-padding one, the fine-tuning script's additive one) is one object for
every block. diffusers' own checkpointing path
passes the same arguments positionally, in the blocks' parameter order, and is exact.

FFN seams, both families. Double blocks: ``ff`` and ``ff_context``, each called on exactly its
stream's ``norm2`` output scaled and shifted (a fresh tensor), its return value only gated and added
to the residual; the norms cannot join (their output is modulated before the FFN sees it). Recomputing
drops the 4·d-wide activations (12288 at FIBO's width). Single blocks have no FFN module: ``proj_mlp``
then ``act_mlp`` run beside attention on the modulated norm and meet it in ``proj_out``, so the strict
chain is ``proj_mlp -> act_mlp`` (``act_mlp`` is called on ``proj_mlp``'s output alone); it drops the
4·d-wide pre-activation, while ``proj_out``'s concatenated input stays kept (cutting there would
recompute attention too). Every dropout has ``p = 0``.

Attention side: ``attn`` in all four classes (QKV projections, QK RMSNorms, RoPE, the dispatched SDPA
call and the output projections, all inside its processor; FIBO's single blocks use diffusers'
generic ``Attention`` with Bria's processor, which forwards the mask from ``joint_attention_kwargs``).
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import flux_ids, tensor_maker

_M = "diffusers.models.transformers.transformer_bria"
_F = "diffusers.models.transformers.transformer_bria_fibo"
_STREAMS = Carry({"encoder_hidden_states": 0, "hidden_states": 1})

# briaai/BRIA-3.2's transformer config (Bria 3.1 shares it): 8 double + 28 single blocks, 24 heads of 96,
# 16 channels (4 VAE channels packed 2x2). The class defaults are Flux's trunk, not a Bria checkpoint.
BRIA_32 = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 8,
    "num_single_layers": 28,
    "attention_head_dim": 96,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": None,
    "guidance_embeds": False,
    "axes_dims_rope": [0, 48, 48],
    "rope_theta": 10000,
    "time_theta": 10000,
}

# Bria FIBO (the paper's architecture table: 8 dual + 38 single blocks, 24 x 128 heads, FFN 12288, RoPE
# axes 16/56/56): 48 channels of the Wan 2.2 VAE latent (16x, not packed), SmolLM3-3B states (2048 wide;
# the last two layers concatenated for encoder_hidden_states, 4096). The class defaults are 19 + 38 blocks.
FIBO = {
    "patch_size": 1,
    "in_channels": 48,
    "num_layers": 8,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": None,
    "guidance_embeds": False,
    "axes_dims_rope": [16, 56, 56],
    "rope_theta": 10000,
    "time_theta": 10000,
    "text_encoder_dim": 2048,
}


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, image_tokens: int = 4096, text_tokens: int = 128,
) -> dict:
    """One real-size batch as ``BriaPipeline`` feeds the transformer: the packed latents ``(1, N, 16)``
    (grad; a square grid of ``N`` 2x2 patches of the 8x VAE latent, 4096 at 1024x1024), the T5-XXL prompt
    states zero-padded to ``text_tokens`` (the pipeline's ``max_sequence_length``, 128 by default), the
    timestep on the scheduler's 0-1000 scale (the model does not rescale it) and Flux's position ids
    (zeros for the text). ``tokens`` overrides the image token count."""
    import torch

    cfg = model.config
    img_ids, txt_ids = flux_ids(text_tokens, tokens or image_tokens, device)
    randn = tensor_maker(device, dtype)
    return {
        "hidden_states": randn(1, img_ids.shape[0], cfg.in_channels, grad=True),
        "encoder_hidden_states": randn(1, text_tokens, cfg.joint_attention_dim),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "img_ids": img_ids.to(dtype),
        "txt_ids": txt_ids.to(dtype),
    }


def make_fibo_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, image_tokens: int = 4096,
    text_tokens: int = 1176, llm_layers: int = 37,
) -> dict:
    """One real-size batch as ``BriaFiboPipeline`` (and Bria's FIBO fine-tuning script) feeds the
    transformer: the Wan 2.2 latent flattened to ``(1, N, 48)`` tokens (grad; a square grid, 4096 at
    1024x1024 through the 16x VAE), the prompt states ``(1, L, 4096)`` (SmolLM3-3B's last two hidden
    states side by side), one LLM hidden state ``(1, L, 2048)`` per block in ``text_encoder_layers``, the
    timestep on the 0-1000 scale and the position ids (zeros for the text). ``L = text_tokens`` defaults to
    1176, the median structured-caption length the FIBO paper reports.

    As the pipeline does, the list holds the last ``llm_layers`` hidden states (SmolLM3-3B has 36 layers
    plus the embeddings: 37), the last one repeated until there is one per block of the model as built
    (fewer when ``bench`` truncates it). The prompts are unpadded, so there is no mask (the pipeline passes
    one only when a batch has padding). ``tokens`` overrides the image token count."""
    import torch

    cfg = model.config
    img_ids, txt_ids = flux_ids(text_tokens, tokens or image_tokens, device)
    randn = tensor_maker(device, dtype)
    blocks = len(model.transformer_blocks) + len(model.single_transformer_blocks)
    layers = [randn(1, text_tokens, cfg.text_encoder_dim) for _ in range(min(llm_layers, blocks))]
    layers += [layers[-1]] * (blocks - len(layers))
    return {
        "hidden_states": randn(1, img_ids.shape[0], cfg.in_channels, grad=True),
        "encoder_hidden_states": randn(1, text_tokens, cfg.joint_attention_dim),
        "text_encoder_layers": layers,
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "img_ids": img_ids.to(dtype),
        "txt_ids": txt_ids.to(dtype),
    }


BRIA = Family(
    name="bria",
    description="Bria 3.1 / 3.2 (BriaTransformer2DModel)",
    models=(f"{_M}.BriaTransformer2DModel",),
    block_lists=(
        BlockList("transformer_blocks", carry=_STREAMS),
        BlockList("single_transformer_blocks", carry=_STREAMS),
    ),
    block_classes=(
        BlockClass(f"{_M}.BriaTransformerBlock", ffn=(("ff",), ("ff_context",)), attention=("attn",)),
        BlockClass(f"{_M}.BriaSingleTransformerBlock", ffn=(("proj_mlp", "act_mlp"),), attention=("attn",)),
    ),
    presets={
        "3.2-1024": Preset(
            "Bria 3.2 (8 double + 28 single blocks, 24 x 96 heads, 3.8B; the released config, not the class "
            "defaults, which are Flux's trunk) at 1024x1024: 4096 image + 128 T5 tokens (the pipeline pads "
            "every prompt to 128)",
            config=BRIA_32,
            inputs={"image_tokens": 4096, "text_tokens": 128},
            make_inputs=make_inputs,
        ),
    },
)

BRIA_FIBO = Family(
    name="bria-fibo",
    description="Bria FIBO (BriaFiboTransformer2DModel)",
    models=(f"{_F}.BriaFiboTransformer2DModel",),
    block_lists=(
        BlockList("transformer_blocks"),  # no carry: the loop rebuilds the text stream before every block
        BlockList("single_transformer_blocks"),  # no carry: ... and concatenates and splits the streams
    ),
    block_classes=(
        BlockClass(f"{_F}.BriaFiboTransformerBlock", ffn=(("ff",), ("ff_context",)), attention=("attn",)),
        BlockClass(f"{_F}.BriaFiboSingleTransformerBlock", ffn=(("proj_mlp", "act_mlp"),), attention=("attn",)),
    ),
    presets={
        "8b-1024": Preset(
            "Bria FIBO 8B (8 double + 38 single blocks, 24 x 128 heads, FFN 12288; the released architecture, "
            "not the class defaults of 19 + 38) at 1024x1024: 4096 image tokens (Wan 2.2 latent, 16x) + 1176 "
            "SmolLM3-3B tokens (the median structured caption), one projected LLM layer per block",
            config=FIBO,
            inputs={"image_tokens": 4096, "text_tokens": 1176},
            make_inputs=make_fibo_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(BRIA)
    register(BRIA_FIBO)
