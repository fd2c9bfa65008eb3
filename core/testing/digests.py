"""What a built model and a case's inputs are, as short digests: the keys of the kit's caches.

The kit reuses work only when nothing that determines its result changed: a reference step
(:mod:`~gradseam.testing.references`) and a built model (:mod:`~gradseam.testing.builds`) are both keyed by
these. A digest covers the module tree (paths, classes, training flags, plain settings), a model's config, and
every parameter's and buffer's dtype, shape, ``requires_grad`` and bytes, through the plain tensors that hold a
quantized weight's bytes; anything else goes in by its type and ``repr``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from enum import Enum
from typing import Any

import torch
from torch import nn

from ..offload.state import state_parts


def model_digest(model: nn.Module) -> str:
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


def digest_of(value: Any) -> str:
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


class Same:
    """An object in a cache key by identity (it need not be hashable); holds it, so its id is not reused."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj
