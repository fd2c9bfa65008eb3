"""The backend catalog: what each ``gradient_checkpointing_backend`` value means, in one place.

Every other module asks a :class:`Backend` instead of testing the name: the config validates
against :data:`CATALOG`, planning asks for the scope, the patcher for a runner, the summary for
words. A new backend is one entry here (and, if it needs one, a new region scope).

Imports nothing heavy: ``import gradseam`` reads this module to validate configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .kernels import KernelSet
    from .offload import OffloadEngine
    from .strategies import Runner


@dataclass(frozen=True)
class Backend:
    """One checkpointing backend.

    ``scope``: ``"block"`` checkpoints whole blocks (or interval chunks of them); ``"ffn"`` only the
    feed-forward seams the family declares. ``offloads_inputs``: the region inputs, all that a
    non-reentrant checkpoint keeps across the region, live in CPU memory (the unsloth backends).
    ``needs_cuda``: offloading moves GPU memory, so the model must be on a GPU.
    """

    name: str
    scope: str
    offloads_inputs: bool
    recomputes: str  # for tables and summaries: what backward computes again
    keeps: str  # ...and what stays between forward and backward

    @property
    def needs_cuda(self) -> bool:
        return self.offloads_inputs

    @property
    def whole_blocks(self) -> bool:
        return self.scope == "block"

    def runner(self, engine: OffloadEngine | None, kernels: KernelSet | None = None,
               offload_kernels: bool = False) -> Runner:
        """How this backend's regions run. ``kernels``: attention kernels whose outputs are kept, not
        recomputed (whole-block scope only); in host memory through ``engine`` when ``offload_kernels``."""
        from .scopes import RegionScope
        from .strategies import Runner

        if not self.offloads_inputs and kernels is None:
            return Runner()
        moves = self.offloads_inputs or offload_kernels
        return Runner(RegionScope(engine if moves else None, inputs=self.offloads_inputs, kernels=kernels))

    def describe(self, unit: str, *, kernels: str = "", pending: bool = False) -> str:
        """``unit`` is "each block", "chunks of 2 blocks" or an FFN seam; ``kernels`` "gpu"/"cpu"/""."""
        what = f"{self.name}: recompute {unit}"
        if kernels:
            what += f" except attention kernels (outputs kept in {'CPU' if kernels == 'cpu' else 'GPU'} memory)"
        if self.offloads_inputs:
            what += " + CPU offload of region inputs"
        if pending and (self.offloads_inputs or kernels == "cpu"):
            what += " (pending: the model is on the CPU)"
        return what


CATALOG: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("torch", "block", False, "whole blocks (or chunks of `interval` blocks)", "block inputs"),
        Backend("torch-ffn", "ffn", False, "the feed-forward side of each block",
                "the FFN input; attention's saved tensors"),
        Backend("unsloth", "block", True, "whole blocks (or chunks of `interval` blocks)",
                "block inputs in CPU memory"),
        Backend("unsloth-ffn", "ffn", True, "the feed-forward side of each block", "FFN inputs in CPU memory"),
    )
}


def backend(name: str) -> Backend:
    return CATALOG[name]


def describe_all() -> list[dict[str, Any]]:
    """The catalog as rows (for docs and ``gradseam families``-style listings)."""
    return [{"backend": b.name, "scope": b.scope, "recomputes": b.recomputes, "keeps": b.keeps,
             "needs CUDA": b.needs_cuda} for b in CATALOG.values()]
