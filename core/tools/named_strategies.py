"""The named strategy rows that every tool compares: one table, so a configuration is one row here.

``gradseam bench``, ``gradseam advise``'s ladder, ``gradseam demo`` and the docs' scripts pick their
rows from :data:`STRATEGIES` by label; whether a row needs CUDA follows from its config (the
backend catalog says what offloads), never from its name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import CheckpointConfig

ON: dict[str, Any] = {"gradient_checkpointing": True}


@dataclass(frozen=True)
class NamedStrategy:
    label: str
    config: Mapping[str, Any]  # the gradseam keys as a user writes them; {} is no checkpointing

    @property
    def needs_cuda(self) -> bool:
        """Offload copies GPU memory to pinned host memory: on a CPU model there is nothing to move."""
        return CheckpointConfig.from_dict(dict(self.config)).needs_engine

    @property
    def cpu_measurable(self) -> bool:
        """Whether the CPU tools can measure the row: there they count what saved-tensor hooks see, and
        kept attention kernel outputs never pass through those hooks (the count would be too low)."""
        cfg = CheckpointConfig.from_dict(dict(self.config))
        return not cfg.needs_engine and not cfg.kept_kernels


def _backend(name: str, **extra: Any) -> dict[str, Any]:
    return {**ON, "gradient_checkpointing_backend": name, **extra}


STRATEGIES: tuple[NamedStrategy, ...] = tuple(
    NamedStrategy(label, config)
    for label, config in (
        ("none", {}),
        ("torch-ffn", _backend("torch-ffn")),
        ("torch", _backend("torch")),
        ("torch, interval 2", _backend("torch", gradient_checkpointing_interval=2)),
        ("torch, interval 2, stride 4",
         _backend("torch", gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4)),
        ("torch + attention kept", _backend("torch", gradient_checkpointing_keep_attention=True)),
        ("unsloth-ffn", _backend("unsloth-ffn")),
        ("unsloth", _backend("unsloth")),
        ("attention offload", {"gradient_checkpointing_offload_attention": True}),
        ("torch-ffn + attention offload", _backend("torch-ffn", gradient_checkpointing_offload_attention=True)),
        ("unsloth-ffn + attention offload", _backend("unsloth-ffn", gradient_checkpointing_offload_attention=True)),
        ("torch + attention offload", _backend("torch", gradient_checkpointing_offload_attention=True)),
        ("unsloth + attention offload", _backend("unsloth", gradient_checkpointing_offload_attention=True)),
    )
)
BY_LABEL: dict[str, NamedStrategy] = {s.label: s for s in STRATEGIES}


def rows(*labels: str) -> list[tuple[str, dict[str, Any]]]:
    """``(label, config)`` for the given labels, in that order (a fresh dict per row)."""
    return [(label, dict(BY_LABEL[label].config)) for label in labels]


def needs_cuda(label: str) -> bool:
    """True for rows the CPU tools cannot measure (offload needs a GPU; kept kernels escape their count)."""
    return not BY_LABEL[label].cpu_measurable
