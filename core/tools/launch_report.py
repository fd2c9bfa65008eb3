"""What ``gradseam run`` says about a patched model: its line, its summary, its part of the report.

Everything comes from the handle: its plan (the regions gradseam decided on) and, for a report,
``handle.regions()``, the counts every installed region keeps of how often it ran and whether it
ran as one region.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

ATTENTION = "attention"  # the shape (gradseam.spec.Shape, a str enum) of an attention submodule offloaded alone;
# compared as text so that `gradseam run` checks its command line before torch is imported

if TYPE_CHECKING:
    from ..handle import PatchHandle
    from ..summary import RegionView


def block_counts(handle: PatchHandle) -> dict[str, tuple[int, int]]:
    """``{block list: (checkpointed blocks, blocks)}`` from the handle's plan, in the family's order."""
    seen: dict[str, set[int]] = {}
    cut: dict[str, set[int]] = {}
    for region in handle.plan.regions:
        seen.setdefault(region.list_path, set()).update(region.blocks)
        if region.shape != ATTENTION:
            cut.setdefault(region.list_path, set()).update(region.blocks)
    for path, index, _ in handle.plan.plain:
        seen.setdefault(path, set()).add(index)
    order = [bl.path for bl in handle.family.block_lists]
    paths = sorted(seen, key=lambda p: order.index(p) if p in order else len(order))
    return {p: (len(cut.get(p, ())), len(seen[p])) for p in paths}


def _regions(handle: PatchHandle, *, attention: bool = False) -> int:
    """The plan's checkpoint regions, or (``attention``) its attention submodules offloaded outside any."""
    return sum((r.shape == ATTENTION) is attention for r in handle.plan.regions)


@dataclass
class Patched:
    handle: PatchHandle
    component: str | None
    runs: list[RegionView] | None = None  # filled at exit when a report is asked for

    @property
    def name(self) -> str:
        cls = type(self.handle.model).__name__
        return f"{self.component} ({cls})" if self.component else cls

    def line(self) -> str:
        handle = self.handle
        blocks = ", ".join(f"{p} {c}/{n}" for p, (c, n) in block_counts(handle).items())
        text = f"patched {self.name}: family {handle.family.name}, {handle.config.describe()}"
        if handle.config.enabled:
            text += f"; checkpointed blocks: {blocks or 'none'} ({_regions(handle)} regions)"
        attention = _regions(handle, attention=True)
        if attention:
            text += f"; attention offload in {attention} blocks"
        return text

    def ran(self) -> tuple[int, int, int]:
        """(regions that ran, planned regions, checkpoint regions computed in all forwards)."""
        runs = self.runs or []
        return sum(r.ran for r in runs), _regions(self.handle), sum(r.runs for r in runs)

    def to_dict(self) -> dict[str, Any]:
        handle = self.handle
        model = type(handle.model)
        doc: dict[str, Any] = {
            "component": self.component,
            "class": f"{model.__module__}.{model.__qualname__}",
            "family": handle.family.name,
            "strategy": handle.config.describe(),
            "config": handle.config.to_dict(),
            "blocks": {p: {"checkpointed": c, "total": n} for p, (c, n) in block_counts(handle).items()},
            "regions": _regions(handle),
            "attention_offload": _regions(handle, attention=True),
            "summary": [
                {"blocks": r.blocks, "class": r.block_class, "strategy": r.strategy}
                for r in handle.summary().rows
            ],
        }
        if self.runs is not None:
            doc["region_runs"] = [
                {"label": r.label, "shape": r.shape.value, "kind": r.kind, "calls": list(r.calls), "runs": r.runs,
                 "whole": r.whole if r.ran else None, "fallbacks": dict(r.fallbacks)}
                for r in self.runs
            ]
        return doc
