"""The backend catalog: what each ``gradient_checkpointing_backend`` value means, as plain data.

A backend is one :class:`Backend` entry: which part of a block its regions cover (:class:`Scope`),
what of a region goes to host memory (:class:`Offload`), and which runner of the run layer
executes its regions (``runner``, a name :mod:`gradseam.run.install` maps to code). Nothing here
runs anything or imports the run layer: the config validates names against :data:`CATALOG`, the
planner copies an entry's fields into every region's spec, and the tools read the words. Adding
a backend is one entry here plus, if its regions run differently, one runner in the run layer
(docs/internals.md, "Adding a backend").

Imports nothing heavy: ``import gradseam`` reads this module to validate configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Scope(Enum):
    """What one region of a backend covers."""

    BLOCK = "block"  # whole blocks (or interval chunks of them)
    FFN = "ffn"  # only the feed-forward seams the family declares


class Offload(Enum):
    """What of a region lives in host memory between forward and backward."""

    NOTHING = "nothing"
    INPUTS = "inputs"  # the region's inputs: all a non-reentrant checkpoint keeps (the unsloth backends)
    SAVED = "saved"  # everything the region keeps for backward (what a compiled block's partitioner chose)


@dataclass(frozen=True)
class Backend:
    """One checkpointing backend.

    ``recomputes`` / ``keeps`` are the words tables and summaries use; ``runner`` names the run
    layer's runner for its regions ("checkpoint": one non-reentrant ``torch.utils.checkpoint`` per
    region). ``chunks``: its regions may span ``interval`` blocks; ``kept_attention``: its regions
    may keep attention kernel outputs (``..._keep_attention`` / ``..._offload_attention``). A config
    asking a backend for what it does not do is refused by the planner, never ignored.
    """

    name: str
    scope: Scope
    offload: Offload
    recomputes: str
    keeps: str
    runner: str = "checkpoint"
    chunks: bool = True
    kept_attention: bool = True
    budget: bool = False  # reads gradient_checkpointing_memory_budget
    # Bit-identical to the unpatched eager model on the CPU. The compiler sums a tensor's gradient
    # contributions in its own order, so compiled backends match to rounding (docs/reliability.md).
    bitwise: bool = True

    @property
    def offloads(self) -> bool:
        return self.offload is not Offload.NOTHING


CATALOG: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("torch", Scope.BLOCK, Offload.NOTHING, "whole blocks (or chunks of `interval` blocks)",
                "block inputs"),
        Backend("torch-ffn", Scope.FFN, Offload.NOTHING, "the feed-forward side of each block",
                "the FFN input; attention's saved tensors"),
        Backend("unsloth", Scope.BLOCK, Offload.INPUTS, "whole blocks (or chunks of `interval` blocks)",
                "block inputs in CPU memory"),
        Backend("unsloth-ffn", Scope.FFN, Offload.INPUTS, "the feed-forward side of each block",
                "FFN inputs in CPU memory"),
        # Compiled blocks: the compiler's partitioner recomputes the cheap ops under the memory budget
        # (gradseam.run.compiled). A compiled block is its own region: no chunks, and its attention
        # outputs are already what the partitioner keeps.
        Backend("compile", Scope.BLOCK, Offload.NOTHING,
                "the cheap ops of each compiled block (the compiler chooses, under the memory budget)",
                "what the compiler keeps (matmul and attention outputs) under the budget", runner="compiled",
                chunks=False, kept_attention=False, budget=True, bitwise=False),
        Backend("unsloth-compile", Scope.BLOCK, Offload.SAVED,
                "the cheap ops of each compiled block (the compiler chooses, under the memory budget)",
                "what the compiler keeps, in CPU memory", runner="compiled", chunks=False,
                kept_attention=False, budget=True, bitwise=False),
    )
}
