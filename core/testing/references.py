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

import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn

from ..offload.state import state_parts
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


class _Same:
    """An object in a key by identity (a family need not be hashable); holds it, so its id is not reused."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj


_CACHE: OrderedDict[tuple[Any, ...], Reference] = OrderedDict()
_COUNTS = {"hits": 0, "misses": 0}


def reference(case: Case, model: nn.Module, *, family: Any = None, seed: int = 1) -> Reference:
    """The unpatched step of ``case`` (inputs from ``seed``), for comparing ``model`` patched with it.

    ``model`` is the case's model freshly built and not yet run (the one the caller is about to patch):
    its digest is part of the key. With ``family``, the step runs inside :func:`locate_kernels` for that
    family and the reference carries the :class:`KernelMap`. Returns a copy: the caller may change it.
    """
    digest = _model_digest(model)
    key = _key(case, digest, family, seed)
    found = _CACHE.get(key)
    if found is not None:
        _CACHE.move_to_end(key)
        _COUNTS["hits"] += 1
        return found.copy()
    _COUNTS["misses"] += 1
    fresh = case.fresh()
    assert _model_digest(fresh) == digest, (
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
    inputs = _digest(case.inputs(torch.Generator().manual_seed(seed)))
    located = None if family is None else _Same(family)
    return (case.name, case.seed, case.build, case.inputs, case.output, seed, located, settings, inputs, model_digest)


def _model_digest(model: nn.Module) -> str:
    """The module tree (paths, classes, training flags, plain settings), the model's config if it has one,
    and every parameter and buffer: name, dtype, shape, ``requires_grad`` and bytes."""
    h = hashlib.blake2b(digest_size=20)
    for path, module in model.named_modules():
        cls = type(module)
        h.update(f"|{path}:{cls.__module__}.{cls.__qualname__}:{module.training}".encode())
        for name, value in sorted(vars(module).items()):
            if not name.startswith("_") and _plain(value):
                h.update(f";{name}={value!r}".encode())
    config = getattr(model, "config", None)
    if isinstance(config, Mapping):
        _feed(h, dict(config))
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        h.update(f"|{name}".encode())
        _feed(h, tensor)
    return h.hexdigest()


def _digest(value: Any) -> str:
    h = hashlib.blake2b(digest_size=20)
    _feed(h, value)
    return h.hexdigest()


def _plain(value: Any) -> bool:
    if isinstance(value, (bool, int, float, str, Enum)) or value is None:
        return True
    return isinstance(value, (tuple, list)) and all(_plain(v) for v in value)


def _feed(h: Any, value: Any) -> None:
    """Add ``value`` to the digest: tensors by dtype, shape, ``requires_grad`` and bytes, containers item by
    item, anything else by its type and ``repr`` (a ``repr`` that names an address only misses the cache)."""
    if isinstance(value, torch.Tensor):
        h.update(f"<T {type(value).__qualname__} {value.dtype} {tuple(value.shape)} {value.requires_grad} "
                 f"{value.device.type}>".encode())
        # through the plain tensors that hold the bytes: a quantized weight's inner tensors (a wrapper
        # subclass cannot be viewed as bytes) and the block scales hung on it (gradseam.offload.state)
        for part in state_parts([value]):
            t = part.detach()
            h.update(f"<{t.dtype} {tuple(t.shape)}>".encode())
            if t.device.type != "meta" and t.numel():
                h.update(t.reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        h.update(f"<{type(value).__qualname__}".encode())
        for k in sorted(value, key=repr):
            _feed(h, k)
            _feed(h, value[k])
        h.update(b">")
    elif isinstance(value, (list, tuple)):
        h.update(f"<{type(value).__qualname__}".encode())
        for v in value:
            _feed(h, v)
        h.update(b">")
    else:
        h.update(f"<{type(value).__module__}.{type(value).__qualname__} {value!r}>".encode())
