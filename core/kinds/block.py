"""Whole-block checkpoint regions (``torch``, ``unsloth``): a block, or a chunk of ``interval`` blocks,
recomputed in backward by one non-reentrant checkpoint; attention kernel outputs optionally kept."""

from __future__ import annotations

from typing import Any

from ..backends import Backend, Kept, Offload
from ..config import CheckpointConfig
from ..errors import warn_once
from ..family import Family
from .base import RegionKind


class WholeBlock(RegionKind):
    name = "whole-block"
    chunks = True
    keeps_kernels = True
    _global = "WHOLE_BLOCK"

    def may_keep_weights(self, backend: Backend) -> bool:
        return False  # a recomputed block keeps its inputs (and kept kernels their outputs): never a weight

    def check_family(self, backend: Backend, family: Family, config: CheckpointConfig) -> None:
        if config.gradient_checkpointing_interval and config.interval > 1 and not family.supports_interval:
            warn_once(
                f"family {family.name!r} does not support gradient_checkpointing_interval; ignoring "
                f"interval={config.interval} and checkpointing every selected block on its own."
            )

    def describe(self, region: Any, *, own: str, later: str) -> str:
        unit = f"chunks of {len(region.blocks)} blocks" if len(region.blocks) > 1 else "each block"
        what = f"{region.backend}: recompute {unit}"
        if region.kept is not Kept.NOWHERE:
            where = "CPU" if region.kept is Kept.CPU else own
            what += f" except attention kernels (outputs kept in {where} memory)"
        if region.offload is Offload.INPUTS:
            what += " + CPU offload of region inputs"
        return what + later


WHOLE_BLOCK = WholeBlock()
