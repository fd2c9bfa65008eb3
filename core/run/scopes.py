"""What runs around a checkpoint region or an attention call: what the patcher installs for offload.

* :class:`RegionScope` wraps one checkpoint region call. With ``inputs`` it opens saved-tensor
  hooks around the non-reentrant checkpoint, which then see only the region's inputs (the unsloth
  backends). With ``kernels`` it gives the checkpoint a ``context_fn`` that keeps the attention
  kernels' outputs instead of recomputing them (:mod:`gradseam.run.kernels`), in host memory through
  the engine when there is one, else on the GPU. Both go into one engine group per call, so
  backward brings a region's inputs and its kernel outputs back together, and prefetches the
  region before it.
* :class:`AttentionOffload` is installed as an attention submodule's ``forward`` outside any
  checkpointed region (beside the ``-ffn`` backends, or alone): everything attention saves goes
  to the engine.

torch.func transforms cannot run saved-tensor hooks, so both refuse them by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import UnsupportedStrategyError
from ..offload import OffloadEngine
from .chains import inside_region
from .kernels import KernelSet, context_fn


def refuse_transforms(what: str) -> None:
    """torch.func transforms (grad, vjp, jvp, vmap) do not run saved-tensor hooks, which is how every
    offload works: say so by name instead of failing deep inside the engine."""
    interpreter = torch._C._functorch.peek_interpreter_stack()
    if interpreter is None:
        return
    key = str(interpreter.key()).rsplit(".", 1)[-1].lower()
    transform = {"grad": "grad / torch.func.vjp"}.get(key, key)  # vjp runs under the grad interpreter
    raise UnsupportedStrategyError(
        f"{what} cannot run under torch.func.{transform}: it moves saved tensors to the CPU through "
        "saved-tensor hooks, which torch.func transforms do not support (torch.utils.checkpoint, and with "
        "it every gradseam backend, has the same limit under grad and vjp). Call handle.remove() before "
        "the transform and patch again after it."
    )


class RegionScope:
    """Around one checkpoint region call; yields the checkpoint's ``context_fn`` (or None).

    Only the stream a region carries is offloaded as an input: its first argument (the hidden
    states) and any tensor input that requires grad (encoder hidden states on dual-stream blocks).
    Conditioning shared by every block (timestep embeddings, rotary tables, masks) stays on the
    GPU: the model's loop references it anyway, so offloading it would cost copies and free nothing.
    """

    def __init__(self, engine: OffloadEngine | None, *, inputs: bool, kernels: KernelSet | None,
                 scoped: bool = True, missed: Callable[[], None] | None = None) -> None:
        # the install step builds a scope only from a spec that needs one: inputs imply an engine
        assert engine is not None or not inputs, "offloading region inputs needs an engine"
        self.engine, self.inputs, self.kernels, self.scoped, self.missed = engine, inputs, kernels, scoped, missed
        self.what = "gradseam's unsloth backends (region inputs offloaded)" if inputs else (
            "gradient_checkpointing_offload_attention")

    def _context_fn(self, pack: Callable[[torch.Tensor], Any] | None = None,
                    unpack: Callable[[Any], torch.Tensor] | None = None) -> Callable[[], tuple[Any, Any]] | None:
        if self.kernels is None:
            return None
        return context_fn(self.kernels, pack, unpack, scoped=self.scoped, missed=self.missed)

    @contextmanager
    def __call__(self, args: tuple, kwargs: dict) -> Iterator[Callable[[], tuple[Any, Any]] | None]:
        engine = self.engine
        if engine is None:  # kernel outputs kept on the GPU: nothing to move
            yield self._context_fn()
            return
        refuse_transforms(self.what)
        select = None
        if self.inputs:
            chosen = set()
            for i, value in enumerate((*args, *kwargs.values())):
                if isinstance(value, torch.Tensor) and (i == 0 or value.requires_grad):
                    chosen.add(value.untyped_storage().data_ptr())

            def select(t: torch.Tensor) -> bool:
                return t.untyped_storage().data_ptr() in chosen

        with engine.group(select, hooks=self.inputs) as group:
            if self.kernels is None:
                yield None
                return
            state = engine.state_storages()

            def keep(t: torch.Tensor) -> Any:
                packed = engine.pack(group, t, state)
                return t.detach() if packed is t else packed  # too small to move: kept as it is

            def give(packed: Any) -> torch.Tensor:
                out = engine.unpack(packed)
                return out.detach() if out is packed else out

            yield self._context_fn(keep, give)


class AttentionOffload:
    """Handler installed as an attention submodule's forward: offload everything it saves."""

    def __init__(self, engine: OffloadEngine, calls: list[int] | None = None) -> None:
        self.engine = engine
        self.calls = calls if calls is not None else [0]  # offloaded calls, for handle.regions() and the kit

    def __call__(self, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if not torch.is_grad_enabled() or inside_region():
            return call(*args, **kwargs)
        refuse_transforms("gradient_checkpointing_offload_attention")
        self.calls[0] += 1
        with self.engine.group():
            return call(*args, **kwargs)
