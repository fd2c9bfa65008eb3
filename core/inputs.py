"""Shared pieces of the adapters' real-size ``make_inputs`` builders: latent sizes, grids, tensors.

Every family's preset builds one training batch at the size people train (1024² images, 480p video
at the model card's frame count). The arithmetic that turns pixels or a token count into latent
sizes is the same across families that share a VAE (8x spatial, 4x temporal for Wan's and
HunyuanVideo's VAEs), and a copy in each adapter would drift. Adapters import this module and
:mod:`gradseam.family` / :mod:`gradseam.hookspecs`, nothing else of the core; it imports torch only
inside its functions, so listing families stays cheap.
"""

from __future__ import annotations

from typing import Any


def square_side(tokens: int) -> int:
    """The side of the square patch grid closest to ``tokens`` patches (at least 1)."""
    return max(1, round(tokens**0.5))


def video_latent_size(
    frames: int, height: int, width: int, *, patch: tuple[int, int, int] = (1, 1, 1), tokens: int | None = None,
    temporal: int = 4, spatial: int = 8,
) -> tuple[int, int, int]:
    """Latent ``(frames, height, width)`` of a causal video VAE: ``(frames - 1) / temporal + 1`` frames,
    ``height / spatial`` x ``width / spatial``.

    ``tokens`` (after patchifying by ``patch``) overrides the frame count, keeping the picture size:
    that is how bench and advise scale a video workload's sequence length.
    """
    pt, ph, pw = patch
    h, w = height // spatial, width // spatial
    latent_frames = (frames - 1) // temporal + 1
    if tokens:
        latent_frames = max(1, round(tokens * pt / ((h // ph) * (w // pw))))
    return latent_frames, h, w


def grid_ids(side: int, device: Any, *, channels: int = 3, lead: int = 1) -> Any:
    """Position ids ``(side * side, channels)`` of a square grid: ``lead`` leading zero columns, then
    ``[row, col]`` (Flux's ``[0, row, col]`` with the defaults), padded with zeros to ``channels``."""
    import torch

    rows, cols = torch.meshgrid(torch.arange(side, device=device), torch.arange(side, device=device), indexing="ij")
    parts = [torch.zeros_like(rows)] * lead + [rows, cols]
    parts += [torch.zeros_like(rows)] * (channels - len(parts))
    return torch.stack(parts, dim=-1).reshape(-1, channels)


def flux_ids(n_text: int, tokens: int, device: Any) -> tuple[Any, Any]:
    """Flux-style ``(img_ids, txt_ids)``: ``[0, row, col]`` on the square grid nearest ``tokens``
    image tokens, and zeros for the ``n_text`` text tokens (Flux, Chroma and Krea 2 position their
    tokens this way)."""
    import torch

    ids = grid_ids(square_side(tokens), device)
    return ids, torch.zeros(n_text, 3, device=device, dtype=ids.dtype)


def tensor_maker(device: Any, dtype: Any) -> Any:
    """``randn(*shape, grad=False)`` on ``device`` in ``dtype``: the latents ask for ``grad=True``."""
    import torch

    def randn(*shape: int, grad: bool = False) -> Any:
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)

    return randn
