"""Genmo Mochi 1 (diffusers' ``MochiTransformer3DModel``, the 10B AsymmDiT video model).

Every block of ``transformer_blocks`` is a ``MochiTransformerBlock``: a video stream (width
``24·128 = 3072``) and a narrower text stream (``pooled_projection_dim``, 1536) that meet only in
one joint attention ``attn1``, each stream with its own SwiGLU ``FeedForward`` (``ff``,
``ff_context``). The model calls each block by keyword with ``hidden_states``,
``encoder_hidden_states``, ``temb``, ``encoder_attention_mask`` and ``image_rotary_emb`` and gets
``(hidden_states, encoder_hidden_states)`` back. ``temb`` (timestep plus attention-pooled caption)
and the projected caption states are computed once by ``time_embed`` before the loop, the RoPE
``(cos, sin)`` tuple once by ``rope``, and the text mask is the model's own argument: the same
objects for every block, with nothing added between blocks. So a chunk carries the two streams and
nothing else: ``Carry({"hidden_states": 0, "encoder_hidden_states": 1})``.

The last block is built with ``context_pre_only=True``: its ``norm1_context`` is a scale-only
``MochiLayerNormContinuous``, its ``attn1`` has no ``to_add_out``, it has no ``norm3_context`` / ``ff_context``
(both ``None``), and it returns the text stream it was given, untouched. Nothing follows it, so that
return feeds nothing and chunks ending in it stay whole.

FFN seams: on the video stream the block computes
``hidden_states + norm4(ff(norm3(hidden_states, 1 + scale_mlp)), tanh(gate_mlp))``. ``norm3`` is a
``MochiModulatedRMSNorm`` that takes the modulation as its own second argument and applies it
inside (in float32), and ``ff`` is called on ``norm3``'s return value alone, which nothing else
uses; ``ff``'s return value goes only to ``norm4``. So ``norm3 → ff`` is a strict chain, and
checkpointing it as one region is exact. It drops the SwiGLU's wide activations (``2·8192``
projected, ``8192`` gated at full size) and ``norm3``'s float32 intermediates; only the seam's
inputs are kept (the residual stream in the model's dtype and the ``(B, 1, D)`` scale). ``norm4``
cannot join: it takes a second argument, the gate ``tanh(gate_mlp)``, made only after ``ff``
returns, and a later member of a seam must be called on the previous one's output alone.
``norm3_context → ff_context`` is the same cut on the text stream (``ff_context`` from 1536 to
``2·4096`` wide); the last block lacks both modules (``None``), so that seam is declared optional
and that one block has one seam fewer.

Attention side: ``attn1`` (``MochiAttention``: the video and text projections, QK RMS norms, RoPE
and the SDPA calls, all inside its processor). The text mask is not a bias: for each sample the
processor keeps only the valid prompt tokens (``nonzero`` on the mask), runs one SDPA over video +
valid text tokens and pads the result back, so a padded batch of two calls the kernel twice per
block, every call from inside ``attn1``. The caption pooler in ``time_embed`` runs its own SDPA
before the loop, outside every block and every region. That ``nonzero`` has a data-dependent
shape: the compiled backends break the graph there, inside every block, and gradseam warns; they
stay within the compiled tolerance.
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker, video_latent_size

_M = "diffusers.models.transformers.transformer_mochi"

# T5-XXL prompt states: the pipeline pads every prompt to 256 tokens (max_sequence_length).
TEXT_TOKENS = 256


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, frames: int = 163, height: int = 480,
    width: int = 848, text_tokens: int = TEXT_TOKENS, prompt_tokens: int | None = None,
) -> dict:
    """One real-size batch as the Mochi pipeline feeds the transformer: the 12-channel AsymmVAE latent
    video ``(1, 12, (frames-1)/6+1, H/8, W/8)`` (grad; 8x spatial, 6x temporal compression), the T5
    prompt states ``(1, text_tokens, 4096)`` with their boolean mask (``prompt_tokens`` valid tokens,
    right-padded; all valid by default) and the timestep (500).

    ``tokens`` overrides the video token count by changing the number of latent frames.
    """
    import torch

    cfg = model.config
    patch = (1, cfg.patch_size, cfg.patch_size)
    latent_frames, h, w = video_latent_size(
        frames, height, width, patch=patch, tokens=tokens, temporal=6, spatial=8
    )
    randn = tensor_maker(device, dtype)
    valid = text_tokens if prompt_tokens is None else prompt_tokens
    mask = torch.zeros(1, text_tokens, device=device, dtype=torch.bool)
    mask[:, :valid] = True
    return {
        "hidden_states": randn(1, cfg.in_channels, latent_frames, h, w, grad=True),
        "encoder_hidden_states": randn(1, text_tokens, cfg.text_embed_dim),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype),
        "encoder_attention_mask": mask,
    }


# genmo/mochi-1-preview transformer/config.json (the class defaults): 48 blocks, 24 x 128 heads,
# text stream 1536 wide, T5-XXL states 4096 wide, 256 prompt tokens.
MOCHI_1 = {
    "patch_size": 2, "num_attention_heads": 24, "attention_head_dim": 128, "num_layers": 48,
    "pooled_projection_dim": 1536, "in_channels": 12, "out_channels": None, "qk_norm": "rms_norm",
    "text_embed_dim": 4096, "time_embed_dim": 256, "activation_fn": "swiglu", "max_sequence_length": 256,
}
TRUNK = "Mochi 1 10B (48 blocks, 24 x 128 heads, text stream 1536)"

MOCHI = Family(
    name="mochi",
    description="Genmo Mochi 1 text-to-video (MochiTransformer3DModel)",
    models=(f"{_M}.MochiTransformer3DModel",),
    block_lists=(
        BlockList("transformer_blocks", carry=Carry({"hidden_states": 0, "encoder_hidden_states": 1})),
    ),
    block_classes=(
        BlockClass(
            f"{_M}.MochiTransformerBlock",
            ffn=(("norm3", "ff"), ("norm3_context", "ff_context")),
            attention=("attn1",),
            optional=("norm3_context", "ff_context"),
        ),
    ),
    presets={
        "10b-480p": Preset(
            f"{TRUNK} at 480x848, 163 frames (5.4 s at 30 fps, the longest the model generates: "
            "28 x 30 x 53 = 44520 video + 256 text tokens)",
            config=MOCHI_1,
            inputs={"frames": 163, "height": 480, "width": 848},
            make_inputs=make_inputs,
        ),
        "10b-480p-85f": Preset(
            f"{TRUNK} at 480x848, 85 frames (15 x 30 x 53 = 23850 video + 256 text tokens)",
            config=MOCHI_1,
            inputs={"frames": 85, "height": 480, "width": 848},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(MOCHI)
