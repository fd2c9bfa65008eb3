"""HunyuanVideo 1.5 text/image-to-video (HunyuanVideo15Transformer3DModel).

Two block lists, in the order the model runs them:

- **Token refiner** (``context_embedder.token_refiner.refiner_blocks``,
  ``HunyuanVideo15IndividualTokenRefinerBlock``): plain pre-norm blocks over the Qwen2.5-VL
  prompt tokens, inside the model's ``context_embedder``. Its loop is
  ``hidden_states = block(hidden_states, temb, self_attn_mask)`` with ``temb`` and the mask built
  once before the loop, so every argument but the carried ``hidden_states`` is the same object
  for every block: ``Carry({"hidden_states": None})``. The MLP is ``ff(norm2(hidden_states))``,
  gate and residual outside it, with no modulation in between, so ``norm2 → ff`` is a strict
  chain and the seam (it also drops the normalised copy). Attention is ``attn``.
- **Dual-stream trunk** (``transformer_blocks``, ``HunyuanVideo15TransformerBlock``): video and
  text streams meeting in one joint attention ``attn``, the block returning
  ``(hidden_states, encoder_hidden_states)``. The loop calls it positionally as
  ``block(hidden_states, encoder_hidden_states, temb, encoder_attention_mask, image_rotary_emb)``;
  the timestep embedding, the reordered text mask and the RoPE table are computed once before the
  loop and passed unchanged to every block, and nothing is added between blocks, so a chunk only
  carries the two streams: ``Carry({"hidden_states": 0, "encoder_hidden_states": 1})``. Each
  stream ends in its own ``FeedForward`` (``ff``, ``ff_context``), called on exactly the
  modulated ``norm2`` / ``norm2_context`` output with gate and residual applied outside; each is
  a seam of its own. ``norm2`` cannot join: its output is scaled and shifted before ``ff`` sees
  it, and everything before the norms is attention.

Image conditioning (I2V: non-zero SigLIP ``image_embeds``), padded prompts and the MeanFlow
``timestep_r`` only change what the model builds *before* the trunk (the text sequence, its mask,
``temb``); the blocks still receive one shared object each, so chunks stay whole with them.
"""

from __future__ import annotations

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker, video_latent_size

_M = "diffusers.models.transformers.transformer_hunyuan_video15"


def make_inputs(
    model,
    device,
    dtype,
    tokens=None,
    *,
    frames=121,
    height=480,
    width=848,
    text_tokens=1000,
    byt5_tokens=256,
    image_tokens=729,
) -> dict:
    """One real-size T2V batch: the 65-channel latent input ``(1, 65, (frames-1)/4+1, H/16, W/16)`` (grad),
    Qwen2.5-VL and ByT5 prompt states with their masks, and all-zero SigLIP ``image_embeds`` (T2V).

    The sizes are the pipeline's: 1000 MLLM tokens, 256 ByT5 tokens, 729 vision tokens, a VAE with
    4x temporal and 16x spatial compression. ``tokens`` overrides the video token count by changing
    the number of latent frames.
    """
    import torch

    cfg = model.config
    patch = (cfg.patch_size_t, cfg.patch_size, cfg.patch_size)
    latent_frames, h, w = video_latent_size(frames, height, width, patch=patch, tokens=tokens, spatial=16)

    randn = tensor_maker(device, dtype)

    def ones(n):
        return torch.ones(1, n, device=device, dtype=torch.int64)

    return {
        "hidden_states": randn(1, cfg.in_channels, latent_frames, h, w, grad=True),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, text_tokens, cfg.text_embed_dim),
        "encoder_attention_mask": ones(text_tokens),
        "encoder_hidden_states_2": randn(1, byt5_tokens, cfg.text_embed_2_dim),
        "encoder_attention_mask_2": ones(byt5_tokens),
        "image_embeds": torch.zeros(1, image_tokens, cfg.image_embed_dim, device=device, dtype=dtype),
    }


HUNYUANVIDEO15 = Family(
    name="hunyuanvideo15",
    description="HunyuanVideo 1.5 text/image-to-video (HunyuanVideo15Transformer3DModel)",
    models=(f"{_M}.HunyuanVideo15Transformer3DModel",),
    block_lists=(
        BlockList("context_embedder.token_refiner.refiner_blocks", carry=Carry({"hidden_states": None})),
        BlockList(
            "transformer_blocks", carry=Carry({"hidden_states": 0, "encoder_hidden_states": 1})
        ),
    ),
    block_classes=(
        BlockClass(f"{_M}.HunyuanVideo15IndividualTokenRefinerBlock", ffn=(("norm2", "ff"),), attention=("attn",)),
        BlockClass(f"{_M}.HunyuanVideo15TransformerBlock", ffn=(("ff",), ("ff_context",)), attention=("attn",)),
    ),
    presets={
        "8.3b-480p": Preset(
            "HunyuanVideo 1.5 8.3B (54 blocks, 16 x 128 heads; 2 refiner blocks) at 480x848, 121 frames "
            "(31 x 30 x 53 = 49290 video tokens; 1000 + 256 + 729 text/vision tokens)",
            config={},  # the class defaults are the published 480p / 720p transformer
            inputs={"frames": 121, "height": 480, "width": 848},
            make_inputs=make_inputs,
        ),
        "8.3b-720p": Preset(
            "HunyuanVideo 1.5 8.3B (54 blocks, 16 x 128 heads; 2 refiner blocks) at 720x1280, 121 frames "
            "(31 x 45 x 80 = 111600 video tokens; 1000 + 256 + 729 text/vision tokens)",
            config={},
            inputs={"frames": 121, "height": 720, "width": 1280},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(HUNYUANVIDEO15)
