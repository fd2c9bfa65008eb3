"""The region kind's contract (:class:`RegionKind`) and what kinds share: the catalog's siblings of a backend
and the note a fallen-back checkpoint chain gets. The kinds themselves are the other modules of this package."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from ..backends import CATALOG, Backend, Kept
from ..config import CheckpointConfig
from ..family import Family

if TYPE_CHECKING:  # the kinds import no torch: the tools read them before torch is imported
    from torch import nn

RegionView = Any  # gradseam.summary.RegionView (the summary sits above the kinds): label, calls, fallbacks


class RegionKind:
    """The behaviour of one kind of region. Subclasses set the class attributes and override what differs.

    ``chunks``: its regions may span ``interval`` blocks. ``takes_interval``: it accepts
    ``gradient_checkpointing_interval`` at all (as a chunk size, or to select blocks with a stride).
    ``keeps_kernels``: its regions may keep attention kernel outputs instead of recomputing them
    (``..._keep_attention``, or ``..._offload_attention`` read as "kept in CPU memory"). ``compiles``: its regions run through
    ``torch.compile``. ``tolerance``: how far its gradients may be from the unpatched model's on the
    CPU (0: bit for bit).
    """

    name: ClassVar[str]
    chunks: ClassVar[bool] = False
    takes_interval: ClassVar[bool] = True
    keeps_kernels: ClassVar[bool] = False
    compiles: ClassVar[bool] = False
    tolerance: ClassVar[float] = 0.0

    # -- the config ---------------------------------------------------------------------------
    def check_config(self, backend: Backend, config: CheckpointConfig) -> None:
        """Refuse, model-free, a setting this kind's ``backend`` does not do (never silently ignored)."""

    def check_foreign(self, backend: Backend | None, config: CheckpointConfig) -> None:
        """Refuse a key this kind owns, set while another kind (or none) runs: its wording, its remedy."""

    def kept(self, config: CheckpointConfig) -> Kept:
        """Where its regions keep attention kernel outputs under ``config`` (nowhere unless ``keeps_kernels``)."""
        if not self.keeps_kernels:
            return Kept.NOWHERE
        if config.offload_attention:
            return Kept.CPU
        return Kept.GPU if config.keep_attention else Kept.NOWHERE

    def may_keep_weights(self, backend: Backend) -> bool:
        """Whether what ``backend``'s regions keep on the device for their backward may hold a block's weight (a
        matmul's saved operand): a streamed block's copy then stays on the GPU until its backward, so the planner
        cannot bound a streamed candidate's memory by the resident one's plus the weights in flight
        (:func:`gradseam.tools.advise.keeps_no_weight_on_the_gpu`). Yes unless the kind knows otherwise."""
        return True

    def settings(self, config: CheckpointConfig) -> dict[str, Any]:
        """What of ``config`` each of its regions carries in its spec beyond the common fields (default: none)."""
        return {}

    # -- the family and the model -------------------------------------------------------------
    def check_family(self, backend: Backend, family: Family, config: CheckpointConfig) -> None:
        """Refuse what the family cannot run with this kind; warn where a setting cannot act as written."""

    def refuse_model(self, backend: Backend, model: nn.Module, family: Family) -> None:
        """Refuse, before anything is installed, a model this kind cannot patch as it is."""

    def changed_since(self, model: nn.Module, blocks: Sequence[nn.Module]) -> bool:
        """Whether the model changed since patching so that the patch must be planned again (which
        then refuses it by name, or plans around it). ``blocks``: the blocks as planned."""
        return False

    # -- words ----------------------------------------------------------------------------------
    def describe(self, region: Any, *, own: str, later: str) -> str:
        """What ``region`` (a :class:`gradseam.spec.RegionSpec` of this kind) does, in words. ``own``: the
        model's memory ("GPU"); ``later``: what to append while offloading waits for a GPU."""
        raise NotImplementedError

    def notes(self, views: Sequence[RegionView]) -> list[str]:
        """The summary's notes for its regions that ran otherwise than planned (default: one per region
        whose chain fell back, saying why)."""
        return [fallback_note(v) for v in views if v.fallbacks]

    def __repr__(self) -> str:
        return f"<region kind {self.name!r}>"

    def __reduce__(self) -> str:
        return self._global  # one instance per kind: a pickled or deep-copied plan keeps it

    _global: ClassVar[str] = ""


def fallback_note(region: RegionView) -> str:
    """A checkpoint region whose chain fell back to one region per member: how often, and why."""
    fell = sum(region.fallbacks.values())
    calls = region.calls[0] if region.calls else 0
    why = "; ".join(f"{n}x {cause}" for cause, n in sorted(region.fallbacks.items(), key=lambda kv: -kv[1]))
    return (f"{region.label}: ran as one chunk {region.chunk_calls} of {calls} calls; {fell} call(s) "
            f"fell back to one region per block because {why}")


def siblings(backend: Backend) -> Iterable[Backend]:
    """The catalog's other backends of the same kind and scope (``unsloth`` -> ``torch``)."""
    return (b for b in CATALOG.values() if b.kind == backend.kind and b.scope is backend.scope and b is not backend)


def staying_sibling(backend: Backend) -> Backend:
    """The backend that does what ``backend`` does (same kind, same scope) without moving anything off the
    device: what a CPU model can run instead, and what an offloading backend runs as while its model is
    on the CPU (``unsloth`` -> ``torch``, ``unsloth-ffn`` -> ``torch-ffn``, ``unsloth-compile`` -> ``compile``)."""
    if not backend.moves:
        return backend
    return next((b for b in siblings(backend) if not b.moves), backend)
