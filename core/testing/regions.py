"""How each planned region ran during a step, and what the kit demands of it.

Exactness alone cannot fail an adapter whose seam the model never calls (nothing changes, nothing is
saved), nor an interval chunk that falls back to per-block regions (exact, but not what the user asked
for). :func:`record_regions` counts, per region of a patched model, how often it ran and whether it
ran as one region; :func:`assert_regions_ran` and :func:`assert_regions_whole` turn those counts into
failures that name the region and the likely cause.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from ..summary import RegionView
from .facts import is_attention_offload, is_chunk


@contextmanager
def record_regions(handle: Any) -> Iterator[list[RegionView]]:
    """Count, while the block is active, how each region of ``handle`` runs.

    Yields a list that is filled when the block exits with one :class:`~gradseam.summary.RegionView`
    per region, its counts taken over the block only (:meth:`gradseam.handle.PatchHandle.regions`).
    Attention-offload regions are listed too: their ``calls`` count the offloaded calls.
    """
    before = {r.label: r for r in handle.regions()}
    found: list[RegionView] = []
    try:
        yield found
    finally:
        for r in handle.regions():
            old = before.get(r.label)
            calls = tuple(c - (old.calls[i] if old and old.calls else 0) for i, c in enumerate(r.calls))
            found.append(replace(
                r, calls=calls, runs=r.runs - (old.runs if old else 0),
                chunk_calls=r.chunk_calls - (old.chunk_calls if old else 0),
                served=r.served - (old.served if old else 0),
                fallbacks=_since(r.fallbacks, old.fallbacks if old else {}),
                notes=_since(r.notes, old.notes if old else {}),
            ))


def _since(now: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """The counts gained between two readings of a cause -> count map (causes that did not move left out)."""
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


def assert_regions_ran(regions: list[RegionView], *, what: str = "") -> None:
    """Every planned region ran during the step: a seam the model never calls is trivially exact and
    saves nothing, so an adapter declaring one is wrong."""
    prefix = f"{what}: " if what else ""
    for r in regions:
        thing = ("attention submodule, so offloading it saves nothing. The family declares an attention side"
                 if is_attention_offload(r) else
                 "module, so checkpointing it saves nothing. The family declares a block list or FFN seam")
        assert r.ran, (
            f"{prefix}region {r.label} ({r.shape}) never ran: the model did not call that {thing} that this "
            "model's forward does not use."
        )


def assert_regions_whole(regions: list[RegionView], *, what: str = "") -> None:
    """Every region ran during the step, and every chunk or multi-module seam ran as one region."""
    prefix = f"{what}: " if what else ""
    assert_regions_ran(regions, what=what)
    for r in regions:
        if r.whole or is_attention_offload(r):
            continue
        if is_chunk(r):
            why = (
                "the model changed a value between the blocks (a residual added in its loop), passed the next "
                "block other arguments, or the family's Carry does not say where the block's outputs go "
                "(see 'Carry' in docs/plugins.md)"
            )
        else:
            why = (
                "the seam's modules are not called strictly one on the previous one's output "
                "(see 'FFN seams' in docs/plugins.md)"
            )
        raise AssertionError(
            f"{prefix}region {r.label} ({r.shape}) did not run as one region: its members were called "
            f"{r.calls} times and it computed {r.runs} region(s)"
            f"{', and members computed alone because ' + '; '.join(r.fallbacks) if r.fallbacks else ''}. "
            f"Results stay exact, but {why}."
        )
