"""What a plan is made of: a region's kind and shape, where its kept kernel outputs live, how its members
link, the strategy a config resolves to, and the immutable :class:`RegionSpec` / :class:`Plan` that
:mod:`gradseam.planning` produces.

Data only, kept apart from the planning algorithm so that everything that *reads* a plan (the run
layer's install step, the summary, ``handle.regions()``, the kit, bench and advise) depends on
these types and not on how a model is searched for regions or why a configuration is refused.
What a region *does* is its kind's (:mod:`gradseam.kinds`); a spec only names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import cached_property

from torch import nn

from .backends import Backend, Destination, Kept, Offload
from .config import CheckpointConfig
from .family import Carry, Family
from .kinds import RegionKind, backend_of, kind_of

# -- what a region is -------------------------------------------------------------------------


class Shape(str, Enum):
    """What a region covers. A ``str`` enum, so ``shape == "chunk"`` reads as it always did."""

    BLOCK = "block"  # one block
    CHUNK = "chunk"  # consecutive blocks run as one region (interval)
    FFN = "ffn"  # a feed-forward seam inside a block
    ATTENTION = "attention"  # an attention submodule outside any checkpoint region

    def __str__(self) -> str:
        return self.value


class LinkKind(str, Enum):
    """How a region's later members are called from the previous one's output."""

    NONE = "none"  # a region of one module
    BLOCKS = "blocks"  # blocks of one list: the Carry says which outputs feed which parameters
    SEAM = "seam"  # submodules of one FFN seam, each on the previous one's output


@dataclass(frozen=True)
class Strategy:
    """What a config asks of every region, resolved once from the config, the catalog and the kinds.

    ``backend`` / ``kind`` are None when checkpointing is off. ``kept`` applies to the kind's regions
    that keep attention kernel outputs; ``attention_offload`` to attention submodules outside any
    region (beside the ``-ffn`` backends, in blocks a stride leaves out, or alone).
    """

    backend: Backend | None
    kind: RegionKind | None
    kept: Kept
    attention_offload: bool

    @property
    def destinations(self) -> frozenset[Destination]:
        """Where its regions move activations off the model's device: empty when nothing moves."""
        found = set()
        if self.backend is not None and self.backend.moves:
            found.add(self.backend.destination)
        if self.kept is Kept.CPU or self.attention_offload:
            found.add(Destination.HOST)
        return frozenset(found)

    @property
    def cpu_measurable(self) -> bool:
        """Whether the CPU tools can measure it: they count what saved-tensor hooks see, so nothing may move
        off the device and no kept kernel output may escape the count; and a compiled block on the CPU
        (``aot_eager``) says nothing of inductor's GPU graphs."""
        return not self.destinations and self.kept is Kept.NOWHERE and not (self.kind and self.kind.compiles)

    def offloaded(self) -> list[str]:
        """What moves activations off the device, in the config's words (for errors and warnings)."""
        wants = [f"backend {self.backend.name!r}"] if self.backend is not None and self.backend.moves else []
        if self.attention_offload:
            wants.append("gradient_checkpointing_offload_attention")
        return wants


def strategy_of(config: CheckpointConfig) -> Strategy:
    """The one reading of a config: backend, kind, kept kernels, attention offload (model-free; tools use it)."""
    backend = backend_of(config)
    kind = kind_of(backend)
    kept = kind.kept(config) if kind is not None else Kept.NOWHERE
    return Strategy(backend, kind, kept, config.offload_attention)


@dataclass(frozen=True, eq=False)
class RegionSpec:
    """One planned region, resolved: which modules, and exactly how it runs. Never changed after planning.

    ``modules`` are the modules as planned (a PEFT layer that later replaces a seam's Linear is
    followed by the installed chain, not written back here). ``kind`` gives its behaviour and names
    its runner; ``offload`` / ``destination`` what leaves the device and where to; ``kept`` where
    attention kernel outputs stay, matched by operator against ``kernels`` (schema names);
    ``carry`` / ``per_block`` describe a chunk's link; ``memory_budget`` is what a kind that compiles
    reads (the compiler's activation fraction).
    """

    list_path: str
    blocks: tuple[int, ...]  # indices in the block list
    kind: RegionKind
    shape: Shape
    modules: tuple[nn.Module, ...]
    seam: tuple[str, ...] = ()  # submodule paths for ffn/attention regions
    block_class: str = ""
    backend: str = ""  # the catalog entry's name, for words only
    offload: Offload = Offload.NOTHING
    destination: Destination = Destination.DEVICE
    memory_budget: float | None = None
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
    def moves(self) -> bool:
        """Whether the region moves something off the device (through the engine of its destination)."""
        return self.destination is not Destination.DEVICE


@dataclass(frozen=True)
class StoreSpec:
    """A place the plan's regions offload to, and its size: the handle makes the engine's store from it
    (:mod:`gradseam.offload.stores`)."""

    destination: Destination
    max_buckets: int  # gradient_checkpointing_offload_pin_memory_max_buckets: the pinned pool's size classes


@dataclass(frozen=True)
class Plan:
    family: Family
    config: CheckpointConfig
    strategy: Strategy
    regions: tuple[RegionSpec, ...] = ()
    plain: tuple[tuple[str, int, str], ...] = ()  # blocks left as they are
    stores: tuple[StoreSpec, ...] = ()  # one per destination its regions move activations to
    streamed: tuple[tuple[str, int], ...] = ()  # (block list, index) of the blocks whose frozen weights stream
    # every strategy its regions run: ``strategy`` alone, or one per config of gradient_checkpointing_blocks
    strategies: tuple[Strategy, ...] = ()

    def offloaded(self) -> list[str]:
        """What moves activations off the device, in the config's words, over every strategy its blocks run."""
        return list(dict.fromkeys(w for s in (self.strategies or (self.strategy,)) for w in s.offloaded()))

    @cached_property
    def kinds(self) -> tuple[RegionKind, ...]:
        """The kinds of its regions, each once, in plan order (read before every forward: worked out once)."""
        return tuple(dict.fromkeys(r.kind for r in self.regions))
