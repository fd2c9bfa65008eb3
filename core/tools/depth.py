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
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..family import Family
from ..modules import resolve
from .checks import parse_depths

# A fit that leaves out the growth of fewer blocks than this share of the model is not worth a
# warning: HunyuanVideo's second token-refiner block (1 of 62) moves its figures by well under 1%.
UNSEEN_WARN_SHARE = 0.05


@dataclass(frozen=True)
class DepthPlan:
    """How the block lists of one model shrink with depth."""

    totals: Mapping[str, int]  # block-list path -> the real model's block count
    # block-list path -> how many of its first blocks are built unlike most of the list (Nucleus-Image's three dense
    # blocks before 29 mixture-of-experts ones): a fit whose shallow depth holds only those sees none of the rest
    leading: Mapping[str, int] = field(default_factory=dict)

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

    def unseen(self, depths: tuple[int, int]) -> list[str]:
        """Block lists that keep the same number of blocks at both ``depths`` though the real model has
        more: a fit from those depths cannot see them grow, so its full-depth figures leave out what
        their other blocks add (Flux 3's three 5-block mode lists beside 28 single blocks keep one
        block each at depths 2 and 4: its no-checkpointing peak measured 12% above the fit)."""
        low, high = self.counts(depths[0]), self.counts(depths[1])
        return [path for path, n in self.totals.items() if low[path] == high[path] < n]

    def unseen_share(self, depths: tuple[int, int]) -> float:
        """The fraction of the real model's blocks that lie in :meth:`unseen` lists beyond what the fit
        depths keep of them: the blocks whose growth the fit leaves out."""
        kept = self.counts(depths[1])
        missing = sum(self.totals[path] - kept[path] for path in self.unseen(depths))
        return missing / max(sum(self.totals.values()), 1)

    def fit_depths(self, depths: str | tuple[int, int] | None) -> tuple[int, int]:
        """The two depths to fit from: ``depths`` as given (``"2,4"`` or a pair), else :meth:`default_depths`, else
        the usual two (:func:`gradseam.tools.checks.parse_depths`). One place for the choice advise, bench and the
        workload builder all make."""
        return depths if isinstance(depths, tuple) else parse_depths(depths, self.full, self.default_depths())

    def default_depths(self) -> tuple[int, int] | None:
        """The two depths to fit from when none are given, where the usual 2 and 4 would not do: past each list's
        :attr:`leading` blocks, the shallow depth holding one block like the rest and the deep one two units more.
        None: the usual depths (no list starts with unlike blocks, or the model is too shallow to go past them).

        Why: on an H100 Nucleus-Image's depths 2 and 4 kept two dense blocks and then three dense and one
        mixture-of-experts block, whose recompute works on 4x the sequence: the fit read that block's working set as
        growth (0.22 GiB a block under ``torch``, ~7.1 GiB predicted at 32 blocks) where a block's own is what its
        checkpoint keeps."""
        if not any(self.leading.values()):
            return None
        for low in range(2, self.full - 1):
            counts = self.counts(low)
            if all(counts[path] > n for path, n in self.leading.items() if n and path in counts):
                return None if low == 2 else (low, low + 2)
        return None

    def leading_note(self) -> str:
        """Which lists start with blocks unlike the rest, for the depth note; empty when none do."""
        parts = [f"the first {n} of {path} ({self.totals[path]} blocks)" for path, n in self.leading.items() if n]
        return f"{', '.join(parts)} are built unlike the rest" if parts else ""

    def depth_growing_every_list(self, low: int) -> int | None:
        """The smallest depth above ``low`` at which every list that can still grow has more blocks
        than at ``low``; None if there is none short of the full depth."""
        base = self.counts(low)
        for depth in range(low + 1, self.full):
            got = self.counts(depth)
            if all(got[path] > base[path] for path, n in self.totals.items() if base[path] < n):
                return depth
        return None

    def unseen_note(self, depths: tuple[int, int]) -> str | None:
        """The warning a fit from ``depths`` needs (:meth:`unseen`), or None when every list grows."""
        lists = self.unseen(depths)
        if not lists or self.unseen_share(depths) < UNSEEN_WARN_SHARE:
            return None
        low = self.counts(depths[0])
        names = ", ".join(f"{path} ({low[path]} of {self.totals[path]})" for path in lists)
        better = self.depth_growing_every_list(depths[0])
        fix = f"--depths {depths[0]},{better} (every list grows there) or --full" if better else "--full"
        return (f"the fit depths {depths[0]} and {depths[1]} keep the same blocks of {names}: their growth is "
                f"not in the fit, so its full-depth figures are low by what their other blocks add; measure "
                f"with {fix}.")

    def unit_note(self) -> str:
        if len(self.totals) == 1:
            return "one unit of depth = one block"
        if not self.exact:
            return "depth = blocks of the longest list; the other lists scaled to it and rounded (approximate)"
        parts = ", ".join(f"{n} x {path.rsplit('.', 1)[-1]}" for path, n in self.unit.items())
        return f"one unit of depth = {parts}"


def plan_for(model: nn.Module, family: Family) -> DepthPlan:
    """The depth plan of ``model`` as built (call it before any truncation)."""
    totals, leading = {}, {}
    for block_list in family.block_lists:
        blocks = resolve(model, block_list.path)
        if blocks is not None and len(blocks):
            totals[block_list.path] = len(blocks)
            leading[block_list.path] = leading_unlike(list(blocks))
    return DepthPlan(totals, leading)


def leading_unlike(blocks: list[nn.Module]) -> int:
    """How many of ``blocks``' first ones are built unlike the list's most common kind (their submodules' names and
    classes): a dense feed-forward where the rest route to experts. Only the leading ones matter to a fit from
    shallow depths; one unlike block at the end (SD3's last, which drops its text output) is in neither."""
    shapes = [tuple((name, type(module).__qualname__) for name, module in block.named_modules()) for block in blocks]
    common = Counter(shapes).most_common(1)[0][0]
    return next((i for i, shape in enumerate(shapes) if shape == common), len(shapes))


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
    built at the deepest depth serves every shallower one; inside a parking session
    (:func:`gradseam.tools.parking.parking`) the blocks left out wait in host memory instead, and the
    session brings them back.
    """
    from .parking import session_of

    counts = plan.counts(depth)
    replaced = cut(model, counts)
    parked = session_of(model)
    if parked is not None:
        parked.hold_only(block for path, _, _, original in replaced for block in list(original)[counts[path]:])
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


# What a step's activation peak is fitted from: the whole step's, and (GPU rows) each pass's own
PEAK_KEYS = {"step": "peak_gib", "forward": "forward_peak_gib", "backward": "backward_peak_gib"}


def highest(lines: Mapping[str, LinearFit], depth: int) -> tuple[str, LinearFit]:
    """The name and line of the fit that is highest at ``depth`` (``lines`` non-empty).

    A step's peak is the larger of its passes' peaks, and each pass's peak grows on its own line:
    where a fixed transient in one pass sets the peak at both fit depths, the whole step's fit is
    flat, while the other pass's line climbs past it further down. The highest line at the depth
    asked for is the one that speaks for it; taking the whole step's line too keeps the answer
    never below what the fit of the whole step alone would say.
    """
    return max(lines.items(), key=lambda item: item[1].at(depth))


def _fit_rows(rows: list[Any], workload: str, strategy: str, fit_depths: tuple[int, int]) -> list[Any] | None:
    """One strategy's good rows at the two fit depths, in their order; None if either is missing."""
    found = {r.depth: r for r in rows
             if r.workload == workload and r.strategy == strategy and r.status == "ok" and r.depth in fit_depths}
    return [found[d] for d in fit_depths] if all(d in found for d in fit_depths) else None


def predict(rows: list[Any], workload: str, strategy: str, fit_depths: tuple[int, int], depth: int,
            key: str) -> tuple[float, LinearFit] | None:
    """``key`` (e.g. ``"peak_gib"``) of one strategy at ``depth``, fitted from its rows at the fit depths.

    ``rows`` are measured rows with ``workload``, ``strategy``, ``depth``, ``status`` and ``key``
    attributes (bench's results); None when either fit depth lacks a good measurement.
    """
    pair = _fit_rows(rows, workload, strategy, fit_depths)
    values = [getattr(r, key, None) for r in pair] if pair else [None]
    if any(v is None for v in values):
        return None
    line = fit(fit_depths, (float(values[0]), float(values[1])))
    return line.at(depth), line


def peak_lines(depths: tuple[int, int], first: Any, second: Any) -> dict[str, LinearFit]:
    """The lines of the whole step's peak and of each pass's own (where both measurements have it)
    through two measurements at ``depths`` (bench's rows or :class:`~gradseam.tools.measure.Measurement`)."""
    lines = {}
    for name, key in PEAK_KEYS.items():
        a, b = getattr(first, key, None), getattr(second, key, None)
        if a is not None and b is not None:
            lines[name] = fit(depths, (float(a), float(b)))
    return lines


def predict_peak(rows: list[Any], workload: str, strategy: str, fit_depths: tuple[int, int],
                 depth: int) -> tuple[float, LinearFit, str] | None:
    """The activation peak of one strategy at ``depth``: the highest of :func:`peak_lines` there (see
    :func:`highest`), with the name of its fit (``"step"``, ``"forward"`` or ``"backward"``); None
    without a fit."""
    pair = _fit_rows(rows, workload, strategy, fit_depths)
    lines = peak_lines(fit_depths, *pair) if pair else {}
    if not lines:
        return None
    name, line = highest(lines, depth)
    return line.at(depth), line, name
