"""MiniMax Music 3's flow-matching DiT (diffusers' ``MiniMaxMusic3Transformer1DModel``: the 2.4B audio
transformer that SimpleTuner and DiffSynth fine-tune; the Qwen3 language model, the RVQ depth decoder,
the condition encoder and the DAV vocoder of the full pipeline are other models).

One block list, ``transformer_blocks``, every entry a ``MiniMaxMusic3TransformerBlock``: a pre-norm
block on a 1-D sequence of Flow-VAE latent frames. Before the loop the model concatenates
``[latents | zeros | condition]`` on the channel axis, adds a 1x1 ``preprocess_conv`` to it, projects it
to the trunk width (``proj_in``), prepends the timestep embedding as one extra token and asks
``rotary_emb`` for the ``(cos, sin)`` tuple of that length. Then it calls each block positionally,
``block(hidden_states, rotary_emb)``, and each block returns the new hidden states alone.

**Carry** ``Carry({"hidden_states": None})``: the only other argument is the RoPE tuple, one object
for every block of a call (computed once before the loop; ``rotary_emb.forward`` is even
``lru_cache``-d, so it is the same tuple in every step of a given length). There is no mask, no
per-block modulation (the timestep travels as a token of the sequence, not as an argument) and
nothing happens between two blocks, so a chunk's later blocks are called exactly as the chunk ran
them and chunks run whole.

**No FFN seam** (the ``-ffn`` backends refuse the family): the feed-forward is a GLU written inline in
the block's ``forward``, ``ff_out(a * silu(b))`` with ``a, b = ff_in(norm2(h)).chunk(2)``, and
``ff_in`` and ``ff_out`` are bare ``nn.Linear`` layers. The product between them is tensor arithmetic of the
block itself, so ``ff_out`` is not called on ``ff_in``'s output and no seam can span the two. The only
strict chain is ``norm2 → ff_in``, and its output feeds that arithmetic, not the residual: checkpointed
alone it would be exact but drop only ``norm2``'s output (one ``d``-wide tensor), while the
``2·8192``-wide ``ff_in`` output, the SiLU output and the ``8192``-wide product, the bulk of the MLP's
activations, stay saved by the ops outside it (measured on a tiny model with the real 4x ratio: a step
keeps ~96% of what it keeps unpatched). A seam that keeps what ``-ffn`` promises to drop would be a
wrong answer dressed as a right one, so none is declared. Whole-block checkpointing and interval
chunks recompute the MLP with everything else.

Attention side: ``attn`` (``MiniMaxMusic3Attention``: the Q/K/V projections, the partial rotary
embedding on the first ``rotary_dim`` dimensions of each head, the dispatched attention call without a
mask and ``to_out``, all inside its processor). It is the block's only attention module; ``norm1``,
``norm2`` and the residuals stay outside.
"""

from __future__ import annotations

import math
from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker

_M = "diffusers.models.transformers.transformer_minimax_music3"

# The Flow-VAE (the DAV autoencoder) encodes 44.1 kHz stereo with encoder strides 2·4·8·8 = 512 samples
# per latent frame, after right-padding the waveform to a multiple of that hop: ceil(samples / 512)
# frames, 86.13 per second. Its 128 latent channels are 64 per stereo channel, stacked.
SAMPLING_RATE = 44100
HOP_LENGTH = 512


def latent_frames(seconds: float) -> int:
    """Flow-VAE latent frames of ``seconds`` of audio, as the DAV encoder makes them (``ceil``)."""
    return math.ceil(round(seconds * SAMPLING_RATE) / HOP_LENGTH)


def make_inputs(model: Any, device: Any, dtype: Any, tokens: int | None = None, *, seconds: float = 30.0) -> dict:
    """One real-size training batch as the fine-tuning trainers feed the DiT: the noisy Flow-VAE latents
    ``(1, in_channels, frames)`` (grad) of a clip of ``seconds``, the latent-aligned condition
    ``(1, frames, condition_dim)`` (the condition encoder's output: cached language-model frame
    hidden states, mixed, projected and resampled to the latent frame rate; no grad) and a flow-matching
    time in ``[0, 1]``. The blocks see ``frames + 1`` tokens (the timestep token).

    ``tokens`` overrides the latent frame count.
    """
    import torch

    cfg = model.config
    frames = tokens if tokens else latent_frames(seconds)
    randn = tensor_maker(device, dtype)
    return {
        "hidden_states": randn(1, cfg.in_channels, frames, grad=True),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "encoder_hidden_states": randn(1, frames, cfg.condition_dim),
    }


# The published transformer config (MiniMaxAI/MiniMax-Music3, transformer/config.json), which the class
# defaults stand for: spelled out so a change of defaults shows.
CONFIG = {
    "in_channels": 128, "condition_dim": 2048, "num_layers": 36, "num_attention_heads": 32,
    "attention_head_dim": 64, "ff_inner_dim": 8192, "rotary_dim": 32, "fourier_embedding_dim": 256,
}
_DESCRIPTION = (
    "MiniMax Music 3 DiT (2.4B: 36 blocks, dim 2048, 32 x 64 heads with RoPE on 32 dims, GLU 8192; the "
    "published config = the class defaults) on a {seconds} s clip of 44.1 kHz audio ({frames} Flow-VAE "
    "latent frames + 1 timestep token), with the latent-aligned 2048-wide condition"
)


def _preset(seconds: int) -> Preset:
    return Preset(
        _DESCRIPTION.format(seconds=seconds, frames=latent_frames(seconds)),
        config=CONFIG,
        inputs={"seconds": seconds},
        make_inputs=make_inputs,
    )


MINIMAX_MUSIC3 = Family(
    name="minimax-music3",
    description="MiniMax Music 3 flow-matching music DiT (MiniMaxMusic3Transformer1DModel)",
    models=(f"{_M}.MiniMaxMusic3Transformer1DModel",),
    block_lists=(BlockList("transformer_blocks", carry=Carry({"hidden_states": None})),),
    # no FFN seam: the GLU's product is computed in the block's forward, between ff_in and ff_out (see above)
    block_classes=(BlockClass(f"{_M}.MiniMaxMusic3TransformerBlock", attention=("attn",)),),
    presets={
        # SimpleTuner's example datasets for this model cap clips at 30 s (24 GB), 40 s (32 GB) and 60 s
        # (48 GB); its hosted MiniMax Music 3 trainer defaults to 180 s per track (a whole three-minute
        # song; 300 s at most)
        "2.4b-30s": _preset(30),
        "2.4b-60s": _preset(60),
        "2.4b-180s": _preset(180),
    },
)


@hookimpl
def register_families(register: Any) -> None:
    register(MINIMAX_MUSIC3)
