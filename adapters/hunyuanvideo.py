"""HunyuanVideo text/image-to-video (HunyuanVideoTransformer3DModel: T2V, and both I2V checkpoints).

Three block lists, in the order the model runs them:

- **Token refiner** (``context_embedder.token_refiner.refiner_blocks``,
  ``HunyuanVideoIndividualTokenRefinerBlock``): two plain pre-norm blocks over the LLaVA-Llama
  prompt states, inside the model's ``context_embedder``. Its loop is
  ``hidden_states = block(hidden_states, temb, self_attn_mask)``: the pooled-text timestep
  embedding and the square prompt mask are built once before the loop and are the same objects for
  every block, so ``Carry({"hidden_states": None})``. The MLP is ``ff(norm2(hidden_states))`` with
  the ``norm_out`` gate and the residual applied outside it and no modulation in between, so
  ``norm2 → ff`` is a strict chain and the seam (recomputing it also drops the normalised copy).
- **Dual-stream blocks** (``transformer_blocks``, ``HunyuanVideoTransformerBlock``, or
  ``HunyuanVideoTokenReplaceTransformerBlock`` with ``image_condition_type="token_replace"``): video
  and text streams meeting in one joint attention ``attn``; a block returns
  ``(hidden_states, encoder_hidden_states)``. The loop calls every block positionally as
  ``block(hidden_states, encoder_hidden_states, temb, attention_mask, image_rotary_emb,
  token_replace_emb, first_frame_num_tokens)``: the conditioning ``temb``, the padded-prompt mask,
  the RoPE table, the token-replace embedding (None unless token replace) and the first frame's token
  count are computed once before the loop and nothing is added between blocks, so a chunk carries
  only the two streams: ``Carry({"hidden_states": 0, "encoder_hidden_states": 1})``. (The plain
  blocks take the last two arguments through ``*args`` and ignore them.) Each stream ends in its own
  ``FeedForward`` (``ff``, ``ff_context``), called on exactly the modulated ``norm2`` /
  ``norm2_context`` output, gate and residual outside: one seam each. ``norm2`` cannot join (its
  output is scaled and shifted first, per stream and, with token replace, per first-frame token).
- **Single-stream blocks** (``single_transformer_blocks``, ``HunyuanVideoSingleTransformerBlock``
  or ``HunyuanVideoTokenReplaceSingleTransformerBlock``): the same call and the same
  ``(hidden_states, encoder_hidden_states)`` return (the block joins and splits the streams itself),
  so the same carry. As in Flux, the MLP has no module of its own: ``proj_mlp → act_mlp`` runs in
  parallel with attention on the shared modulated norm, and both meet in ``proj_out``. The seam is
  ``proj_mlp → act_mlp`` (it drops the ``4·d``-wide pre-activation); ``proj_out``'s input, the
  concatenation of both branches, is still kept, since cutting there would recompute attention.

Attention side: ``attn`` in every block class (projections, QK norms, RoPE and the SDPA call; the
single blocks' ``attn`` is ``pre_only``, its output projection being ``proj_out``).

I2V: ``latent_concat`` (HunyuanVideo-I2V, 33 input channels) only widens ``x_embedder``'s input;
``token_replace`` (the 16-channel I2V checkpoint) swaps in the token-replace block classes, whose
extra arguments are the same objects for every block, so chunks stay whole with either.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker, video_latent_size

_M = "diffusers.models.transformers.transformer_hunyuan_video"

# LLaVA-Llama-3 prompt states: 256 text tokens (the pipelines' max_sequence_length); the I2V pipeline
# puts the 576 LLaVA image tokens of the conditioning frame in front of them.
TEXT_TOKENS = 256
_I2V_TEXT_TOKENS = 576 + TEXT_TOKENS


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, frames: int = 129, height: int = 720,
    width: int = 1280, text_tokens: int = TEXT_TOKENS,
) -> dict:
    """One real-size batch: the VAE latent video ``(1, C, (frames-1)/4+1, H/8, W/8)`` (grad; ``C`` is 33
    for the ``latent_concat`` I2V model: latents, image latents and mask), the LLaVA-Llama prompt
    states with their mask, the CLIP pooled vector and, for guidance-distilled checkpoints, the
    pipeline's ``guidance`` (scale 6 x 1000).

    ``tokens`` overrides the video token count by changing the number of latent frames.
    """
    import torch

    cfg = model.config
    patch = (cfg.patch_size_t, cfg.patch_size, cfg.patch_size)
    latent_frames, h, w = video_latent_size(frames, height, width, patch=patch, tokens=tokens)
    randn = tensor_maker(device, dtype)
    inputs = {
        "hidden_states": randn(1, cfg.in_channels, latent_frames, h, w, grad=True),
        **prompt_inputs(cfg, randn, device, dtype, text_tokens),
    }
    if cfg.guidance_embeds:
        inputs["guidance"] = torch.full((1,), 6000.0, device=device, dtype=dtype)
    return inputs


def prompt_inputs(cfg: Any, randn: Any, device: Any, dtype: Any, text_tokens: int) -> dict:
    """The timestep (500) and the prompt side every HunyuanVideo-trunk pipeline feeds the model:
    LLaVA-Llama states ``(1, text_tokens, text_embed_dim)`` with their all-ones mask, and the CLIP
    pooled vector. ``randn`` is :func:`gradseam.inputs.tensor_maker`'s; FramePack builds its prompt
    the same way."""
    import torch

    return {
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, text_tokens, cfg.text_embed_dim),
        "encoder_attention_mask": torch.ones(1, text_tokens, device=device, dtype=torch.int64),
        "pooled_projections": randn(1, cfg.pooled_projection_dim),
    }


TRUNK = "13B (20 dual-stream + 40 single-stream blocks, 24 x 128 heads; 2 refiner blocks)"
_I2V = {"in_channels": 33, "guidance_embeds": False, "image_condition_type": "latent_concat"}
_I2V_16CH = {"guidance_embeds": True, "image_condition_type": "token_replace"}


_STREAMS = Carry({"hidden_states": 0, "encoder_hidden_states": 1})  # both stream lists return (video, text)

# The block lists, and the block classes of the plain (T2V and latent_concat I2V) model, are shared with
# FramePack (adapters/hunyuanvideo_framepack.py), whose model builds the same blocks.
BLOCK_LISTS = (
    BlockList("context_embedder.token_refiner.refiner_blocks", carry=Carry({"hidden_states": None})),
    BlockList("transformer_blocks", carry=_STREAMS),
    BlockList("single_transformer_blocks", carry=_STREAMS),
)
BLOCK_CLASSES = (
    BlockClass(f"{_M}.HunyuanVideoIndividualTokenRefinerBlock", ffn=(("norm2", "ff"),), attention=("attn",)),
    BlockClass(f"{_M}.HunyuanVideoTransformerBlock", ffn=(("ff",), ("ff_context",)), attention=("attn",)),
    BlockClass(f"{_M}.HunyuanVideoSingleTransformerBlock", ffn=(("proj_mlp", "act_mlp"),), attention=("attn",)),
)
TOKEN_REPLACE_BLOCK_CLASSES = (  # the 16-channel I2V checkpoint's (image_condition_type="token_replace")
    BlockClass(
        f"{_M}.HunyuanVideoTokenReplaceTransformerBlock", ffn=(("ff",), ("ff_context",)), attention=("attn",)
    ),
    BlockClass(
        f"{_M}.HunyuanVideoTokenReplaceSingleTransformerBlock", ffn=(("proj_mlp", "act_mlp"),),
        attention=("attn",),
    ),
)


HUNYUANVIDEO = Family(
    name="hunyuanvideo",
    description="HunyuanVideo text/image-to-video (HunyuanVideoTransformer3DModel)",
    models=(f"{_M}.HunyuanVideoTransformer3DModel",),
    block_lists=BLOCK_LISTS,
    block_classes=BLOCK_CLASSES + TOKEN_REPLACE_BLOCK_CLASSES,
    presets={
        "13b-720p": Preset(
            f"HunyuanVideo T2V {TRUNK} at 720x1280, 129 frames (33 x 45 x 80 = 118800 video + 256 text "
            "tokens); the class defaults are the released cfg-distilled T2V config",
            config={},
            inputs={"frames": 129, "height": 720, "width": 1280},
            make_inputs=make_inputs,
        ),
        "13b-540p": Preset(
            f"HunyuanVideo T2V {TRUNK} at 544x960, 129 frames (33 x 34 x 60 = 67320 video + 256 text tokens)",
            config={},
            inputs={"frames": 129, "height": 544, "width": 960},
            make_inputs=make_inputs,
        ),
        "i2v-720p": Preset(
            f"HunyuanVideo-I2V {TRUNK}, latent_concat (33 input channels, no guidance embedding) at 720x1280, "
            "129 frames (118800 video tokens; 576 LLaVA image + 256 text tokens)",
            config=_I2V,
            inputs={"frames": 129, "height": 720, "width": 1280, "text_tokens": _I2V_TEXT_TOKENS},
            make_inputs=make_inputs,
        ),
        "i2v-16ch-720p": Preset(
            f"HunyuanVideo-I2V 16-channel {TRUNK}, token_replace blocks, guidance-distilled, at 720x1280, "
            "129 frames (118800 video tokens; 576 LLaVA image + 256 text tokens)",
            config=_I2V_16CH,
            inputs={"frames": 129, "height": 720, "width": 1280, "text_tokens": _I2V_TEXT_TOKENS},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(HUNYUANVIDEO)
