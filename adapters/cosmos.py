"""NVIDIA Cosmos Predict world models (CosmosTransformer3DModel: Cosmos 1.0 Diffusion, Cosmos Predict 2
and 2.5, the base transformer of Cosmos Transfer 2.5), and Anima, a Cosmos Predict 2 2B Text2Image core
behind its own text conditioner.

One block list, ``transformer_blocks``, all ``CosmosTransformerBlock``: adaLN-zero self-attention
``attn1`` (with the video RoPE), cross-attention ``attn2`` to the text (and, in Transfer 2.5, an
image context through the same module), then the MLP ``ff``; a block returns the new hidden states.
The loop calls every block positionally as ``block(hidden_states, encoder_hidden_states,
embedded_timestep, temb, image_rotary_emb, extra_pos_emb, attention_mask, controlnet_residual)``.
The text context (a tensor, or one ``(text, image)`` tuple), both timestep embeddings (per token
when the timestep is given per frame), the RoPE ``(cos, sin)``, the learnable positional embedding
(added inside each block) and the text mask are built once before the loop and are the same objects
for every block, so the list carries ``{"hidden_states": None}`` and interval chunks run whole.

The exception is ControlNet conditioning (Cosmos Transfer): the loop hands block ``i`` its own
``controlnet_residual`` (every ``controlnet_block_every_n``-th block gets one, the others ``None``),
which the block adds to its output. A chunk whose blocks get different residuals cannot run ahead
with the first block's arguments; its later blocks notice the different argument and compute on
their own, so results stay exact and only those chunks fall back (the kit's ControlNet case checks
this). Chunks whose blocks all get ``None`` still run whole.

FFN seam ``("ff",)``: the MLP branch is ``h + gate * ff(norm)``, where ``norm3`` returns the
modulated norm *and* the gate as a tuple, so ``norm3`` cannot join the seam; ``ff`` (diffusers'
``FeedForward``: GELU projection to ``mlp_ratio·d``, output projection) is called on exactly the
first element, gate and residual outside. Recomputing it drops the wide projection and its GELU.

Attention side: ``attn1`` and ``attn2`` (projections, QK RMSNorms, RoPE, the image-context branch of
Transfer 2.5's ``CosmosAttention``, and the attention calls all live in those modules).

The model's default ``concat_padding_mask=True`` resizes ``padding_mask`` with torchvision before the
blocks; that, ``condition_mask`` and ``fps`` only change the input of ``patch_embed`` and the RoPE.

Anima runs the class as an image model: one latent frame, no condition channel, one timestep per sample,
no ``fps`` (the RoPE's image branch), and as text context the output of ``AnimaTextConditioner`` (an LLM
adapter from Qwen3 states and T5 token ids, zero-padded to 512 tokens), one tensor for every block like
any other. Nothing in the loop differs, so this declaration covers it unchanged; the conditioner is a
separate model with its own family (``anima-text-conditioner``, :mod:`gradseam.adapters.anima`).
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import square_side, tensor_maker, video_latent_size

_M = "diffusers.models.transformers.transformer_cosmos"


def make_inputs(
    model, device, dtype, tokens=None, *, frames=93, height=704, width=1280, text_tokens=512, fps=16, temporal=4,
) -> dict:
    """One real-size batch as the Cosmos pipelines build it: the latent video ``(1, C, (frames-1)/temporal+1,
    H/8, W/8)`` (grad), T5 states of ``text_tokens`` tokens (Cosmos-Reason1's concatenated layer states when
    the model projects them, as Predict 2.5 does), ``fps`` and the all-zero ``padding_mask``. A model with a
    condition channel (Video2World, Predict 2.5) also gets the ``condition_mask`` (the first latent frame is
    the conditioning frame) and a timestep per latent frame ``(1, 1, T, 1, 1)``, that frame's near zero.
    ``tokens`` overrides the video token count by changing the number of latent frames."""
    import torch

    cfg = model.config
    latent = cfg.out_channels
    t, h, w = video_latent_size(frames, height, width, patch=tuple(cfg.patch_size), tokens=tokens,
                                temporal=temporal)
    randn = tensor_maker(device, dtype)
    text_dim = cfg.crossattn_proj_in_channels if cfg.use_crossattn_projection else cfg.text_embed_dim
    inputs = {
        "hidden_states": randn(1, latent, t, h, w, grad=True),
        "encoder_hidden_states": randn(1, text_tokens, text_dim),
        "fps": fps,
        "padding_mask": torch.zeros(1, 1, h * 8, w * 8, device=device, dtype=dtype),
    }
    if cfg.in_channels > latent:
        mask = torch.zeros(1, cfg.in_channels - latent, t, h, w, device=device, dtype=dtype)
        mask[:, :, :1] = 1.0
        timestep = torch.full((1, 1, t, 1, 1), 0.5, device=device, dtype=dtype)
        timestep[:, :, :1] = 0.0001
        inputs.update(condition_mask=mask, timestep=timestep)
    else:
        inputs["timestep"] = torch.full((1,), 0.5, device=device, dtype=dtype)
    return inputs


def make_image_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, height: int = 1024, width: int = 1024,
    text_tokens: int = 512, spatial: int = 8,
) -> dict:
    """One real-size batch as Anima's pipeline builds it: the latent image ``(1, C, 1, H/8, W/8)`` (grad;
    one frame of the Qwen-Image VAE), one timestep per sample (the sigma, ``t / 1000``), the text
    conditioner's output of ``text_tokens`` tokens (it pads to 512) and the all-zero ``padding_mask``;
    no ``fps``, as the pipeline passes none. ``tokens`` overrides the image token count (a square latent
    grid of about that many patches)."""
    import torch

    cfg = model.config
    _, ph, pw = cfg.patch_size
    h, w = height // spatial, width // spatial
    if tokens:
        h, w = square_side(tokens) * ph, square_side(tokens) * pw
    randn = tensor_maker(device, dtype)
    return {
        "hidden_states": randn(1, cfg.in_channels, 1, h, w, grad=True),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, text_tokens, cfg.text_embed_dim),
        "padding_mask": torch.zeros(1, 1, h * spatial, w * spatial, device=device, dtype=dtype),
    }


_V2W = {"frames": 93, "height": 704, "width": 1280, "text_tokens": 512, "fps": 16, "temporal": 4}
_PREDICT2_2B = {
    "in_channels": 17, "num_attention_heads": 16, "num_layers": 28, "rope_scale": (1.0, 3.0, 3.0),
    "extra_pos_embed_type": None,
}

COSMOS = Family(
    name="cosmos",
    description="NVIDIA Cosmos 1.0 Diffusion / Predict 2 / Predict 2.5, Anima (CosmosTransformer3DModel)",
    models=(f"{_M}.CosmosTransformer3DModel",),
    block_lists=(BlockList("transformer_blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(BlockClass(f"{_M}.CosmosTransformerBlock", ffn=(("ff",),), attention=("attn1", "attn2")),),
    presets={
        "predict2-2b-720p": Preset(
            "Cosmos Predict 2 2B Video2World (28 blocks, 16 x 128 heads, MLP 8192; diffusers' conversion config) "
            "at 704x1280, 93 frames (Wan VAE: 24 x 44 x 80 = 84480 video tokens), 512 T5 tokens",
            config=_PREDICT2_2B,
            inputs=_V2W,
            make_inputs=make_inputs,
        ),
        "predict2-14b-720p": Preset(
            "Cosmos Predict 2 14B Video2World (36 blocks, 40 x 128 heads, MLP 20480; diffusers' conversion "
            "config) at 704x1280, 93 frames (84480 video tokens), 512 T5 tokens",
            config={**_PREDICT2_2B, "num_attention_heads": 40, "num_layers": 36, "rope_scale": (20 / 24, 2.0, 2.0)},
            inputs=_V2W,
            make_inputs=make_inputs,
        ),
        "predict2.5-2b-720p": Preset(
            "Cosmos Predict 2.5 2B (as Predict 2 2B, plus the projection of Cosmos-Reason1's 28 x 3584 = 100352 "
            "concatenated layer states to 1024; diffusers' conversion config) at 704x1280, 93 frames (84480 "
            "video tokens), 512 text tokens",
            config={**_PREDICT2_2B, "use_crossattn_projection": True, "crossattn_proj_in_channels": 100352,
                    "encoder_hidden_states_channels": 1024},
            inputs=_V2W,
            make_inputs=make_inputs,
        ),
        "anima-1024": Preset(
            "Anima (Cosmos Predict 2 2B Text2Image: 28 blocks, 16 x 128 heads, MLP 8192, 16 input channels, "
            "RoPE scale (1, 4, 4); diffusers' Cosmos conversion config, which its Anima conversion uses) at "
            "1024x1024 (Qwen-Image VAE: 64 x 64 = 4096 image tokens), 512 text tokens (AnimaTextConditioner's "
            "output, padded to 512)",
            config={**_PREDICT2_2B, "in_channels": 16, "rope_scale": (1.0, 4.0, 4.0)},
            inputs={"height": 1024, "width": 1024, "text_tokens": 512},
            make_inputs=make_image_inputs,
        ),
        "1.0-7b-720p": Preset(
            "Cosmos 1.0 Diffusion 7B Text2World (28 blocks, 32 x 128 heads, MLP 16384, learnable positional "
            "embedding; the class defaults) at 704x1280, 121 frames (Cosmos tokenizer CV8x8x8: 16 x 44 x 80 = "
            "56320 video tokens), 512 T5 tokens",
            config={},
            inputs={"frames": 121, "height": 704, "width": 1280, "text_tokens": 512, "fps": 30, "temporal": 8},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(COSMOS)
