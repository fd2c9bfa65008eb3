"""The configuration matrices the kit runs, derived from the backend catalog, and their test ids.

:func:`cpu_configs` and :func:`offload_configs` are the full matrices every family's plain case
passes: each backend of the catalog crossed with the settings it takes. A case that only varies the
inputs of a model whose plain case runs the full matrix (a mask, a second sample, a ControlNet
residual) needs each *mechanism* once, not every row: :func:`reduced_configs` and
:func:`reduced_offload_configs` are those rows, picked from the full matrices, so a family's test
file states "reduced" instead of writing rows out (``ConformanceSuite.reduced``). Rows are derived
from catalog facts (:mod:`gradseam.testing.facts`), never from backend names, so a new backend shows
up in every matrix by being in the catalog.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from ..config import CheckpointConfig
from ..tools.named_strategies import BACKEND, INTERVAL, KEEP, OFFLOAD_ATTENTION, ON, STRIDE
from .facts import BackendFacts, backends

Config = dict[str, Any]


def cpu_configs(*, ffn: bool = True, interval: bool = True, stride: bool = True) -> list[Config]:
    """The CPU matrix every adapter passes: each catalog backend that moves nothing, x interval {1, 2}
    x stride {none, 4} where the backend takes them, and whole blocks that keep attention kernel outputs.
    Compiled backends give one row each, at the end (marked ``compiled`` by the suite)."""
    out: list[Config] = []
    kept: list[Config] = []
    compiled: list[Config] = []
    for b in backends():
        if b.moves or (b.ffn and not ffn):
            continue
        if b.compiles:
            compiled.append({**ON, BACKEND: b.name})
            continue
        for n in [None, 2] if interval and b.interval else [None]:
            for s in [None, 4] if stride and b.interval else [None]:
                out.append({**ON, BACKEND: b.name, INTERVAL: n, STRIDE: s})
        if not b.ffn and b.keeps_kernels:
            kept.append({**ON, BACKEND: b.name, KEEP: True, INTERVAL: 2 if interval and b.interval else None})
    return out + kept + compiled


def offload_configs(*, ffn: bool = True, interval: bool = True, attention: bool = True) -> list[Config]:
    """Offload configurations; run them inside :func:`gradseam.offload.cpu_test_mode` on the CPU,
    where every offloaded byte goes through host buffers and back exactly as on a GPU: each catalog
    backend that offloads (with interval 2 + stride 4 where it chunks), attention offload alone and
    beside every backend that supports it, and with a stride that leaves blocks out. Compiled backends
    give one row each, at the end."""
    out: list[Config] = []
    compiled: list[Config] = []
    for b in backends():
        if b.ffn and not ffn:
            continue
        if b.moves and b.compiles:
            compiled.append({**ON, BACKEND: b.name})
        elif b.moves:
            out.append({**ON, BACKEND: b.name})
            if interval and b.interval and not b.ffn:
                out.append({**ON, BACKEND: b.name, INTERVAL: 2, STRIDE: 4})
    if attention:
        # whole blocks (kept kernels offloaded), attention offload alone, beside a stride, beside FFN seams
        offloaders = [b for b in backends() if not b.compiles and not (b.ffn and not ffn)]
        for b in offloaders:
            if not b.ffn and b.keeps_kernels:
                n = 2 if interval and b.interval and b.moves else None
                out.append({**ON, BACKEND: b.name, OFFLOAD_ATTENTION: True, INTERVAL: n})
        out.append({OFFLOAD_ATTENTION: True})
        # a stride leaves blocks out: their attention is offloaded beside the checkpointed blocks' kept kernels
        out.append({**ON, STRIDE: 3, OFFLOAD_ATTENTION: True})
        out += [{**ON, BACKEND: b.name, OFFLOAD_ATTENTION: True} for b in offloaders if b.ffn]
    return out + compiled


def _first(test: Callable[[BackendFacts], bool]) -> BackendFacts:
    return next(b for b in backends() if not b.compiles and test(b))


def reduced_configs(*, ffn: bool = True, interval: bool = True, stride: bool = True, blocks: bool = True,
                    kept: bool = True) -> list[Config]:
    """One row of :func:`cpu_configs` per mechanism, for a case that varies the inputs of a model whose
    plain case runs the full matrix: whole blocks (in chunks of 2 with ``interval``, else with a stride),
    the FFN seams (with interval 2 and stride 4, where blocks are selected), and whole blocks that keep
    attention kernel outputs. ``ffn`` / ``interval`` / ``stride`` say what the family supports, as for
    :func:`cpu_configs`; ``blocks`` / ``kept`` (and ``ffn``) leave a row out."""
    full = cpu_configs(ffn=ffn, interval=interval, stride=stride)
    wanted: list[Config] = []
    if blocks:
        b = _first(lambda b: not b.moves and not b.ffn and b.interval)
        wanted.append({BACKEND: b.name, INTERVAL: 2} if interval else {BACKEND: b.name, STRIDE: 4} if stride
                      else {BACKEND: b.name})
    if ffn:
        b = _first(lambda b: not b.moves and b.ffn)
        wanted.append({BACKEND: b.name, INTERVAL: 2, STRIDE: 4} if interval and stride and b.interval
                      else {BACKEND: b.name})
    if kept:
        b = _first(lambda b: not b.moves and not b.ffn and b.keeps_kernels)
        wanted.append({BACKEND: b.name, KEEP: True, **({INTERVAL: 2} if interval and b.interval else {})})
    return pick(full, *wanted)


def reduced_offload_configs(*, ffn: bool = True, interval: bool = True, attention: bool = True,
                            blocks: bool = True) -> list[Config]:
    """One row of :func:`offload_configs` per mechanism, as :func:`reduced_configs` for the CPU matrix:
    offloaded whole blocks (chunks of 2 with a stride of 4 leaving blocks out, with ``interval``), offloaded
    FFN seams, and attention kernels offloaded beside offloaded blocks. ``ffn`` / ``interval`` /
    ``attention`` say what the family supports, as for :func:`offload_configs`; ``blocks`` (and ``ffn``,
    ``attention``) leave a row out."""
    full = offload_configs(ffn=ffn, interval=interval, attention=attention)
    wanted: list[Config] = []
    if blocks:
        b = _first(lambda b: b.moves and not b.ffn)
        wanted.append({BACKEND: b.name, INTERVAL: 2, STRIDE: 4} if interval and b.interval else {BACKEND: b.name})
    if ffn:
        wanted.append({BACKEND: _first(lambda b: b.moves and b.ffn).name})
    if attention:
        b = _first(lambda b: b.moves and not b.ffn and b.keeps_kernels)
        wanted.append({BACKEND: b.name, OFFLOAD_ATTENTION: True, **({INTERVAL: 2} if interval and b.interval else {})})
    return pick(full, *wanted)


def pick(configs: list[Config], *wanted: Config) -> list[Config]:
    """The configs of a kit matrix with exactly these settings, in the order asked, found by content (not by
    position, which follows the backend catalog): each ``wanted`` is the keys a config sets besides
    ``gradient_checkpointing: True``, e.g. ``{"gradient_checkpointing_backend": "torch", INTERVAL: 2}``.
    For a matrix of one's own made of the kit's rows."""
    def set_keys(c: Config) -> Config:
        return {k: v for k, v in c.items() if v is not None}

    found = []
    for w in wanted:
        match = [c for c in configs if set_keys(c) == {**ON, **w}]
        assert match, f"the kit's matrix has no config {w}"
        found.append(copy.deepcopy(match[0]))
    return found


def config_id(config: Config) -> str:
    """A short, stable test id for a configuration (``torch-ffn+interval2+stride4``)."""
    cfg = CheckpointConfig.coerce(config)
    return cfg.describe().replace(", ", "+").replace(" ", "")
