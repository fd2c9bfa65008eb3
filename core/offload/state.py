"""Which bytes belong to the model: the storages behind its parameters and buffers.

The engine must never copy model state to host memory (it stays on the device whatever the engine
does, so a copy frees nothing and costs two trips over the host link), and the saved-bytes count
must not count it as kept for backward. Telling model state from activations is easy for a plain
parameter (its own storage) and harder for three kinds of weights, each seen in training:

* **FSDP2's sharded parameters** are DTensors: the wrapper has no storage, its local shard has.
* **Quantized weights as wrapper tensor subclasses** (torchao's ``Int8Tensor``/``Float8Tensor``,
  optimum-quanto's ``WeightQBytesTensor``) keep their bytes in inner tensors (``qdata``/``scale``,
  ``_data``/``_scale``). A compiled block takes them apart, and what its graph saves for backward
  is those inner tensors: plain tensors, tied to the parameter by nothing but their storage. On a
  tiny Wan with fp8 weights, 92 weight tensors per step (about half the bytes) went to host memory
  before the engine looked inside.
* **Quantized weights with side tensors** (bitsandbytes' ``Params4bit.quant_state`` holds the
  block scales ``absmax``, ``Int8Params`` its ``CB``/``SCB``) keep part of their bytes in plain
  tensors hung on the parameter as attributes; a compiled graph can save those too.

So a tensor's storages are found through all three: the local shard, every inner tensor of a
wrapper subclass (recursively), and tensors attached to the parameter (a bounded walk: the
parameter's attributes and one object below them, never a module).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

_ATTACHED_DEPTH = 2  # Params4bit -> QuantState -> its nested QuantState (double quantization)


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (FSDP2's sharded parameters): its local shard holds the bytes."""
    return hasattr(t, "to_local")


def plain_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s bytes: ``t`` itself, a DTensor's local shard, or every inner
    tensor of a wrapper subclass (recursively)."""
    if is_sharded(t):
        t = t.to_local()
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [part for name in names for part in plain_parts(getattr(t, name))]
    return [t]


def storages(t: torch.Tensor) -> list[int]:
    """The data pointers of every storage holding ``t``'s bytes (0 for a tensor with no storage yet,
    such as a resharded FSDP2 parameter)."""
    found = []
    for part in plain_parts(t):
        try:
            found.append(part.untyped_storage().data_ptr())
        except RuntimeError:
            found.append(0)
    return found


def _attached(value: Any, depth: int) -> Iterator[torch.Tensor]:
    """Tensors hung on ``value`` as attributes, down to ``depth`` objects below it (modules skipped)."""
    attributes = getattr(value, "__dict__", None)
    if not attributes or depth < 0:
        return
    for item in attributes.values():
        if isinstance(item, torch.Tensor):
            yield item
        elif not isinstance(item, nn.Module | type) and depth > 0:
            yield from _attached(item, depth - 1)


def state_parts(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The plain tensors holding ``tensors`` (a model's parameters and buffers) and the tensors attached
    to them; see the module docstring for why each is model state."""
    for t in tensors:
        yield from plain_parts(t)
        for side in _attached(t, _ATTACHED_DEPTH):
            yield from plain_parts(side)


def state_storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The data pointers of every storage :func:`state_parts` finds (tensors without storage left out)."""
    found = {ptr for part in state_parts(tensors) for ptr in storages(part)}
    found.discard(0)
    return found


def state_bytes(tensors: Iterable[torch.Tensor], device: torch.device | None = None) -> int:
    """The bytes of every storage :func:`state_parts` finds in ``tensors``, each storage once (tied weights, views),
    on ``device`` only where one is given: what the tensors occupy as they sit in memory (a quantized weight's inner
    and side tensors, not its nominal full-precision size)."""
    sizes: dict[int, int] = {}
    for part in state_parts(tensors):
        if device is None or part.device == device:
            storage = part.untyped_storage()
            sizes[storage.data_ptr()] = storage.nbytes()
    sizes.pop(0, None)
    return sum(sizes.values())


def is_wrapper(t: torch.Tensor) -> bool:
    """A wrapper tensor subclass (a quantized weight, a DTensor): its bytes are in inner tensors, so
    the engine's storage-span copy cannot move it; it stays where it is."""
    return is_traceable_wrapper_subclass(t)
