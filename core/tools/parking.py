"""The blocks a cut model leaves out, parked in host memory while it is measured.

Every measurement of :mod:`gradseam.tools.depth` runs a model cut to a shallow depth, and until the thirty-second
session the blocks left out stayed where they were: on the GPU. That is harmless on an 80 GiB card with room to
spare, and wrong on the card a user plans for. Under a 24 GiB cap, HunyuanVideo 1.5 at 480p x 121 frames has 15.4
GiB of block weights on the GPU, and every candidate ``"auto"`` measured at two and four of its 54 blocks ran out of
memory beside the 50 blocks it did not run (an H100, the thirty-first session); bench's capped rows at the fit
depths of a ``--full`` run were not measured at all, for the same reason, so their per-block growth was missing.

Inside :func:`parking`, :func:`gradseam.tools.depth.at_depth` moves the weights (parameters, buffers and any
gradient) of the blocks outside the cut into pageable host memory and brings back those a deeper cut runs again; on
leaving, every tensor is back where it was, the same object (its ``.data`` swapped, so optimizers, hooks and
``state_dict`` see no change). Why these choices:

- **Pageable, not pinned.** Pinned memory is the budget the plan is made for (the activations' pool, the streamed
  weights); a parked copy lives for the measurement only, so it takes none of it. Its copies are slower (a few GiB/s
  against a pinned ~25), paid once per measuring session, not per candidate.
- **Lazily, for a session.** A candidate is measured at two depths; parking and restoring around each measurement
  would copy the model's weights out and in twice per candidate. A session parks what the cut leaves out and
  restores only what a deeper cut runs again, so the weights cross the link once each way per session.
- **Plain tensors only.** A quantized weight (a tensor subclass: torchao, quanto) stays where it is: swapping its
  ``.data`` is not defined for every subclass, and a quantized model is a fraction of the size.
- **Not on a model whose weights already stream** (a weight stream set aside under ``"auto"``): its blocks are in
  host memory already, and the stream lends the GPU copies it measures with.

On the CPU parking moves nothing (the host copy is the tensor itself), but the same swaps happen, which is how the
tests check it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from time import perf_counter

import torch
from torch import nn

from ..offload.weights import tensor_ids

GiB = 1 << 30

_sessions: weakref.WeakKeyDictionary[nn.Module, Parking] = weakref.WeakKeyDictionary()


@dataclass
class _Parked:
    tensor: torch.Tensor  # the parameter or buffer itself, whose data is an empty tensor while parked
    host: torch.Tensor  # its data in host memory (on the CPU: the data itself)
    device: torch.device
    grad: torch.Tensor | None  # its gradient, in host memory, if it had one


class Parking:
    """The tensors of one model parked now (see the module docstring)."""

    def __init__(self, model: nn.Module, report: Callable[[str], None] | None = None) -> None:
        self.model, self.report = model, report
        self._parked: dict[int, _Parked] = {}
        self.parked_bytes = 0  # in host memory now
        self.moved_bytes = 0  # copied either way in this session

    def hold_only(self, outside: Iterable[nn.Module]) -> None:
        """Park every tensor of ``outside`` (the blocks the cut model leaves out) that the model as cut does not use,
        and bring back every parked tensor it uses again."""
        start, moved = perf_counter(), self.moved_bytes
        used = tensor_ids(self.model)
        for key in [key for key in self._parked if key in used]:
            self._unpark(key)
        for block in outside:
            for t in chain(block.parameters(), block.buffers()):
                if id(t) not in used and id(t) not in self._parked and _parkable(t):
                    self._park(t)
        if self.moved_bytes > moved:
            self._took(start, self.moved_bytes - moved)

    def restore(self) -> None:
        """Every parked tensor back where it was."""
        if not self._parked:
            return
        start, moved = perf_counter(), self.moved_bytes
        for key in list(self._parked):
            self._unpark(key)
        if self.moved_bytes > moved:
            self._took(start, self.moved_bytes - moved)

    def _park(self, t: torch.Tensor) -> None:
        grad = t.grad
        if grad is not None:
            t.grad = None  # before the data shrinks: a gradient must match its tensor's shape
        size = t.nbytes + (grad.nbytes if grad is not None else 0)
        self._parked[id(t)] = _Parked(t, t.data.to("cpu"), t.device, grad.to("cpu") if grad is not None else None)
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self.parked_bytes += size
        self.moved_bytes += size

    def _unpark(self, key: int) -> None:
        parked = self._parked.pop(key)
        t = parked.tensor
        t.data = parked.host.to(parked.device)
        if parked.grad is not None:
            t.grad = parked.grad.to(parked.device)
        size = t.nbytes + (parked.grad.nbytes if parked.grad is not None else 0)
        self.parked_bytes -= size
        self.moved_bytes += size

    def _took(self, start: float, moved: int) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the time a user waits, so the copies are done before it is read
        seconds = perf_counter() - start
        if self.report is not None:
            self.report(f"{moved / GiB:.2f} GiB of the weights of blocks outside the cut model moved "
                        f"{'to' if self.parked_bytes else 'back from'} host memory in {seconds:.1f} s "
                        f"({self.parked_bytes / GiB:.2f} GiB parked now)")


@contextmanager
def parking(model: nn.Module, report: Callable[[str], None] | None = None) -> Iterator[Parking]:
    """A parking session for ``model`` (see the module docstring): :func:`gradseam.tools.depth.at_depth` parks the
    blocks outside each cut inside it, and everything is back on leaving. Reentrant: an inner session is the outer
    one, and the outer one restores. ``report(line)`` hears of each move (how much, how long)."""
    session = _sessions.get(model)
    if session is not None:
        yield session
        return
    session = Parking(model, report)
    _sessions[model] = session
    try:
        yield session
    finally:
        del _sessions[model]
        session.restore()


def session_of(model: nn.Module) -> Parking | None:
    """The parking session open for ``model``, if any."""
    return _sessions.get(model)


def _parkable(t: torch.Tensor) -> bool:
    """A plain tensor holding data on a real device (not a quantized subclass, not already empty) that is the whole of
    its storage: one that is a view into a larger buffer (weights loaded as slices of one flat tensor) would free
    nothing when parked, and would come back as a copy of its own, no longer a view of that buffer."""
    return type(t) in (nn.Parameter, torch.Tensor) and t.device.type != "meta" and t.numel() > 0 \
        and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
