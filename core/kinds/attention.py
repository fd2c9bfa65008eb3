"""Attention-offload regions: an attention submodule outside any checkpoint region (beside the ``-ffn``
backends, in blocks a stride leaves out, or alone) whose saved tensors all go to host memory.
Never recomputed; no backend names this kind, ``gradient_checkpointing_offload_attention`` does."""

from __future__ import annotations

from typing import Any

from ..backends import Backend
from ..config import CheckpointConfig
from ..errors import UnsupportedStrategyError
from ..family import Family
from .base import RegionKind


class AttentionOffload(RegionKind):
    name = "attention-offload"
    _global = "ATTENTION_OFFLOAD"

    def check_family(self, backend: Backend | None, family: Family, config: CheckpointConfig) -> None:
        if not family.has_attention:
            raise UnsupportedStrategyError(
                f"gradient_checkpointing_offload_attention needs an attention side, but family {family.name!r} "
                "declares none; turn attention offload off for this model."
            )

    def describe(self, region: Any, *, own: str, later: str) -> str:
        return f"offload {region.seam[0]} saved tensors{later}"


ATTENTION_OFFLOAD = AttentionOffload()
