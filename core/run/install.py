"""The one install step: a plan's region specs become seams, chains and scopes on the model.

The plan (:mod:`gradseam.planning`) has decided everything: each :class:`RegionSpec` names its
kind, what it offloads and where, where kept kernel outputs live, and how its members are linked.
Here each spec is handed to its kind's runner in :data:`RUNNERS`, which installs what runs it;
nothing here reads the config, and nothing but the table below names a kind. A kind whose regions
install differently is one function in :data:`RUNNERS`.

:class:`Installation` also keeps the installed seams in place while the model changes under them:
PEFT (``add_adapter``, ``get_peft_model``) replaces each targeted ``nn.Linear`` with a LoRA layer
that calls the original as its ``base_layer``. A seam on the Linear itself (Flux's single-block FFN
seam starts at ``proj_mlp``) would then see only the base output, the chain would fall back to
per-member regions and stop saving memory. Before each forward the handle calls :meth:`follow`,
which moves each submodule seam to whatever module now sits at its place (and back on unload).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..backends import Destination, Kept, Offload
from ..errors import UnsupportedModelError
from ..modules import resolve, unwrap
from ..spec import LinkKind, Plan, RegionSpec, Shape
from . import seams
from .chains import Chain, ChainStats, Runner
from .compiled import CompiledBlocks, CompiledMember
from .kernels import TapeSite, kernel_set
from .links import BlockLink, Link, SeamLink
from .scopes import AttentionOffload, RegionScope


@dataclass
class Context:
    """What every runner may use: the patched model (owner of the seams) and its offload engines."""

    model: nn.Module
    engines: dict[Destination, Any]  # an OffloadEngine per destination the plan moves activations to
    family: str = ""  # for errors about the family's declarations
    compiled: dict[tuple[float, str], CompiledBlocks] = field(default_factory=dict)  # shared per handle

    def engine(self, spec: RegionSpec) -> Any:
        """The engine of the spec's destination, or None for a region that moves nothing."""
        if not spec.moves:
            return None
        assert spec.destination in self.engines, "the plan names this destination, so the handle made its engine"
        return self.engines[spec.destination]


@dataclass
class Installed:
    """What one spec became: its seams (in install order), its chain if it is a checkpoint region."""

    spec: RegionSpec
    seams: list[seams.SeamForward] = field(default_factory=list)
    chain: Chain | None = None
    stats: ChainStats | None = None  # kept after remove(): handle.regions() still reads the counts


def _link(spec: RegionSpec, ctx: Context) -> Link | None:
    if spec.link is LinkKind.BLOCKS:
        assert spec.carry is not None
        where = f"family {ctx.family!r}, block list {spec.list_path!r}"
        return BlockLink(spec.carry, where=where, per_block=spec.per_block)
    if spec.link is LinkKind.SEAM:
        return SeamLink()
    return None


def _scope(spec: RegionSpec, ctx: Context, stats: ChainStats) -> RegionScope | None:
    kernels = kernel_set(spec.kernels) if spec.kept is not Kept.NOWHERE else None
    inputs = spec.offload is Offload.INPUTS
    if not inputs and kernels is None:
        return None
    scoped = bool(spec.attention)  # kernel modes only inside the declared attention submodules
    return RegionScope(ctx.engine(spec), inputs=inputs, kernels=kernels, scoped=scoped, missed=_Missed(stats))


REPLAY_MISSED = "a kept attention kernel output did not match the recomputed call (computed again)"


class _Missed:
    """Counts replays that ran the kernel for real (a plain object, so a patched model still pickles)."""

    __slots__ = ("stats",)

    def __init__(self, stats: ChainStats) -> None:
        self.stats = stats

    def __call__(self) -> None:
        self.stats.fallbacks[REPLAY_MISSED] += 1


def checkpoint_region(spec: RegionSpec, ctx: Context) -> Installed:
    """A chain of modules run as one non-reentrant ``torch.utils.checkpoint`` per call."""
    stats = ChainStats([0] * len(spec.modules))
    chain = Chain(spec.modules, _link(spec, ctx), Runner(_scope(spec, ctx, stats)), label=spec.label, stats=stats)
    done = Installed(spec, chain=chain, stats=stats)
    for index, module in enumerate(spec.modules):
        seam = seams.install(module, chain.handler(index), owner=ctx.model)
        chain.attach(index, seam.original)
        done.seams.append(seam)
    if spec.kept is not Kept.NOWHERE:  # where the kernel modes are entered (see gradseam.run.kernels)
        site = TapeSite()
        for block in spec.modules:
            for path in spec.attention:
                sub = resolve(block, path)
                if isinstance(sub, nn.Module):
                    done.seams.append(seams.install(sub, site, owner=ctx.model))
    return done


def attention_offload(spec: RegionSpec, ctx: Context) -> Installed:
    """An attention submodule outside any region: everything it saves goes to the engine."""
    stats = ChainStats([0])
    handler = AttentionOffload(ctx.engine(spec), stats.member_calls)
    return Installed(spec, seams=[seams.install(spec.modules[0], handler, owner=ctx.model)], stats=stats)


def compiled_region(spec: RegionSpec, ctx: Context) -> Installed:
    """One block run through ``torch.compile`` under the spec's memory budget (:mod:`gradseam.run.compiled`);
    what it keeps goes to the engine when the spec offloads it. Blocks of one handle share the compiled
    function of their budget and offload, so blocks of a class compile once."""
    assert spec.memory_budget is not None and len(spec.modules) == 1
    key = (spec.memory_budget, spec.backend)
    blocks = ctx.compiled.get(key)
    if blocks is None:
        blocks = ctx.compiled[key] = CompiledBlocks(spec.memory_budget, ctx.engine(spec), backend=spec.backend)
    stats = ChainStats([0])
    seam = seams.install(spec.modules[0], CompiledMember(blocks, stats, spec.attention), owner=ctx.model)
    return Installed(spec, seams=[seam], stats=stats)


# Each kind's runner, by the kind's name (gradseam.kinds.KINDS): the only table here that names kinds.
RUNNERS: dict[str, Callable[[RegionSpec, Context], Installed]] = {
    "whole-block": checkpoint_region,
    "ffn-seam": checkpoint_region,
    "attention-offload": attention_offload,
    "compiled-block": compiled_region,
}


class _Slot:
    """Where a seam on a block's submodule sits, so that a replaced submodule can be followed."""

    __slots__ = ("chain", "index", "name", "parent", "position", "seam", "where")

    def __init__(self, parent: nn.Module, name: str, seam: seams.SeamForward, chain: Chain | None, index: int,
                 where: str, position: tuple[int, int]) -> None:
        self.parent, self.name, self.seam, self.chain, self.index, self.where = parent, name, seam, chain, index, where
        self.position = position  # (installed region, seam) indices, to replace the seam in place


class Installation:
    """Everything a plan installed on a model, with how to follow replaced submodules and undo it."""

    def __init__(self, plan: Plan, model: nn.Module, engines: dict[Destination, Any]) -> None:
        ctx = Context(model, engines, plan.family.name)
        self.model = model
        self.regions = [RUNNERS[spec.kind.name](spec, ctx) for spec in plan.regions]
        self.compiled = ctx.compiled  # the compiled functions' owners (compiled regions), dropped on remove()
        self._slots: list[_Slot] = []
        for r, done in enumerate(self.regions):
            spec = done.spec
            if spec.shape in (Shape.FFN, Shape.ATTENTION):
                for index in range(len(spec.modules)):
                    self._watch(done, r, index)

    @property
    def chains(self) -> list[Chain]:
        return [r.chain for r in self.regions if r.chain is not None]

    def _watch(self, done: Installed, r: int, index: int) -> None:
        spec = done.spec
        block = unwrap(resolve(self.model, spec.list_path)[spec.blocks[0]])
        parent_path, _, name = spec.seam[index].rpartition(".")
        parent = resolve(block, parent_path) if parent_path else block
        where = f"{spec.list_path}[{spec.blocks[0]}].{spec.seam[index]}"
        self._slots.append(_Slot(parent, name, done.seams[index], done.chain, index, where, (r, index)))

    def follow(self) -> None:
        """Move each submodule seam to the module now at its place, if something replaced it."""
        for slot in self._slots:
            old = slot.seam
            current = slot.parent._modules.get(slot.name)
            if current is old.module:
                continue
            if current is None:
                raise UnsupportedModelError(
                    f"{type(self.model).__name__}.{slot.where} was removed after gradseam patched it; "
                    "patch the model again (gradseam.patch replaces the old patch)."
                )
            handler = old.handler
            seams.uninstall(old)
            new = seams.install(current, handler, owner=self.model)  # type: ignore[arg-type]
            if slot.chain is not None:
                slot.chain.members[slot.index] = current
                slot.chain.attach(slot.index, new.original)
            r, i = slot.position
            self.regions[r].seams[i] = new
            slot.seam = new

    def remove(self) -> None:
        for done in reversed(self.regions):
            for seam in reversed(done.seams):
                seams.uninstall(seam)
            done.seams.clear()
            done.chain = None
        self._slots.clear()
        for blocks in self.compiled.values():
            blocks.close()
        self.compiled.clear()
