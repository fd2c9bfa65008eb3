"""Region kinds: what a kind of region *does*, in one object per kind, below the plan.

A backend's catalog entry (:mod:`gradseam.backends`) is data; its ``kind`` names one of the objects
in :data:`KINDS`, which answers everything that used to be asked of a backend's name in many places:

* which config keys it reads and which it refuses, in its own words (:meth:`RegionKind.check_config`;
  a kind also refuses its own keys where another kind runs: :meth:`RegionKind.check_foreign`);
* what it cannot run on the family or the model as it is (:meth:`RegionKind.check_family`,
  :meth:`RegionKind.refuse_model`), and whether the model changed under it since patching in a way
  that needs planning again (:meth:`RegionKind.changed_since`);
* how its regions read in ``summary()`` (:meth:`RegionKind.describe`, :meth:`RegionKind.notes`);
* its exactness against the unpatched model (``tolerance``: 0 is bitwise on the CPU) and whether it
  compiles (``compiles``), which the kit and the tools read.

The run layer's runners (:data:`gradseam.run.install.RUNNERS`) are keyed by the kind's name and only
install. Only a kind's own module, the catalog and its runner name a kind; ``tests/test_architecture.py``
holds every other module to that.
"""

from __future__ import annotations

from ..backends import CATALOG, Backend, Kept
from ..config import CheckpointConfig
from .attention import ATTENTION_OFFLOAD
from .base import RegionKind, fallback_note, siblings, staying_sibling
from .block import WHOLE_BLOCK
from .compiled import COMPILED_BLOCK
from .ffn import FFN_SEAM

KINDS: dict[str, RegionKind] = {k.name: k for k in (WHOLE_BLOCK, FFN_SEAM, COMPILED_BLOCK, ATTENTION_OFFLOAD)}


def kind_of(backend: Backend | None) -> RegionKind | None:
    """The kind of ``backend``'s regions (None when checkpointing is off)."""
    return KINDS[backend.kind] if backend is not None else None


def backend_of(config: CheckpointConfig) -> Backend | None:
    """The catalog entry a config runs, or None when checkpointing is off or ``"auto"`` has yet to plan it (the
    patcher plans nothing until then: :mod:`gradseam.auto`)."""
    return CATALOG.get(config.backend) if config.enabled else None


def check_config(config: CheckpointConfig) -> None:
    """Refuse a setting the backend does not do, whatever the model: every kind refuses its own keys where
    another kind runs, then the chosen kind refuses what it does not do. Model-free, so ``gradseam run``
    refuses these before the program starts."""
    backend = backend_of(config)
    for kind in KINDS.values():
        kind.check_foreign(backend, config)
    if backend is not None:
        KINDS[backend.kind].check_config(backend, config)


__all__ = ["ATTENTION_OFFLOAD", "COMPILED_BLOCK", "FFN_SEAM", "KINDS", "WHOLE_BLOCK", "Kept", "RegionKind",
           "backend_of", "check_config", "fallback_note", "kind_of", "siblings", "staying_sibling"]
