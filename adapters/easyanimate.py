"""EasyAnimate V5 / V5.1 (Alibaba PAI): diffusers' ``EasyAnimateTransformer3DModel``.

One block list, ``transformer_blocks``, all ``EasyAnimateTransformerBlock``: an expert-adaLN block in
which the text and the video tokens are two streams of one sequence. ``norm1`` (``EasyAnimateLayerNormZero``)
LayerNorms both streams with one norm and modulates each with its own shift and scale from ``temb`` (it
also returns the two gates); ``attn1`` attends over ``[text, video]`` (the 3-D RoPE only touches the video
queries and keys); ``norm2`` modulates again, each stream goes through its FFN, is gated and added. The
block returns ``(hidden_states, encoder_hidden_states)``.

The class builds two kinds of block from one class: the first ``mmdit_layers`` blocks are MMDiT blocks
(``attn1`` has separate text projections ``add_q/k/v_proj`` and ``to_add_out``, and the text stream has
its own FFN ``txt_ff``); the blocks after them (the 7B's last 18 of 36) are built with
``is_mmdit_block=False``: ``txt_ff`` is ``None`` and ``attn1`` projects the concatenated sequence with
one set of weights, and the block runs the video FFN ``ff`` on the text stream too.

The model builds ``temb`` (timestep embedding), the RoPE ``(cos, sin)`` tuple (from the latent's shape)
and the projected text (Qwen2-VL states, plus V5's T5 states when given) once before the loop, and calls
every block positionally with those same objects; nothing happens between blocks. So a chunk carries the
two streams and nothing else: ``Carry({"hidden_states": 0, "encoder_hidden_states": 1})``. (diffusers'
own ``gradient_checkpointing`` flag calls the same blocks with the same arguments; gradseam switches it
off while patched.)

FFN seams ``("ff",)`` and ``("txt_ff",)``, the latter optional: every ``FeedForward`` call (tanh-GELU,
4·d wide) gets one fresh tensor, its stream's ``norm2`` output, scaled and shifted, and its return value
is only gated and added to the residual (with ``after_norm``, first passed through ``norm3``, outside the
region). So each call is a region that sees exactly what the block hands it, and recomputing drops the
4·d-wide activations of every token of both streams. In MMDiT blocks that is two regions, ``ff`` on the
video and ``txt_ff`` on the text; in the later blocks ``txt_ff`` is absent (declared optional, so those
blocks have one seam fewer and the family keeps the ``-ffn`` backends) and ``ff`` is called twice, each
call its own region, the two sharing weights whose gradients autograd sums as it does unpatched.
``norm2`` cannot join: it returns four tensors (two modulated streams, two gates). ``norm3`` (built only
with ``after_norm=True``, which no published checkpoint sets) cannot join either: one ``norm3`` follows
both FFN calls, and a module belongs to one seam at most. The dropouts inside the FFNs are built with
the model's ``dropout`` (0.0 in every published config), which draws no random numbers.

Attention side: ``attn1``, the one attention module (``EasyAnimateAttnProcessor2_0``: the QKV
projections, the QK LayerNorms, the RoPE, the SDPA call and the output projections all run inside it).
The model takes no text mask: the pipelines pad the prompt to 256 tokens and every block attends to all
of them.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker, video_latent_size

_M = "diffusers.models.transformers.transformer_easyanimate"

# The pipelines (and EasyAnimate's training scripts) pad the Qwen2-VL prompt to 256 tokens.
TEXT_TOKENS = 256
CONDITIONS = ("inpaint", "control")
# The pipelines scale the inpaint mask, 1 on the frames given, by the MagVIT VAE's scaling factor.
MAGVIT_SCALING = 0.7125


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, frames: int = 49, height: int = 512,
    width: int = 512, text_tokens: int = TEXT_TOKENS, condition: str | None = None,
) -> dict:
    """One real-size batch as the EasyAnimate pipelines (and the repository's training scripts) feed the
    transformer: the 16-channel MagVIT latent video ``(1, 16, (frames-1)/4+1, H/8, W/8)`` (grad; 8x spatial,
    4x temporal), Qwen2-VL states ``(1, text_tokens, text_embed_dim)`` and a float timestep (500).

    A model with more input channels than output channels takes its conditioning latents through
    ``condition``: ``"inpaint"`` (InP, image-to-video: a one-channel mask, the MagVIT scaling factor on the
    given first frame and 0 on the frames to generate, then the masked video's latents; 17 channels) or
    ``"control"`` (Control: the control video latents, then the reference image latents in the first frame
    and zeros after it; 32 channels). ``tokens`` overrides the video token count by changing the number of
    latent frames."""
    import torch

    cfg = model.config
    p = cfg.patch_size
    t, h, w = video_latent_size(frames, height, width, patch=(1, p, p), tokens=tokens)
    h, w = h // p * p, w // p * p
    channels = cfg.out_channels
    extra = cfg.in_channels - channels
    if condition not in (None, *CONDITIONS):
        raise ValueError(f"make_inputs: condition must be one of {CONDITIONS} or None, got {condition!r}.")
    if (condition is None) != (extra == 0):
        raise ValueError(
            f"make_inputs: the model takes {cfg.in_channels} input channels ({extra} besides the "
            f"{channels} latent ones), so condition={condition!r} does not fit; pass condition='inpaint' "
            "(InP: 1 + latent channels) or 'control' (Control: 2 x latent channels) for a conditioned "
            "model, None for text-to-video."
        )
    randn = tensor_maker(device, dtype)
    inputs = {
        "hidden_states": randn(1, channels, t, h, w, grad=True),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, text_tokens, cfg.text_embed_dim),
    }
    if condition == "inpaint":
        mask = torch.zeros(1, 1, t, h, w, device=device, dtype=dtype)
        mask[:, :, 0] = MAGVIT_SCALING
        inputs["inpaint_latents"] = torch.cat([mask, randn(1, extra - 1, t, h, w)], dim=1)
    elif condition == "control":
        reference = torch.zeros(1, extra // 2, t, h, w, device=device, dtype=dtype)
        reference[:, :, :1] = randn(1, extra // 2, 1, h, w)
        inputs["control_latents"] = torch.cat([randn(1, extra - extra // 2, t, h, w), reference], dim=1)
    return inputs


# EasyAnimate V5.1, every constructor argument. The 7B is alibaba-pai/EasyAnimateV5.1-7b-zh-Control's
# published transformer config (36 blocks, the first 18 MMDiT; the keys the diffusers class takes). The
# 12B is diffusers' class defaults (48 blocks, all MMDiT: 11.8B parameters, as its 23.6 GB 16-bit weights
# file holds), with the V5.1 text projection (RMSNorm, then Linear) the 7B config sets.
V51_12B: dict[str, Any] = {
    "num_attention_heads": 48, "attention_head_dim": 64, "in_channels": 16, "out_channels": 16, "patch_size": 2,
    "sample_width": 90, "sample_height": 60, "activation_fn": "gelu-approximate", "timestep_activation_fn": "silu",
    "freq_shift": 0, "num_layers": 48, "mmdit_layers": 48, "dropout": 0.0, "time_embed_dim": 512,
    "add_norm_text_encoder": True, "text_embed_dim": 3584, "text_embed_dim_t5": None, "norm_eps": 1e-5,
    "norm_elementwise_affine": True, "flip_sin_to_cos": True, "time_position_encoding_type": "3d_rope",
    "after_norm": False, "resize_inpaint_mask_directly": True, "enable_text_attention_mask": True,
    "add_noise_in_inpaint_model": True,
}
V51_7B: dict[str, Any] = {**V51_12B, "num_layers": 36, "mmdit_layers": 18}
_512 = {"frames": 49, "height": 512, "width": 512}
_TOKENS = "13 x 32 x 32 = 13312 video tokens, 256 text tokens"

EASYANIMATE = Family(
    name="easyanimate",
    description="EasyAnimate V5 / V5.1 text/image/control-to-video (EasyAnimateTransformer3DModel)",
    models=(f"{_M}.EasyAnimateTransformer3DModel",),
    block_lists=(
        BlockList("transformer_blocks", carry=Carry({"hidden_states": 0, "encoder_hidden_states": 1})),
    ),
    block_classes=(
        BlockClass(
            f"{_M}.EasyAnimateTransformerBlock",
            ffn=(("ff",), ("txt_ff",)),
            attention=("attn1",),
            optional=("txt_ff",),
        ),
    ),
    presets={
        "v5.1-12b-inp-512": Preset(
            "EasyAnimateV5.1-12b-zh-InP (48 MMDiT blocks, 48 x 64 heads, FFN 12288; 16 latent + 17 inpaint "
            f"channels) image-to-video at 512x512, 49 frames, the training script's default ({_TOKENS})",
            config={**V51_12B, "in_channels": 33},
            inputs={**_512, "condition": "inpaint"},
            make_inputs=make_inputs,
        ),
        "v5.1-12b-1024": Preset(
            "EasyAnimateV5.1-12b-zh (48 MMDiT blocks, 48 x 64 heads, FFN 12288) text-to-video at 1024x1024, "
            "49 frames (13 x 64 x 64 = 53248 video tokens, 256 text tokens)",
            config=V51_12B,
            inputs={"frames": 49, "height": 1024, "width": 1024},
            make_inputs=make_inputs,
        ),
        "v5.1-7b-control-512": Preset(
            "EasyAnimateV5.1-7b-zh-Control (36 blocks, the first 18 MMDiT; 16 latent + 32 control channels; "
            f"the published config) at 512x512, 49 frames ({_TOKENS})",
            config={**V51_7B, "in_channels": 48},
            inputs={**_512, "condition": "control"},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(EASYANIMATE)
