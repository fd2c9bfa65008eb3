"""The backend catalog: what each ``gradient_checkpointing_backend`` value means, as plain data.

A backend is one :class:`Backend` entry: which part of a block its regions cover (:class:`Scope`),
what of a region leaves the GPU (:class:`Offload`) and where it goes (:class:`Destination`), the
words tables and summaries use, the region kind that gives its regions their behaviour (``kind``,
a name :mod:`gradseam.kinds` maps to an object: which keys it reads, what it refuses, how its
regions read), and its place on the tools' ladder (``ladder``). Nothing here runs anything: the
config validates names against :data:`CATALOG`, the kinds and the planner read the entries, the
tools derive their rows from them. Adding a backend is one entry here; a kind if its behaviour is
new; a runner if it installs differently; a store if it offloads somewhere new (docs/internals.md,
"Adding a backend").

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
    """What of a region leaves the GPU between forward and backward."""

    NOTHING = "nothing"
    INPUTS = "inputs"  # the region's inputs: all a non-reentrant checkpoint keeps (the unsloth backends)
    SAVED = "saved"  # everything the region keeps for backward (what a compiled block's partitioner chose)


class Destination(Enum):
    """Where what a region offloads is kept until backward: a store of the offload engine.

    ``DEVICE``: nothing leaves the model's device. ``HOST``: the engine's pool of pinned host memory
    (sized by ``gradient_checkpointing_offload_pin_memory_max_buckets``). A new place (a file on
    NVMe, say) is one more value here and one store in :mod:`gradseam.offload.stores`.
    """

    DEVICE = "device"
    HOST = "host"


class Kept(str, Enum):
    """Where a whole-block region keeps attention kernel outputs instead of recomputing them."""

    NOWHERE = ""  # recomputed with the rest of the block
    GPU = "gpu"
    CPU = "cpu"  # in host memory, through the offload engine

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Backend:
    """One checkpointing backend.

    ``recomputes`` / ``keeps`` are the words tables and summaries use. ``kind`` names its region kind
    (:data:`gradseam.kinds.KINDS`): whole-block checkpoint, FFN seam, compiled block. ``ladder``: where
    the tools place it, from the least aggressive (fastest, most memory) to the most; a judgement,
    declared here so that no tool names a backend. A config asking a backend for what its kind does
    not do is refused, never ignored.
    """

    name: str
    scope: Scope
    offload: Offload
    destination: Destination
    recomputes: str
    keeps: str
    kind: str
    ladder: int

    def __post_init__(self) -> None:
        if (self.offload is Offload.NOTHING) != (self.destination is Destination.DEVICE):
            raise ValueError(f"backend {self.name!r}: offloading {self.offload.value} needs a destination other "
                             f"than the device, and only offloading does ({self.destination.value})")

    @property
    def moves(self) -> bool:
        """Whether its regions move something off the model's device (through the offload engine)."""
        return self.destination is not Destination.DEVICE


_HOST = Destination.HOST
_DEVICE = Destination.DEVICE

CATALOG: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("torch", Scope.BLOCK, Offload.NOTHING, _DEVICE, "whole blocks (or chunks of `interval` blocks)",
                "block inputs", kind="whole-block", ladder=2),
        Backend("torch-ffn", Scope.FFN, Offload.NOTHING, _DEVICE, "the feed-forward side of each block",
                "the FFN input; attention's saved tensors", kind="ffn-seam", ladder=1),
        Backend("unsloth", Scope.BLOCK, Offload.INPUTS, _HOST, "whole blocks (or chunks of `interval` blocks)",
                "block inputs in CPU memory", kind="whole-block", ladder=4),
        Backend("unsloth-ffn", Scope.FFN, Offload.INPUTS, _HOST, "the feed-forward side of each block",
                "FFN inputs in CPU memory", kind="ffn-seam", ladder=3),
        # Compiled blocks: the compiler's partitioner recomputes the cheap ops under the memory budget
        # (gradseam.kinds.compiled, gradseam.run.compiled).
        Backend("compile", Scope.BLOCK, Offload.NOTHING, _DEVICE,
                "the cheap ops of each compiled block (the compiler chooses, under the memory budget)",
                "what the compiler keeps (matmul and attention outputs) under the budget", kind="compiled-block", ladder=5),
        Backend("unsloth-compile", Scope.BLOCK, Offload.SAVED, _HOST,
                "the cheap ops of each compiled block (the compiler chooses, under the memory budget)",
                "what the compiler keeps, in CPU memory", kind="compiled-block", ladder=6),
    )
}


def by_ladder() -> list[Backend]:
    """Every backend from the least aggressive to the most (:attr:`Backend.ladder`): the tools' order."""
    return sorted(CATALOG.values(), key=lambda b: b.ladder)
