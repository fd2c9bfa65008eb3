"""Depth-true figures: measure a model at two depths, fit what each block adds, speak for the real depth.

A peak measured on a truncated model hides what decides whether a job fits: how much each block
adds. On Wan 2.1 14B, ``unsloth-ffn`` + attention offload keeps 11.4 GiB at 4 blocks against
``torch``'s 9.9, which looks close; at the real 40 blocks it is ~80 GiB against ~21. So every tool
that reports a peak measures it at two depths and fits ``peak(d) = fixed + growth * d``; the
figure it shows first is the one at the model's real depth, measured where that fits, predicted
and marked otherwise.

A *depth* keeps every block list in its real proportion, so the fit sees every kind of block grow
at its real rate: Flux's 19 double- and 38 single-stream blocks make a unit of 1 + 2 blocks, and
depth 4 is 4 + 8 blocks. Lists whose lengths share no useful common factor fall back to scaling
each list by ``depth / longest`` and rounding (at least one block each); :attr:`DepthPlan.exact`
says which.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..family import Family


def resolve(root: Any, path: str) -> Any:
    """The attribute at a dotted ``path`` of ``root``, or None where a part is missing."""
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


@dataclass(frozen=True)
class DepthPlan:
    """How the block lists of one model shrink with depth."""

    totals: Mapping[str, int]  # block-list path -> the real model's block count

    @property
    def unit(self) -> dict[str, int]:
        """Blocks per list in one depth unit (the lists' real counts divided by their common factor)."""
        return {path: n // self._factor for path, n in self.totals.items()}

    @property
    def _factor(self) -> int:
        counts = [n for n in self.totals.values() if n > 0]
        factor = math.gcd(*counts) if counts else 1
        # a common factor of 1 or 2 leaves too few depths to fit from: scale by the longest list instead
        return factor if factor >= 3 or len(counts) == 1 else 1

    @property
    def exact(self) -> bool:
        """True when every depth keeps every list in exactly its real proportion."""
        return self._factor > 1 or len([n for n in self.totals.values() if n > 0]) == 1

    @property
    def full(self) -> int:
        """The real model's depth in units."""
        return self._factor if self.exact else max(self.totals.values(), default=0)

    def counts(self, depth: int) -> dict[str, int]:
        """Blocks kept per list at ``depth`` (1 <= depth <= :attr:`full`)."""
        if not 1 <= depth <= self.full:
            raise ValueError(f"depth must be between 1 and the model's full depth {self.full}, got {depth}.")
        if self.exact:
            return {path: n * depth for path, n in self.unit.items()}
        longest = self.full
        return {path: min(n, max(1, round(n * depth / longest))) for path, n in self.totals.items()}

    def describe(self, depth: int) -> str:
        counts = self.counts(depth)
        return " + ".join(str(n) for n in counts.values()) + " blocks"

    def unit_note(self) -> str:
        if len(self.totals) == 1:
            return "one unit of depth = one block"
        if not self.exact:
            return "depth = blocks of the longest list; the other lists scaled to it and rounded (approximate)"
        parts = ", ".join(f"{n} x {path.rsplit('.', 1)[-1]}" for path, n in self.unit.items())
        return f"one unit of depth = {parts}"


def plan_for(model: nn.Module, family: Family) -> DepthPlan:
    """The depth plan of ``model`` as built (call it before any truncation)."""
    totals = {}
    for block_list in family.block_lists:
        blocks = resolve(model, block_list.path)
        if blocks is not None and len(blocks):
            totals[block_list.path] = len(blocks)
    return DepthPlan(totals)


def cut(model: nn.Module, counts: Mapping[str, int]) -> list[tuple[str, Any, str, nn.ModuleList]]:
    """Keep the first ``counts[path]`` blocks of each list; ``(path, parent, attr, original)`` per list cut.

    The one place that shortens block lists: :func:`at_depth` puts the originals back,
    :func:`gradseam.tools.workloads.build` drops them for good (freeing their weights).
    """
    replaced = []
    for path, n in counts.items():
        parent_path, _, attr = path.rpartition(".")
        parent = resolve(model, parent_path) if parent_path else model
        original = getattr(parent, attr, None)
        if original is not None and n < len(original):
            setattr(parent, attr, nn.ModuleList(list(original)[:n]))
            replaced.append((path, parent, attr, original))
    return replaced


@contextmanager
def at_depth(model: nn.Module, plan: DepthPlan, depth: int) -> Iterator[dict[str, int]]:
    """Run ``model`` with only the first blocks of each list that ``depth`` keeps; restores on exit.

    The blocks stay allocated (the weights are static memory, not activations), so one model
    built at the deepest depth serves every shallower one.
    """
    counts = plan.counts(depth)
    replaced = cut(model, counts)
    try:
        yield counts
    finally:
        for _, parent, attr, original in reversed(replaced):
            setattr(parent, attr, original)


@dataclass(frozen=True)
class LinearFit:
    """``value(d) = fixed + growth * d`` through two measured depths."""

    depths: tuple[int, int]
    values: tuple[float, float]

    @property
    def growth(self) -> float:
        (d1, d2), (v1, v2) = self.depths, self.values
        return (v2 - v1) / (d2 - d1)

    @property
    def fixed(self) -> float:
        return self.values[0] - self.growth * self.depths[0]

    def at(self, depth: int) -> float:
        return self.fixed + self.growth * depth


def fit(depths: tuple[int, int], values: tuple[float, float]) -> LinearFit:
    if depths[0] == depths[1]:
        raise ValueError(f"a fit needs two different depths, got {depths[0]} twice.")
    return LinearFit(depths, values)


def parse_depths(text: str | None, full: int) -> tuple[int, int]:
    """``"2,4"`` -> (2, 4); None -> two small depths of the model (2 and 4 units, or what it has)."""
    if text is None:
        if full >= 4:
            return (2, 4)
        if full >= 2:
            return (1, 2)
        raise ValueError("the model has one unit of depth only; there is nothing to fit, measure it with --full.")
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if len(values) != 2 or values[0] == values[1] or min(values) < 1:
        raise ValueError(f"--depths: expected two different depths >= 1 like '2,4', got {text!r}.")
    d1, d2 = sorted(values)
    if d2 > full:
        raise ValueError(f"--depths: {d2} is deeper than the model's full depth {full}.")
    return d1, d2


def predict(rows: list[Any], workload: str, strategy: str, fit_depths: tuple[int, int], depth: int,
            key: str) -> tuple[float, LinearFit] | None:
    """``key`` (e.g. ``"peak_gib"``) of one strategy at ``depth``, fitted from its rows at the fit depths.

    ``rows`` are measured rows with ``workload``, ``strategy``, ``depth``, ``status`` and ``key``
    attributes (bench's results); None when either fit depth lacks a good measurement.
    """
    found = {r.depth: getattr(r, key) for r in rows
             if r.workload == workload and r.strategy == strategy and r.status == "ok" and r.depth in fit_depths}
    if any(found.get(d) is None for d in fit_depths):
        return None
    line = fit(fit_depths, (float(found[fit_depths[0]]), float(found[fit_depths[1]])))
    return line.at(depth), line
