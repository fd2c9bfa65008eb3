"""Rhymes AI's Allegro text-to-video (diffusers' ``AllegroTransformer3DModel``, the 2.8B VideoDiT of
Allegro, Allegro-T2V-40x720P and Allegro-T2V-40x360P; the three checkpoints share one trunk).

One list, ``transformer_blocks``, of ``AllegroTransformerBlock`` s, a PixArt-style block on a 3-D
patch sequence: modulated self-attention ``attn1`` (the 3-D RoPE), unmodulated cross-attention
``attn2`` to the projected T5 states, then ``ff`` (diffusers' ``FeedForward``, tanh-GELU, 4·d wide).
Each block returns the new hidden states alone.

Carry. The loop calls every block by keyword with ``hidden_states``, ``encoder_hidden_states`` (the
caption projection's output, made once before the loop), ``temb`` (the ``adaln_single`` output
``(B, 6·D)``, made once), ``attention_mask`` and ``encoder_attention_mask`` (turned into additive
biases once, before the loop, when given as masks) and ``image_rotary_emb`` (the caller's own
object: the pipeline precomputes the RoPE tables and token positions and passes them to the model).
All of them are the same objects for every block, and nothing is added between blocks: a chunk
carries ``hidden_states`` only, ``Carry({"hidden_states": None})``. Under its own checkpointing flag
(which gradseam switches off while patched) the loop passes the same values positionally, in the
order of the block's parameters.

FFN seam: ``ff``. The block computes ``h + gate_mlp * ff(norm2(h) * (1 + scale_mlp) + shift_mlp)``:
``ff`` is called on that fresh modulated tensor, which nothing else uses, and its return value only
reaches the gate and the residual, outside it. Checkpointing ``ff`` alone is exact and drops its
4·d-wide projection and GELU output. ``norm2`` cannot join, since its output is scaled and shifted
before ``ff`` sees it. (``norm3`` is built in every block but never called; it holds no parameters
with the released config, ``norm_elementwise_affine=False``, and no declaration names it.)

Attention side: ``attn1`` and ``attn2``. Both run ``AllegroAttnProcessor2_0``: the projections,
the RoPE (``attn1`` only) and one SDPA call, all inside the processor. ``attn2`` exists in every
block (the class always builds it; the block's ``if self.attn2 is not None`` never skips it).
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker, video_latent_size

_M = "diffusers.models.transformers.transformer_allegro"

# The pipeline pads every T5-XXL prompt to 512 tokens (``max_sequence_length``).
TEXT_TOKENS = 512


def rotary_emb(config: Any, latent_frames: int, height: int, width: int, device: Any) -> tuple:
    """The RoPE argument as ``AllegroPipeline`` builds it for a latent video of ``latent_frames`` x
    ``height`` x ``width`` (latent pixels): the ``(cos, sin)`` tables of the frame, row and column axes
    (float32, a third of a head each, positions divided by the config's interpolation scales) and the
    three ``(1, tokens)`` integer position rows of the patches in frame-row-column order."""
    import torch
    from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro

    rows, cols = height // config.patch_size, width // config.patch_size
    *tables, grid_t, grid_h, grid_w = get_3d_rotary_pos_embed_allegro(
        embed_dim=config.attention_head_dim,
        crops_coords=((0, 0), (rows, cols)),
        grid_size=(rows, cols),
        temporal_size=latent_frames,
        interpolation_scale=(config.interpolation_scale_t, config.interpolation_scale_h,
                             config.interpolation_scale_w),
        device=device,
    )
    axes = [grid.to(dtype=torch.long) for grid in (grid_t, grid_h, grid_w)]
    positions = torch.cartesian_prod(*axes).T.reshape(3, 1, -1).contiguous()
    return tuple(tables), tuple(positions)


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, frames: int = 88, height: int = 720,
    width: int = 1280, text_tokens: int = TEXT_TOKENS, prompt_tokens: int | None = None,
) -> dict:
    """One real-size batch as ``AllegroPipeline`` feeds the transformer: the 4-channel latent video
    ``(1, 4, F, H/8, W/8)`` (grad; 8x spatial compression, ``F = ceil(frames / 4)`` for the even frame
    counts Allegro generates), the T5-XXL states ``(1, text_tokens, 4096)`` with the tokenizer's mask
    (``prompt_tokens`` valid tokens, right-padded; all valid by default), the timestep (500) and the
    RoPE tables and positions.

    ``tokens`` overrides the video token count by changing the number of latent frames.
    """
    import torch

    cfg = model.config
    patch = (cfg.patch_size_t, cfg.patch_size, cfg.patch_size)
    latent_frames, h, w = video_latent_size(frames, height, width, patch=patch, tokens=tokens)
    randn = tensor_maker(device, dtype)
    mask = torch.zeros(1, text_tokens, device=device, dtype=torch.int64)
    mask[:, : text_tokens if prompt_tokens is None else prompt_tokens] = 1
    return {
        "hidden_states": randn(1, cfg.in_channels, latent_frames, h, w, grad=True),
        "encoder_hidden_states": randn(1, text_tokens, cfg.caption_channels),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "encoder_attention_mask": mask,
        "image_rotary_emb": rotary_emb(cfg, latent_frames, h, w, device),
    }


# rhymes-ai/Allegro transformer/config.json, which diffusers' class defaults reproduce, spelled out so
# that a change of default upstream does not move the presets: 32 blocks of 24 x 96 heads (2304 wide),
# FFN 9216, T5-XXL states 4096 wide, 4 latent channels in patches of 1 x 2 x 2; 2.77B parameters.
# The 40-frame checkpoints are the same trunk (2.8B, per their model cards).
ALLEGRO_2_8B = {
    "patch_size": 2, "patch_size_t": 1, "num_attention_heads": 24, "attention_head_dim": 96, "in_channels": 4,
    "out_channels": 4, "num_layers": 32, "dropout": 0.0, "cross_attention_dim": 2304, "attention_bias": True,
    "sample_height": 90, "sample_width": 160, "sample_frames": 22, "activation_fn": "gelu-approximate",
    "norm_elementwise_affine": False, "norm_eps": 1e-6, "caption_channels": 4096,
    "interpolation_scale_h": 2.0, "interpolation_scale_w": 2.0, "interpolation_scale_t": 2.2,
}
TRUNK = "Allegro 2.8B (32 blocks, 24 x 96 heads, FFN 9216)"

ALLEGRO = Family(
    name="allegro",
    description="Rhymes AI Allegro text-to-video (AllegroTransformer3DModel)",
    models=(f"{_M}.AllegroTransformer3DModel",),
    block_lists=(BlockList("transformer_blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(BlockClass(f"{_M}.AllegroTransformerBlock", ffn=(("ff",),), attention=("attn1", "attn2")),),
    presets={
        "2.8b-88x720p": Preset(
            f"{TRUNK} at 720x1280, 88 frames (6 s at 15 fps, the pipeline's default: "
            "22 x 45 x 80 = 79200 video tokens, 512 text tokens)",
            config=ALLEGRO_2_8B,
            inputs={"frames": 88, "height": 720, "width": 1280},
            make_inputs=make_inputs,
        ),
        "2.8b-40x720p": Preset(
            f"{TRUNK} at 720x1280, 40 frames (Allegro-T2V-40x720P: 10 x 45 x 80 = 36000 video tokens, "
            "512 text tokens)",
            config=ALLEGRO_2_8B,
            inputs={"frames": 40, "height": 720, "width": 1280},
            make_inputs=make_inputs,
        ),
        "2.8b-40x360p": Preset(
            f"{TRUNK} at 368x640, 40 frames (Allegro-T2V-40x360P: 10 x 23 x 40 = 9200 video tokens, "
            "512 text tokens)",
            config=ALLEGRO_2_8B,
            inputs={"frames": 40, "height": 368, "width": 640},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(ALLEGRO)
