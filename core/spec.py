"""What a plan is made of: a region's kind, where its kept kernel outputs live, how its members link,
the strategy a config resolves to, and the immutable :class:`RegionSpec` / :class:`Plan` that
:mod:`gradseam.planning` produces.

Data only, kept apart from the planning algorithm so that everything that *reads* a plan (the run
layer's install step, the summary, ``handle.regions()``, the kit, bench and advise) depends on
these types and not on how a model is searched for regions or why a configuration is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from torch import nn

from .backends import CATALOG, Backend, Offload, Scope
from .config import CheckpointConfig
from .family import Carry, Family

# -- what a region is -------------------------------------------------------------------------


class Kind(str, Enum):
    """What a region is. A ``str`` enum, so ``kind == "chunk"`` reads as it always did."""

    BLOCK = "block"  # one block, one checkpoint region
    CHUNK = "chunk"  # consecutive blocks run as one checkpoint region (interval)
    FFN = "ffn"  # a feed-forward seam inside a block
    ATTENTION_OFFLOAD = "attention-offload"  # an attention submodule outside any region: its saved tensors offloaded

    def __str__(self) -> str:
        return self.value


class Kept(str, Enum):
    """Where a whole-block region keeps attention kernel outputs instead of recomputing them."""

    NOWHERE = ""  # recomputed with the rest of the block
    GPU = "gpu"
    CPU = "cpu"  # in host memory, through the offload engine

    def __str__(self) -> str:
        return self.value


class LinkKind(str, Enum):
    """How a region's later members are called from the previous one's output."""

    NONE = "none"  # a region of one module
    BLOCKS = "blocks"  # blocks of one list: the Carry says which outputs feed which parameters
    SEAM = "seam"  # submodules of one FFN seam, each on the previous one's output


@dataclass(frozen=True)
class Strategy:
    """What a config asks of every region, resolved once from the config and the backend catalog.

    ``backend`` is None when checkpointing is off. ``kept`` applies to whole-block regions;
    ``attention_offload`` to attention submodules outside any region (beside the ``-ffn`` backends,
    in blocks a stride leaves out, or alone).
    """

    backend: Backend | None
    kept: Kept
    attention_offload: bool

    @property
    def scope(self) -> Scope | None:
        return self.backend.scope if self.backend is not None else None

    @property
    def offload(self) -> Offload:
        return self.backend.offload if self.backend is not None else Offload.NOTHING

    @property
    def offload_inputs(self) -> bool:
        return self.offload is Offload.INPUTS

    @property
    def needs_engine(self) -> bool:
        """Something is moved to host memory: the model must be on a GPU (the offload engine)."""
        return self.offload is not Offload.NOTHING or self.kept is Kept.CPU or self.attention_offload

    @property
    def cpu_measurable(self) -> bool:
        """Whether the CPU tools can measure it: they count what saved-tensor hooks see, and kept kernel
        outputs never pass through those hooks (the count would be too low)."""
        return not self.needs_engine and self.kept is Kept.NOWHERE

    def offloaded(self) -> list[str]:
        """What moves activations to host memory, in the config's words (for errors and warnings)."""
        wants = [f"backend {self.backend.name!r}"] if self.backend is not None and self.backend.offloads else []
        if self.attention_offload:
            wants.append("gradient_checkpointing_offload_attention")
        return wants


def strategy_of(config: CheckpointConfig) -> Strategy:
    """The one reading of a config: scope, offload and kept kernels (model-free; tools use it too)."""
    backend = CATALOG[config.backend] if config.enabled else None
    whole = backend is not None and backend.scope is Scope.BLOCK
    kept = Kept.NOWHERE
    if whole and config.offload_attention:
        kept = Kept.CPU
    elif whole and config.keep_attention:
        kept = Kept.GPU
    return Strategy(backend, kept, config.offload_attention)


@dataclass(frozen=True, eq=False)
class RegionSpec:
    """One planned region, resolved: which modules, and exactly how it runs. Never changed after planning.

    ``modules`` are the modules as planned (a PEFT layer that later replaces a seam's Linear is
    followed by the installed chain, not written back here). ``runner`` names the run layer's runner
    (the backend's, or "attention-offload"); ``offload_inputs`` puts the region's inputs in host
    memory; ``kept`` says where attention kernel outputs stay, matched by operator against
    ``kernels`` (schema names); ``carry`` / ``per_block`` describe a chunk's link.
    """

    list_path: str
    blocks: tuple[int, ...]  # indices in the block list
    kind: Kind
    modules: tuple[nn.Module, ...]
    seam: tuple[str, ...] = ()  # submodule paths for ffn/attention regions
    block_class: str = ""
    runner: str = "checkpoint"
    backend: str = ""  # the catalog entry's name, for words only
    offload: Offload = Offload.NOTHING
    budget: float | None = None  # the compiler's activation memory budget (compiled regions)
    kept: Kept = Kept.NOWHERE
    kernels: frozenset[str] = frozenset()
    link: LinkKind = LinkKind.NONE
    carry: Carry | None = None
    per_block: tuple[str, ...] = ()
    attention: tuple[str, ...] = ()  # the blocks' attention submodules, where kept kernels are looked for

    @property
    def label(self) -> str:
        return f"{self.list_path}{list(self.blocks)}" + (f".{'→'.join(self.seam)}" if self.seam else "")

    @property
    def offload_inputs(self) -> bool:
        return self.offload is Offload.INPUTS

    @property
    def offloads(self) -> bool:
        """The region moves something to host memory (through the engine)."""
        return self.offload is not Offload.NOTHING or self.kept is Kept.CPU


@dataclass(frozen=True)
class Plan:
    family: Family
    config: CheckpointConfig
    strategy: Strategy
    regions: tuple[RegionSpec, ...] = ()
    plain: tuple[tuple[str, int, str], ...] = ()  # blocks left as they are

    @property
    def needs_engine(self) -> bool:
        return any(r.offloads for r in self.regions)

    @property
    def compiled(self) -> bool:
        """Some region compiles its block (a compiled backend): the user must not compile it too."""
        return any(r.budget is not None for r in self.regions)
