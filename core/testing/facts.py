"""What the kit reads of the backend catalog, the strategy a config resolves to, and a region's shape.

The kit derives its matrices and its checks from facts the runtime owns (which backends offload,
which compile, which chunk or keep attention kernels, how exact a backend is, what a region covers).
Those facts move when the catalog or the strategy changes shape, so every reading of them is here,
in one small function each, and the rest of the kit calls only these: a change to
:mod:`gradseam.backends`, :mod:`gradseam.kinds` or :mod:`gradseam.spec` is rewired here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..backends import CATALOG, Kept, Scope
from ..config import CheckpointConfig
from ..kinds import KINDS, kind_of
from ..spec import Shape, Strategy, strategy_of
from ..summary import RegionView

# The loosest tolerance any region kind declares (the compiled kind's: its compiler sums gradient
# contributions in its own order; fp32 on the CPU differs by ~1e-8 there): for tests of compiled rows.
COMPILED_TOLERANCE = max(kind.tolerance for kind in KINDS.values())


def strategy_for(config: CheckpointConfig | dict[str, Any]) -> Strategy:
    """What ``config`` asks of every region (the runtime's one reading of a config)."""
    return strategy_of(CheckpointConfig.coerce(config))


def tolerance(strategy: Strategy) -> float:
    """How far the strategy's results may be from the unpatched model's on the CPU (0.0: bit for bit)."""
    kind = strategy.kind
    return kind.tolerance if kind is not None else 0.0


def moves_to_host(strategy: Strategy) -> bool:
    """Whether the strategy moves activations off the device, so that it installs an offload engine."""
    return bool(strategy.destinations)


def keeps_kernels(strategy: Strategy) -> bool:
    """Whether checkpointed regions keep attention kernel outputs (on the device or offloaded)."""
    return strategy.kept is not Kept.NOWHERE


def checks_ffn(strategy: Strategy) -> bool:
    """Whether the strategy's regions are the family's FFN seams (the ``-ffn`` backends)."""
    return strategy.backend is not None and strategy.backend.scope is Scope.FFN


def compiles(config: CheckpointConfig | dict[str, Any]) -> bool:
    """Whether ``config`` runs compiled blocks (5-90 s of compiling per family on a CPU: the kit's
    ``compiled`` rows)."""
    kind = strategy_for(config).kind
    return kind is not None and kind.compiles


def is_chunk(region: RegionView) -> bool:
    """The region covers consecutive blocks run as one (``interval``)."""
    return region.shape is Shape.CHUNK


def is_attention_offload(region: RegionView) -> bool:
    """The region is an attention submodule whose saved tensors are offloaded, outside any checkpoint."""
    return region.shape is Shape.ATTENTION


@dataclass(frozen=True)
class BackendFacts:
    """One catalog backend as the kit's matrices see it.

    ``ffn``: its regions are the FFN seams (else whole blocks); ``moves``: it offloads (its rows go
    through the offload engine's CPU test mode); ``compiles``: compiled blocks; ``interval``: it takes
    ``gradient_checkpointing_interval`` (and a stride); ``keeps_kernels``: its regions may keep attention
    kernel outputs (``..._keep_attention`` / ``..._offload_attention``).
    """

    name: str
    ffn: bool
    moves: bool
    compiles: bool
    interval: bool
    keeps_kernels: bool


def backends() -> list[BackendFacts]:
    """Every catalog backend, in catalog order."""
    found = []
    for b in CATALOG.values():
        kind = kind_of(b)
        assert kind is not None
        found.append(BackendFacts(b.name, ffn=b.scope is Scope.FFN, moves=b.moves, compiles=kind.compiles,
                                  interval=kind.takes_interval, keeps_kernels=kind.keeps_kernels))
    return found
