"""The named strategy rows that every tool compares: one table, derived from the backend catalog.

``gradseam bench``, ``gradseam advise``'s ladder, ``gradseam demo``, the conformance kit's
matrices, the test suite and the docs' scripts take their rows from :data:`STRATEGIES`, by label or
by property (:func:`select`), never by a backend's name. Each catalog backend gives its row, and the
variants its region kind supports give theirs (interval chunks, kept or offloaded attention kernels,
other compiler memory budgets), so a new backend appears in every tool by being in the catalog.

:data:`STRATEGIES` runs from the least aggressive to the most (:func:`rung`): no checkpointing; the
eager backends in the catalog's declared order (:attr:`gradseam.backends.Backend.ladder`), each with
its variants; attention offload, alone then beside each backend that takes it, in the same order;
then the compiled backends, each from the largest memory budget to the smallest. Whether a row
needs CUDA follows from the plan's reading of its config (:func:`gradseam.spec.strategy_of`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ..backends import Backend, Kept, Scope, by_ladder
from ..config import CheckpointConfig
from ..kinds import KINDS, RegionKind, backend_of, kind_of

if TYPE_CHECKING:
    from ..spec import Strategy

ON: dict[str, Any] = {"gradient_checkpointing": True}
INTERVAL = "gradient_checkpointing_interval"
STRIDE = "gradient_checkpointing_segment_stride"
BACKEND = "gradient_checkpointing_backend"
KEEP = "gradient_checkpointing_keep_attention"
BUDGET = "gradient_checkpointing_memory_budget"
OTHER_BUDGETS = (0.3, 0.05, 0.0)  # beside the default (0.1): more kept and faster, less kept and slower; 0: inputs only
OFFLOAD_ATTENTION = "gradient_checkpointing_offload_attention"


@dataclass(frozen=True)
class NamedStrategy:
    """One row: its label and the gradseam keys as a user writes them ({} is no checkpointing).

    The properties read the config through the catalog and the region kinds, without torch, so the
    tools select rows by what they do (:func:`select`) before any heavy import.
    """

    label: str
    config: Mapping[str, Any]

    @cached_property
    def settings(self) -> CheckpointConfig:
        return CheckpointConfig.from_dict(dict(self.config))

    @property
    def backend(self) -> Backend | None:
        """The catalog entry it runs; None when checkpointing is off."""
        return backend_of(self.settings)

    @property
    def kind(self) -> RegionKind | None:
        return kind_of(self.backend)

    @property
    def ladder(self) -> int:
        """Its backend's place on the catalog's ladder (0 without a backend)."""
        return self.backend.ladder if self.backend is not None else 0

    @property
    def patches(self) -> bool:
        """Whether gradseam patches anything for it (False for "none")."""
        return self.backend is not None or self.attention_offload

    @property
    def compiles(self) -> bool:
        """Whether its regions run through ``torch.compile``."""
        return self.kind is not None and self.kind.compiles

    @property
    def attention_offload(self) -> bool:
        return self.settings.offload_attention

    @property
    def kept(self) -> Kept:
        """Where its regions keep attention kernel outputs (nowhere unless its kind keeps kernels)."""
        return self.kind.kept(self.settings) if self.kind is not None else Kept.NOWHERE

    @property
    def kept_apart(self) -> bool:
        """Whether it keeps kernel outputs somewhere else than where its backend keeps what it saves
        (kernel outputs in CPU memory beside regions that stay on the device)."""
        if self.kept is Kept.NOWHERE or self.backend is None:
            return False
        return (self.kept is Kept.CPU) != self.backend.moves

    @property
    def chunked(self) -> bool:
        """Whether its regions span several blocks (an interval)."""
        return self.settings.interval > 1

    @property
    def strided(self) -> bool:
        """Whether a stride leaves some blocks out of its regions."""
        return self.settings.stride is not None

    @property
    def budget(self) -> float | None:
        """The compiler memory budget the row sets, or None where it keeps the default."""
        return self.settings.gradient_checkpointing_memory_budget

    @property
    def repeats_compiler(self) -> bool:
        """Whether the compiler alone runs the same thing: another memory budget on a compiled backend
        that keeps everything on the device is what the compiler's own memory-budget rows measure
        (bench's references, advise's compiler rungs), so the tools that compare leave it to them."""
        return self.budget is not None and self.compiles and not (self.backend is not None and self.backend.moves)

    @property
    def strategy(self) -> Strategy:
        from ..spec import strategy_of  # imports torch: the labels and configs above do not need it

        return strategy_of(self.settings)

    @property
    def cpu_measurable(self) -> bool:
        """Whether the CPU tools can measure the row: offload needs a GPU, kept kernels escape their count,
        and compiled blocks are inductor's on a GPU (the CPU's aot_eager says nothing of their speed)."""
        return self.strategy.cpu_measurable


def rung(s: NamedStrategy) -> tuple[bool, bool, int, float]:
    """Its place from the least aggressive to the most: compiled rows last, attention offload after the
    eager rows, then the catalog's ladder, then (compiled) the larger memory budget first."""
    return (s.compiles, s.attention_offload, s.ladder, -s.settings.memory_budget if s.compiles else 0.0)


def _backend(name: str, **extra: Any) -> dict[str, Any]:
    return {**ON, BACKEND: name, **extra}


def _variants(b: Backend) -> list[tuple[str, dict[str, Any]]]:
    """A backend's row and the variants its kind supports, in the order a stable sort keeps."""
    kind = KINDS[b.kind]
    found = [(b.name, _backend(b.name))]
    if kind.compiles:
        found += [(f"{b.name}, budget {x:g}", _backend(b.name, **{BUDGET: x})) for x in OTHER_BUDGETS]
    if b.scope is Scope.BLOCK and not b.moves:
        if kind.chunks:
            found.append((f"{b.name}, interval 2", _backend(b.name, **{INTERVAL: 2})))
            found.append((f"{b.name}, interval 2, stride 4", _backend(b.name, **{INTERVAL: 2, STRIDE: 4})))
        if kind.keeps_kernels:
            found.append((f"{b.name} + attention kept", _backend(b.name, **{KEEP: True})))
    if b.scope is Scope.FFN or kind.keeps_kernels:
        found.append((f"{b.name} + attention offload", _backend(b.name, **{OFFLOAD_ATTENTION: True})))
    return found


def _table() -> tuple[NamedStrategy, ...]:
    found = [NamedStrategy("none", {}), NamedStrategy("attention offload", {OFFLOAD_ATTENTION: True})]
    for b in by_ladder():
        found += [NamedStrategy(label, config) for label, config in _variants(b)]
    return tuple(sorted(found, key=rung))


STRATEGIES: tuple[NamedStrategy, ...] = _table()
BY_LABEL: dict[str, NamedStrategy] = {s.label: s for s in STRATEGIES}
_PROPERTIES = frozenset({"label", *(f.name for f in fields(NamedStrategy)),
                         *(name for name, v in vars(NamedStrategy).items() if isinstance(v, (property, cached_property)))})


def select(**wanted: Any) -> list[NamedStrategy]:
    """The named strategies whose properties equal ``wanted``, least aggressive first.

    ``select(compiles=False)``: the eager rows; ``select(patches=True, strided=False)``: every row that
    patches something and checkpoints every block. Any :class:`NamedStrategy` property may be asked.
    """
    unknown = sorted(set(wanted) - _PROPERTIES)
    if unknown:
        raise TypeError(f"select(): named strategies have no property {unknown}; known: {sorted(_PROPERTIES)}")
    return [s for s in STRATEGIES if all(getattr(s, k) == v for k, v in wanted.items())]


def compared(**wanted: Any) -> list[NamedStrategy]:
    """:func:`select` among the rows the comparing tools measure (bench, advise): every named strategy
    but those the compiler's own memory-budget rows already measure (:attr:`NamedStrategy.repeats_compiler`)."""
    return select(repeats_compiler=False, **wanted)


def kept_kernel_variants() -> list[NamedStrategy]:
    """The variants that keep attention kernel outputs where their backend keeps what it saves: one per
    place (on the device beside on-device regions, in CPU memory beside offloading ones)."""
    return [s for s in select(kept_apart=False) if s.kept is not Kept.NOWHERE]


def rows_of(strategies: Iterable[NamedStrategy]) -> list[tuple[str, dict[str, Any]]]:
    """``(label, config)`` for each strategy, in that order (a fresh dict per row)."""
    return [(s.label, dict(s.config)) for s in strategies]


def rows(*labels: str) -> list[tuple[str, dict[str, Any]]]:
    """``(label, config)`` for the given labels, in that order (a fresh dict per row)."""
    return rows_of(BY_LABEL[label] for label in labels)


def needs_cuda(label: str) -> bool:
    """True for rows the CPU tools cannot measure (offload needs a GPU; kept kernels escape their count)."""
    return not BY_LABEL[label].cpu_measurable
