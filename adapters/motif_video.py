"""Motif-Video 2B text- and image-to-video (diffusers' ``MotifVideoTransformer3DModel``).

A three-stage trunk: dual-stream blocks for early fusion, single-stream encoder blocks, then a
DDT-style decoder made of the last ``num_decoder_layers`` single-stream blocks. Two block lists, in
the order the model runs them:

- **Dual-stream blocks** (``transformer_blocks``, ``MotifVideoTransformerBlock``): video and text
  streams meeting in the joint attention ``attn``, returning ``(hidden_states,
  encoder_hidden_states)``. The loop calls every block positionally as ``block(hidden_states,
  encoder_hidden_states, temb, attention_mask, image_rotary_emb, image_embed_seq_len)``: the timestep
  embedding, the boolean key mask (the prompt mask padded with ``True`` over the video tokens, made
  once), the RoPE ``(cos, sin)`` tuple (made once by ``rope``) and the number of SigLIP image tokens in
  front of the text (a plain int) are the same for every block, and nothing is added between blocks.
  So a chunk carries the two streams: ``Carry({"hidden_states": 0, "encoder_hidden_states": 1})``.
- **Single-stream blocks** (``single_transformer_blocks``, ``MotifVideoSingleTransformerBlock``): the
  block joins the two streams itself and splits them again on return, so the same call, the same
  return and the same carry. The last ``num_decoder_layers`` blocks of the list are the decoder, run
  by a second loop after the encoder blocks: ``block(decoder_hidden_states, encoder_hidden_states,
  temb, None, image_rotary_emb)``, where the stream is a clone of the embedded latents made before the
  dual blocks, the "encoder" stream is the encoder's video output, the mask is ``None`` and
  ``image_embed_seq_len`` takes its default. Inside the decoder the carry holds as in the encoder
  (each decoder block's two outputs are what the next one gets, the other arguments are shared). A
  chunk that starts in the encoder and ends in the decoder cannot run whole: the first decoder block
  gets the clone, not its predecessor's output, so it is served by no chunk and computes alone (a
  counted fall-back, exact; its later members were run ahead in vain). With the released 16 + 8 split
  every interval dividing 16 (2, 4, 8, 16) keeps the boundary between chunks, so no chunk falls back.

FFN seams. Dual blocks: ``ff`` and ``ff_context`` (tanh-GELU ``FeedForward``, 4·d wide), each called
on exactly its stream's ``norm2`` output scaled and shifted, a fresh tensor; the output is only gated
and added to the residual, outside. ``norm2`` cannot join (its output is modulated before ``ff``
sees it). Single blocks, encoder and decoder alike: as in Flux the MLP has no module of its own;
``act_mlp(proj_mlp(norm_hidden_states))`` runs beside attention on the shared modulated norm and
meets it only in ``proj_out``'s concatenated input, so ``proj_mlp → act_mlp`` is a strict chain and
the seam (it drops the 4·d-wide pre-activation); ``proj_out``'s input stays kept, since cutting there
would recompute attention.

Attention side: ``attn`` (projections, QK RMS norms, RoPE on the video tokens and one SDPA call, in
``MotifVideoAttnProcessor2_0``) and ``cross_attn``, the text cross-attention ("Shared
Cross-Attention") that ``enable_text_cross_attention_dual`` / ``_single`` add: video queries made from
``attn``'s video output, keys and values from the normed text stream (the SigLIP tokens sliced off),
one SDPA call with the prompt part of the mask, added back as a residual. ``cross_attn`` is ``None``
when the flag is off and always in decoder blocks (the model builds them without it), so it is
declared optional.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker, video_latent_size

_M = "diffusers.models.transformers.transformer_motif_video"

# T5Gemma 2 encoder states: the pipelines pad every prompt to 512 tokens (max_sequence_length).
TEXT_TOKENS = 512
# Image-to-video: the pipeline hands the transformer the unpooled ``last_hidden_state`` of the T5Gemma 2
# encoder's SigLIP vision tower for the first frame. Gemma 3's tower (1152 wide, which ``image_embed_dim``
# matches) sees 896 x 896 pixels in patches of 14: 64 x 64 = 4096 tokens in front of the prompt. Derived
# from the encoder's design, not read from the checkpoint's preprocessor config.
IMAGE_TOKENS = 4096


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, frames: int = 121, height: int = 736,
    width: int = 1280, text_tokens: int = TEXT_TOKENS, prompt_tokens: int | None = None, image_tokens: int = 0,
) -> dict:
    """One real-size batch as ``MotifVideoPipeline`` / ``MotifVideoImage2VideoPipeline`` feed the
    transformer: the latents, the first-frame condition latents and the condition mask concatenated on
    the channels, ``(1, 2·16 + 1, (frames-1)/4+1, H/8, W/8)`` (grad; the Wan VAE's 8x spatial, 4x temporal
    compression), the T5Gemma 2 prompt states ``(1, text_tokens, text_embed_dim)`` with the tokenizer's
    mask (``prompt_tokens`` valid, right-padded; all by default), the timestep (500) and, with
    ``image_tokens``, the SigLIP states of the first frame ``(1, image_tokens, image_embed_dim)``.

    ``tokens`` overrides the video token count by changing the number of latent frames.
    """
    import torch

    cfg = model.config
    patch = (cfg.patch_size_t, cfg.patch_size, cfg.patch_size)
    latent_frames, h, w = video_latent_size(frames, height, width, patch=patch, tokens=tokens)
    randn = tensor_maker(device, dtype)
    mask = torch.zeros(1, text_tokens, device=device, dtype=torch.int64)
    mask[:, : text_tokens if prompt_tokens is None else prompt_tokens] = 1
    inputs = {
        "hidden_states": randn(1, cfg.in_channels, latent_frames, h, w, grad=True),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, text_tokens, cfg.text_embed_dim),
        "encoder_attention_mask": mask,
    }
    if image_tokens:
        inputs["image_embeds"] = randn(1, image_tokens, cfg.image_embed_dim)
    return inputs


# Motif-Technologies/Motif-Video-2B transformer config: 12 dual-stream blocks, 24 single-stream blocks of
# which the last 8 are the DDT decoder, 12 x 128 heads (1536 wide, MLP 6144), T5Gemma 2 states 2560 wide,
# SigLIP states 1152 wide, latents + condition latents + mask = 33 channels, patches 1 x 2 x 2, RoPE axes
# 16 + 56 + 56. Text cross-attention is on in the 16 single-stream encoder blocks (2.04B parameters; with it
# off the trunk has 1.89B): the model card's "Shared Cross-Attention". The checkpoint's two
# ``enable_text_cross_attention_*`` flags could not be read here, so that choice is the one assumption.
MOTIF_VIDEO_2B = {
    "in_channels": 33, "out_channels": 16, "num_attention_heads": 12, "attention_head_dim": 128,
    "num_layers": 12, "num_single_layers": 24, "num_decoder_layers": 8, "mlp_ratio": 4.0, "patch_size": 2,
    "patch_size_t": 1, "qk_norm": "rms_norm", "norm_type": "layer_norm", "text_embed_dim": 2560,
    "image_embed_dim": 1152, "rope_axes_dim": (16, 56, 56), "enable_text_cross_attention_dual": False,
    "enable_text_cross_attention_single": True,
}
TRUNK = "Motif-Video 2B (12 dual + 16 single + 8 decoder blocks, 12 x 128 heads)"

_STREAMS = Carry({"hidden_states": 0, "encoder_hidden_states": 1})  # both lists return (video, text)

MOTIF_VIDEO = Family(
    name="motif-video",
    description="Motif-Video 2B text/image-to-video (MotifVideoTransformer3DModel)",
    models=(f"{_M}.MotifVideoTransformer3DModel",),
    block_lists=(
        BlockList("transformer_blocks", carry=_STREAMS),
        BlockList("single_transformer_blocks", carry=_STREAMS),
    ),
    block_classes=(
        BlockClass(
            f"{_M}.MotifVideoTransformerBlock", ffn=(("ff",), ("ff_context",)), attention=("attn", "cross_attn"),
            optional=("cross_attn",),
        ),
        BlockClass(
            f"{_M}.MotifVideoSingleTransformerBlock", ffn=(("proj_mlp", "act_mlp"),),
            attention=("attn", "cross_attn"), optional=("cross_attn",),
        ),
    ),
    presets={
        "2b-720p": Preset(
            f"{TRUNK}, text-to-video at 736x1280, 121 frames (the pipeline's default: 31 x 46 x 80 = 114080 "
            "video + 512 text tokens)",
            config=MOTIF_VIDEO_2B,
            inputs={"frames": 121, "height": 736, "width": 1280},
            make_inputs=make_inputs,
        ),
        "2b-i2v-720p": Preset(
            f"{TRUNK}, image-to-video at 736x1280, 121 frames (114080 video tokens; 4096 SigLIP image + 512 "
            "text tokens)",
            config=MOTIF_VIDEO_2B,
            inputs={"frames": 121, "height": 736, "width": 1280, "image_tokens": IMAGE_TOKENS},
            make_inputs=make_inputs,
        ),
        "2b-480p": Preset(
            f"{TRUNK}, text-to-video at 480x832, 121 frames (31 x 30 x 52 = 48360 video + 512 text tokens)",
            config=MOTIF_VIDEO_2B,
            inputs={"frames": 121, "height": 480, "width": 832},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(MOTIF_VIDEO)
