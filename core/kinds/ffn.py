"""FFN-seam regions (``torch-ffn``, ``unsloth-ffn``): only the feed-forward side the family declares is
recomputed; attention keeps its saved tensors (or offloads them, as regions of their own)."""

from __future__ import annotations

from typing import Any

from ..backends import CATALOG, Backend, Offload, Scope
from ..config import CheckpointConfig
from ..errors import UnsupportedStrategyError, warn_once
from ..family import Family
from .base import RegionKind


class FfnSeam(RegionKind):
    name = "ffn-seam"
    _global = "FFN_SEAM"

    def check_family(self, backend: Backend, family: Family, config: CheckpointConfig) -> None:
        if not family.has_ffn:
            missing = [bc.name.rsplit(".", 1)[-1] for bc in family.block_classes if not bc.ffn]
            whole = next((b.name for b in CATALOG.values() if b.scope is Scope.BLOCK and b.offload is backend.offload),
                         None)
            raise UnsupportedStrategyError(
                f"backend {backend.name!r} needs an FFN boundary, but family {family.name!r} declares none "
                f"for {missing}; gradseam will not silently run another scope. Use {whole!r} (whole-block) instead."
            )
        if config.keep_attention:
            warn_once(
                f"gradient_checkpointing_keep_attention has no effect here: backend {backend.name!r} never "
                "recomputes attention (it only checkpoints the feed-forward side). It keeps attention kernel "
                "outputs on the GPU inside whole-block regions (backends 'torch' / 'unsloth')."
            )
        if config.gradient_checkpointing_interval and config.interval > 1 and config.stride is None:
            warn_once(
                f"gradient_checkpointing_interval={config.interval} does not group FFN regions (attention "
                f"sits between them); with {backend.name!r} the interval only selects blocks through "
                "gradient_checkpointing_segment_stride."
            )

    def describe(self, region: Any, *, own: str, later: str) -> str:
        what = f"{region.backend}: recompute {'→'.join(region.seam)}"
        if region.offload is Offload.INPUTS:
            what += " + CPU offload of region inputs"
        return what + later


FFN_SEAM = FfnSeam()
