"""MiniMax-H3 joint video + audio generation (MiniMaxH3Transformer3DModel: the ``transformer/``
partition for text-to-video+audio and keyframe workflows, and ``transformer_ref/`` for references,
which share the class).

The model runs one packed 1-D sequence per request: text rows, conditioning rows, stereo audio rows
and target video rows, all in one full self-attention (no cross-attention, no per-modality block
weights). Two block lists, in the order the model runs them:

- **Token refiner** (``token_refiner.refiner_blocks``, ``MiniMaxH3TokenRefinerBlock``): plain
  pre-norm blocks over the projected text, before it is scattered into the packed sequence. The
  loop is ``hidden_states = block(hidden_states)``: the carried stream is the block's only argument,
  so the list carries ``{"hidden_states": None}``. Its MLP is ``x + ff(norm2(x))`` with no
  modulation and no gate, so ``norm2 -> ff`` is a strict chain and the seam (it also drops the
  normalised copy).
- **Trunk** (``transformer_blocks``, ``MiniMaxH3TransformerBlock``): called positionally as
  ``block(hidden_states, temb, adaln_indices, rotary_emb)``. The timestep embedding (one row per
  distinct noise level), the per-row AdaLN table index (``timestep_indices * 3 + modality``) and the
  RoPE ``(cos, sin)`` tuple are computed once before the loop and are the same objects for every
  block; each block projects ``temb`` with its own ``adaln_proj`` and selects its rows itself.
  Nothing is added between blocks and the block returns the sequence alone:
  ``{"hidden_states": None}``. The FFN is ``x + gate[rows] * ff(norm2(x) * (1 + scale[rows]) +
  shift[rows])``: ``ff`` (diffusers' SwiGLU ``FeedForward``: ``proj`` to ``2 x ffn_dim``, the gated
  product, ``net.2``) is called on exactly the modulated value, gate and residual outside; ``norm2``
  cannot join (modulated first). Recomputing it drops the ``2 x 14336``-wide projection, the SiLU
  and the product for every row.

Keyframe conditioning and reference rows only add rows (and distinct timesteps) to the packed
layout; the blocks still see one shared ``temb``, ``adaln_indices`` and ``rotary_emb`` each, so chunks
stay whole with them.

Attention side: ``attn`` in both classes (projections to ``heads x head_dim``, which is wider than
the residual stream in MiniMax-H3, QK RMSNorms, partial RoPE and the kernel).
"""

from __future__ import annotations

from typing import Any

from gradseam.family import BlockClass, BlockList, Carry, Family, Preset
from gradseam.hookspecs import hookimpl
from gradseam.inputs import tensor_maker

_M = "diffusers.models.transformers.transformer_minimax_h3"
_ONE = Carry({"hidden_states": None})

# The modular pipeline's facts (diffusers.modular_pipelines.minimax_h3): modality tags, 24 fps video
# through a VAE of 16x spatial compression that turns 17 * n + 5 frames into 5 * n + 2 latent frames,
# and stereo audio at 40 latents per second, packed channel-major.
_VIDEO, _TEXT, _AUDIO = 0, 1, 2
_FPS, _AUDIO_RATE, _AUDIO_CHANNELS, _SPATIAL = 24, 40, 2, 16


def latent_frames(frames: int) -> int:
    """Latent frames of the video VAE for ``frames`` pixel frames, snapped up to ``17 * n + 5``."""
    frames = max(frames, 5)
    while frames % 17 != 5:
        frames += 1
    return (frames - 5) // 17 * 5 + 2


def packed_layout(n_text: int, n_audio: int, frames: int, grid: tuple[int, int], device: Any) -> dict:
    """The ``t2va`` layout ``[text | audio | video]`` as forward keyword arguments: the row indices of
    each modality, modality tags, and one timestep per row reduced to the distinct values (audio,
    video) with an index per row (text rows take the video's), as the pipeline reduces them. Positions
    sit on a plain ``(t, h, w)`` grid (text and each audio channel along ``t``, video frames of
    ``grid`` patches); the pipeline's aspect-normalised values do not change the cost."""
    import torch

    n_video = frames * grid[0] * grid[1]
    total = n_text + n_audio + n_video
    rows = torch.arange(total, device=device)
    text, audio, video = rows[:n_text], rows[n_text:n_text + n_audio], rows[n_text + n_audio:]
    tags = torch.full((total,), _VIDEO, dtype=torch.long, device=device)
    tags[text], tags[audio] = _TEXT, _AUDIO
    timestep = torch.tensor([0.4, 0.7], device=device)  # distinct values, sorted: audio, video
    timestep_indices = torch.ones(total, dtype=torch.long, device=device)
    timestep_indices[audio] = 0
    position_ids = torch.zeros(total, 3, device=device)
    position_ids[text, 0] = torch.arange(n_text, device=device, dtype=torch.float32)
    per_channel = max(1, n_audio // _AUDIO_CHANNELS)
    position_ids[audio, 0] = n_text + (torch.arange(n_audio, device=device) % per_channel).float()
    t, h, w = torch.meshgrid(*(torch.arange(n, device=device, dtype=torch.float32) for n in (frames, *grid)),
                             indexing="ij")
    position_ids[video] = torch.stack([t + n_text, h, w], dim=-1).reshape(-1, 3)
    return {
        "timestep": timestep, "timestep_indices": timestep_indices, "token_tags": tags,
        "position_ids": position_ids, "video_indices": video, "audio_indices": audio, "text_indices": text,
    }


def make_inputs(
    model: Any, device: Any, dtype: Any, tokens: int | None = None, *, frames: int = 124, height: int = 768,
    width: int = 1344, text_tokens: int = 512,
) -> dict:
    """One real-size ``t2va`` batch: patchified video latents (grad) of ``frames`` frames at
    ``height x width`` (16x VAE, 1x2x2 patches), the stereo audio latents (grad) covering the same
    duration, Qwen3-VL text states of ``text_tokens`` rows, and the packed layout.

    ``tokens`` overrides the video row count by changing the number of latent frames."""
    cfg = model.config
    randn = tensor_maker(device, dtype)
    pt, ph, pw = cfg.patch_size
    grid = (height // _SPATIAL // ph, width // _SPATIAL // pw)
    n_frames = latent_frames(frames) // pt
    if tokens:
        n_frames = max(1, round(tokens / (grid[0] * grid[1])))
    n_audio = round(frames / _FPS * _AUDIO_RATE) * _AUDIO_CHANNELS
    return {
        "hidden_states": randn(1, n_frames * grid[0] * grid[1], cfg.in_channels * pt * ph * pw, grad=True),
        "audio_hidden_states": randn(1, n_audio, cfg.audio_in_channels, grad=True),
        "encoder_hidden_states": randn(1, text_tokens, cfg.text_dim),
        **packed_layout(text_tokens, n_audio, n_frames, grid, device),
    }


MINIMAX_H3 = Family(
    name="minimax-h3",
    description="MiniMax-H3 joint video + audio (MiniMaxH3Transformer3DModel)",
    models=(f"{_M}.MiniMaxH3Transformer3DModel",),
    block_lists=(
        BlockList("token_refiner.refiner_blocks", carry=_ONE),
        BlockList("transformer_blocks", carry=_ONE),
    ),
    block_classes=(
        BlockClass(f"{_M}.MiniMaxH3TokenRefinerBlock", ffn=(("norm2", "ff"),), attention=("attn",)),
        BlockClass(f"{_M}.MiniMaxH3TransformerBlock", ffn=(("ff",),), attention=("attn",)),
    ),
    presets={
        "33b-768p": Preset(
            "MiniMax-H3 33B (50 blocks, hidden 5376, 56 x 128 heads, SwiGLU 14336; 2 refiner blocks; the class "
            "defaults are the released transformer) on its 768x1344 release canvas, 124 frames (5 s at 24 fps): "
            "37 x 24 x 42 = 37296 video rows + 414 stereo audio rows + 512 text rows (the text count assumed)",
            config={},  # the class defaults (33B, as released)
            inputs={"frames": 124, "height": 768, "width": 1344},
            make_inputs=make_inputs,
        ),
        "33b-480p": Preset(
            "MiniMax-H3 33B (as '33b-768p') at 480x832, 124 frames: 37 x 15 x 26 = 14430 video rows + 414 audio "
            "rows + 512 text rows",
            config={},
            inputs={"frames": 124, "height": 480, "width": 832},
            make_inputs=make_inputs,
        ),
    },
)


@hookimpl
def register_families(register):
    register(MINIMAX_H3)
