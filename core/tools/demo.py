"""``gradseam demo``: patch a built-in small Flux with every strategy this machine can run.

Nothing is downloaded: the model is ``FluxTransformer2DModel`` with a small random config. On the
CPU the kept-memory column is the bytes autograd keeps between forward and backward (counted with
saved-tensor hooks); on a GPU it is the measured activation peak.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

import gradseam

from . import measure as measuring
from .named_strategies import rows_of, select

DEMO_CONFIG = dict(
    patch_size=1, in_channels=16, num_layers=2, num_single_layers=6, attention_head_dim=64,
    num_attention_heads=4, joint_attention_dim=128, pooled_projection_dim=64, axes_dims_rope=[8, 28, 28],
)


def strategies(cuda: bool) -> list[tuple[str, dict[str, Any]]]:
    """The demo's rows: every named strategy that does not compile (compiling every block takes longer
    than the whole demo), least aggressive first; on the CPU only those it can measure there (offload
    needs a GPU, and kept kernel outputs escape the CPU's count)."""
    return rows_of(s for s in select(compiles=False) if cuda or s.cpu_measurable)


def check_tokens(image_tokens: int) -> None:
    """The demo's image is a square grid of patches, so only square token counts are exact.

    Rounding 99 down to 81 would run a different size than the table's title says; refuse instead
    and name the nearest sizes that work.
    """
    if image_tokens < 1:
        raise ValueError(f"image tokens must be a square number >= 1 (side x side patches), got {image_tokens}; "
                         "e.g. 256 (16x16) or 4096 (64x64).")
    side = math.isqrt(image_tokens)
    if side * side != image_tokens:
        raise ValueError(
            f"{image_tokens} is not a square number, and the demo's image is side x side patches; nearest: "
            f"{side * side} ({side}x{side}) or {(side + 1) ** 2} ({side + 1}x{side + 1})."
        )


@dataclass
class DemoRow:
    strategy: str
    kept_mib: float
    step_ms: float
    max_grad_diff: float  # against the unpatched model: 0.0 means bit-identical
    device: str = "cpu"
    tokens: int = 0
    step_times_ms: tuple[float, ...] = ()  # every timed step; step_ms is their median

    @property
    def spread(self) -> float | None:
        """(slowest - fastest) / median of the timed steps (None for a single step)."""
        return measuring.spread(self.step_times_ms)


def noise_marks(rows: list[DemoRow]) -> list[str | None]:
    """Which rows' step times are within noise against the first row (no checkpointing), and why."""
    return measuring.noise_marks([r.step_times_ms for r in rows])


def _inputs(device: torch.device, dtype: torch.dtype, image_tokens: int, text_tokens: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    side = math.isqrt(image_tokens)
    axis = torch.arange(side, dtype=torch.float32)
    ids = torch.stack(torch.meshgrid(torch.zeros(1), axis, axis, indexing="ij"), -1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    return {
        "hidden_states": randn(1, side * side, DEMO_CONFIG["in_channels"]).requires_grad_(True),
        "encoder_hidden_states": randn(1, text_tokens, DEMO_CONFIG["joint_attention_dim"]),
        "pooled_projections": randn(1, DEMO_CONFIG["pooled_projection_dim"]),
        "timestep": torch.tensor([0.5], device=device, dtype=dtype),
        "img_ids": ids.reshape(-1, 3).to(device, dtype),
        "txt_ids": torch.zeros(text_tokens, 3, device=device, dtype=dtype),
    }


def run(
    *, device: str | None = None, image_tokens: int | None = None, text_tokens: int = 64, steps: int = 3,
    progress: Callable[[Iterator[Any], int], Iterator[Any]] | None = None, threads: int | None = None,
) -> list[DemoRow]:
    """Every strategy on the demo Flux; on the CPU with ``threads`` torch threads (default 1).

    One thread by default: the model is small, and on a small or busy machine torch's default
    (one thread per core) makes the threads wait on each other; on the 2-core CI machine, with
    other jobs running, that made the demo take 1-2 minutes instead of about 12 seconds and
    scattered one row's step time by 40x.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1 (the median of the timed steps is reported), got {steps}.")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}.")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type != "cpu":
        return _run(dev, image_tokens, text_tokens, steps, progress)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or 1)
    try:
        return _run(dev, image_tokens, text_tokens, steps, progress)
    finally:
        torch.set_num_threads(before)


def _run(
    dev: torch.device, image_tokens: int | None, text_tokens: int, steps: int,
    progress: Callable[[Iterator[Any], int], Iterator[Any]] | None,
) -> list[DemoRow]:
    from diffusers import FluxTransformer2DModel

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if image_tokens is None:
        image_tokens = 4096 if dev.type == "cuda" else 256  # a CPU run should take seconds, not minutes
    check_tokens(image_tokens)
    torch.manual_seed(0)
    with torch.device(dev):
        model = FluxTransformer2DModel(**DEMO_CONFIG)
    if dtype != torch.float32:
        model.to(dtype)  # a random model: no module needs to be kept in float32
    inputs = _inputs(dev, dtype, image_tokens, text_tokens)
    inner = measuring.forward_backward(model, inputs, count_saved=dev.type == "cpu")

    def step() -> int | measuring.Phases:
        model.zero_grad(set_to_none=True)  # every step allocates the parameter grads, as a training step does
        return inner()

    rows = []
    reference: torch.Tensor | None = None
    todo = strategies(dev.type == "cuda")
    iterator = progress(iter(todo), len(todo)) if progress else iter(todo)
    for name, config in iterator:
        handle = gradseam.patch(model, config) if config else None
        try:
            got = measuring.measure(step, steps=steps, device=dev.type, engine=getattr(handle, "engine", None))
        finally:
            if handle is not None:
                handle.remove()
        grad = inputs["hidden_states"].grad
        if reference is None:
            reference = grad.clone()
        diff = (grad.float() - reference.float()).abs().max().item()
        rows.append(DemoRow(name, got.peak_gib * measuring.GiB / measuring.MiB, got.step_ms, diff, dev.type,
                            image_tokens, got.step_times_ms))
    return rows
