"""The unpatched reference step of a case: computed once, reused by every configuration checked against it.

Every check of a configuration compares a patched model with the same model unpatched. The unpatched
step does not depend on the configuration, yet a suite checks 10-20 configurations per case, so
recomputing it made a third of all the forward and backward passes the kit ran. :func:`reference`
keeps the last few references and hands a copy out again when nothing that determines the result
changed. It must never hand out a stale one, so the key is made of what the step depends on:

* the case as it is now: its name, seed and the identity of its ``build`` / ``inputs`` / ``output``
  callables (a test that swaps or replaces one gets a new key);
* what ``build()`` gave: a digest of the freshly built model about to be patched (module tree and
  classes, plain settings, every parameter's and buffer's values, dtype and ``requires_grad``), so a
  build that reads state a test changed is keyed by its result;
* what ``inputs()`` gives for the step's seed: a digest of every value, tensors byte for byte;
* the kind of run: with kernel location (and then for which family object: the map names its
  declarations) or without;
* the process-wide torch settings a CPU step reads: default dtype, thread count, deterministic algorithms.

A reference is computed exactly as it always was, on a fresh model (``torch.manual_seed(case.seed)``
then ``case.build()``), never on the model the check patches; that model must digest the same, so a
build that is not deterministic under its seed fails by name instead of comparing two different
models. The cache holds :data:`MAX_REFERENCES` entries (least recently used first out), so it stays
a few tiny models' gradients however many cases a session checks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .digests import Same, digest_of, model_digest
from .kernels import KernelMap, locate_kernels
from .steps import Case, Step, run_step

MAX_REFERENCES = 8  # a case's two kinds of run, for the few cases a worker interleaves


@dataclass(frozen=True)
class Reference:
    """An unpatched step of a case, and where its attention kernels ran (when the run located them)."""

    step: Step
    kernels: KernelMap | None = None

    def copy(self) -> Reference:
        return Reference(self.step.copy(), self.kernels.copy() if self.kernels is not None else None)


_CACHE: OrderedDict[tuple[Any, ...], Reference] = OrderedDict()
_COUNTS = {"hits": 0, "misses": 0}


def reference(case: Case, model: nn.Module, *, family: Any = None, seed: int = 1) -> Reference:
    """The unpatched step of ``case`` (inputs from ``seed``), for comparing ``model`` patched with it.

    ``model`` is the case's model freshly built and not yet run (the one the caller is about to patch):
    its digest is part of the key. With ``family``, the step runs inside :func:`locate_kernels` for that
    family and the reference carries the :class:`KernelMap`. Returns a copy: the caller may change it.
    """
    digest = model_digest(model)
    key = _key(case, digest, family, seed)
    found = _CACHE.get(key)
    if found is not None:
        _CACHE.move_to_end(key)
        _COUNTS["hits"] += 1
        return found.copy()
    _COUNTS["misses"] += 1
    fresh = case.fresh()
    assert model_digest(fresh) == digest, (
        f"{case.name}: build() gave a different model the second time under torch.manual_seed({case.seed}); "
        "the kit builds a case more than once and needs the same model each time (see 'Case' in docs/plugins.md)"
    )
    if family is None:
        made = Reference(run_step(fresh, case, seed=seed))
    else:
        with locate_kernels(fresh, family) as kernels:
            step = run_step(fresh, case, seed=seed)
        made = Reference(step, kernels)
    _CACHE[key] = made
    while len(_CACHE) > MAX_REFERENCES:
        _CACHE.popitem(last=False)
    return made.copy()


def forget() -> None:
    """Drop every cached reference (the next check computes its reference again)."""
    _CACHE.clear()


def info() -> dict[str, int]:
    """Hits, misses and entries held since the process started (for tests of the cache itself)."""
    return {**_COUNTS, "entries": len(_CACHE)}


def _key(case: Case, model_digest: str, family: Any, seed: int) -> tuple[Any, ...]:
    settings = (torch.get_default_dtype(), torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    inputs = digest_of(case.inputs(torch.Generator().manual_seed(seed)))
    located = None if family is None else Same(family)
    return (case.name, case.seed, case.build, case.inputs, case.output, seed, located, settings, inputs, model_digest)
