"""The named strategy rows that every tool compares: one table, derived from the backend catalog.

``gradseam bench``, ``gradseam advise``'s ladder, ``gradseam demo``, the conformance kit's
matrices, the test suite and the docs' scripts pick their rows from :data:`STRATEGIES` by label.
Each catalog backend gives its row, and the variants a backend supports (interval chunks, kept or
offloaded attention kernels, as its catalog entry says) give theirs, so a new backend appears in
every tool by being in the catalog. Whether a row needs CUDA follows from the plan's reading of its
config (:func:`gradseam.spec.strategy_of`), never from its name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..backends import CATALOG, Offload, Scope
from ..config import CheckpointConfig

if TYPE_CHECKING:
    from ..spec import Strategy

ON: dict[str, Any] = {"gradient_checkpointing": True}
INTERVAL = "gradient_checkpointing_interval"
STRIDE = "gradient_checkpointing_segment_stride"
BACKEND = "gradient_checkpointing_backend"
KEEP = "gradient_checkpointing_keep_attention"
BUDGET = "gradient_checkpointing_memory_budget"
OTHER_BUDGETS = (0.3, 0.05)  # beside the default (0.1): more kept and faster, less kept and slower
OFFLOAD_ATTENTION = "gradient_checkpointing_offload_attention"


@dataclass(frozen=True)
class NamedStrategy:
    label: str
    config: Mapping[str, Any]  # the gradseam keys as a user writes them; {} is no checkpointing

    @property
    def strategy(self) -> Strategy:
        from ..spec import strategy_of  # imports torch: the labels and configs above do not need it

        return strategy_of(CheckpointConfig.from_dict(dict(self.config)))

    @property
    def cpu_measurable(self) -> bool:
        """Whether the CPU tools can measure the row: offload needs a GPU, kept kernels escape their count,
        and compiled blocks are inductor's on a GPU (the CPU's aot_eager says nothing of their speed)."""
        strategy = self.strategy
        return strategy.cpu_measurable and not (strategy.backend is not None and strategy.backend.budget)


def _backend(name: str, **extra: Any) -> dict[str, Any]:
    return {**ON, BACKEND: name, **extra}


def _rows() -> list[tuple[str, dict[str, Any]]]:
    rows: list[tuple[str, dict[str, Any]]] = [("none", {})]
    for b in CATALOG.values():
        rows.append((b.name, _backend(b.name)))
        if b.budget:
            rows += [(f"{b.name}, budget {x:g}", _backend(b.name, **{BUDGET: x})) for x in OTHER_BUDGETS]
        if b.scope is Scope.BLOCK and b.offload is Offload.NOTHING:
            if b.chunks:
                rows.append((f"{b.name}, interval 2", _backend(b.name, **{INTERVAL: 2})))
                rows.append((f"{b.name}, interval 2, stride 4", _backend(b.name, **{INTERVAL: 2, STRIDE: 4})))
            if b.kept_attention:
                rows.append((f"{b.name} + attention kept", _backend(b.name, **{KEEP: True})))
    rows.append(("attention offload", {OFFLOAD_ATTENTION: True}))
    for b in CATALOG.values():
        if b.scope is Scope.FFN or b.kept_attention:
            rows.append((f"{b.name} + attention offload", _backend(b.name, **{OFFLOAD_ATTENTION: True})))
    return rows


STRATEGIES: tuple[NamedStrategy, ...] = tuple(NamedStrategy(label, config) for label, config in _rows())
BY_LABEL: dict[str, NamedStrategy] = {s.label: s for s in STRATEGIES}


def rows(*labels: str) -> list[tuple[str, dict[str, Any]]]:
    """``(label, config)`` for the given labels, in that order (a fresh dict per row)."""
    return [(label, dict(BY_LABEL[label].config)) for label in labels]


def needs_cuda(label: str) -> bool:
    """True for rows the CPU tools cannot measure (offload needs a GPU; kept kernels escape their count)."""
    return not BY_LABEL[label].cpu_measurable
