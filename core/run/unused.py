"""Unused outputs of a compiled block: the parameters only they reach get no gradient, as in eager.

A block with several outputs (the image and text streams of a dual-stream MMDiT block) can have one
that feeds nothing: the text stream of the last such block in MageFlow, Qwen-Image or HunyuanVideo
1.5. Eager autograd never reaches the parameters that only feed it, so their ``.grad`` stays
``None``; a compiled block's backward is one node that always returns a gradient for every input,
so they get zeros (``torch.compile`` alone does the same). The two are not the same to an optimizer:
AdamW skips a ``None`` gradient but steps its moments and weight decay on a zero one. Why it is
built this way:

* **Which parameters each output reaches comes from one eager forward of the block**, the first time
  the block runs with more than one differentiable output, under saved-tensor hooks that keep
  nothing (so it costs the compute of one forward and no activation memory) and with the RNG state
  restored after it. A trace under fake tensors would cost nothing either, but it writes fake
  tensors into whatever state the block's code stores (caches, a hook's list); the eager forward
  runs the block's code once more, as every recompute of checkpointing does. Blocks with a single
  output need nothing: if it is unused the compiled node never runs.
* **Which outputs a backward leaves unused is known exactly, just before the compiled node runs**: a
  pre-hook on that node sees ``None`` for every output no gradient reached (the node materializes
  zeros only after). Per call it costs one pre-hook registration; the work is done only in a backward
  that leaves an output unused.
* **The zeros are undone right after they land**, by a post-accumulate hook on each parameter that
  had no gradient before this backward and is reached by unused outputs only; the hooks are removed
  when this backward ends (``queue_callback``), so none can fire in a later one. A parameter the
  model registers in several places (tied weights) is left alone: another path may give it a real
  gradient in the same backward, which the hook cannot tell from the zeros.
* **Outputs that are views of one graph output** (Flux's single block returns two slices of one
  tensor) need nothing: that output is used, or the node does not run. **Where the block's outputs
  do not all come from one compiled node** (a graph break inside the block), or the eager forward
  fails, nothing is changed: zeros, as ``torch.compile`` gives, and a warning once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from ..errors import warn_once

Reach = list[frozenset[int]]  # per differentiable output leaf, in order: the ids of the parameters it reaches


def _differentiable(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad]


def _source(tensor: torch.Tensor) -> tuple[Any, int]:
    """The autograd node and output position a block output's gradient reaches the compiled graph at.

    An output that is a view (Flux's single block returns two slices of one tensor) is regenerated
    outside the graph from its base, which is the graph's output (AOTAutograd returns such bases
    as outputs of their own)."""
    base = tensor._base if tensor._is_view() and tensor._base is not None else tensor
    return base.grad_fn, base.output_nr


def _reached(tensor: torch.Tensor) -> frozenset[int]:
    """The ids of the leaf tensors (parameters) ``tensor``'s autograd graph leads to."""
    found, seen, stack = set(), set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return frozenset(found)


def probe(function: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict) -> Reach:
    """Run ``function(module, *args, **kwargs)`` eagerly, keeping no activation, on detached inputs, and
    say which of the module's parameters each differentiable output reaches."""
    def detached(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().requires_grad_(value.requires_grad)
        return value

    args, kwargs = tree_map(detached, (args, kwargs))
    devices = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), torch.autograd.graph.saved_tensors_hooks(_drop, _dropped):
        outputs = function(module, *args, **kwargs)
    return [_reached(t) for t in _differentiable(outputs)]


def _drop(tensor: torch.Tensor) -> None:
    return None


def _dropped(nothing: None) -> torch.Tensor:
    raise RuntimeError("gradseam: the reach probe's graph is never run backward")


class UnusedOutputs:
    """Per compiled-block handler: what each block's outputs reach, and the hooks that undo the zeros."""

    def __init__(self, tied: frozenset[int]) -> None:
        self.tied = tied  # ids of parameters registered more than once in the model
        self._reach: weakref.WeakKeyDictionary[torch.nn.Module, Reach | None] = weakref.WeakKeyDictionary()

    def watch(self, function: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict,
              outputs: Any) -> None:
        """Called with each compiled call's outputs (training, gradients on)."""
        tensors = _differentiable(outputs)
        if len(tensors) < 2:
            return
        sources = [_source(t) for t in tensors]
        node = sources[0][0]
        if node is None or any(n is not node for n, _ in sources):
            warn_once(f"gradseam: the outputs of a compiled {type(module).__name__} come from several compiled "
                      "graphs (a graph break inside the block); an output the loss does not use gives its "
                      "parameters zero gradients there, not None as in eager autograd.")
            return
        positions = [at for _, at in sources]
        if len(set(positions)) < 2:  # views of one graph output: it is used, or the node does not run
            return
        if module not in self._reach:
            self._reach[module] = self._probe(function, module, args, kwargs, len(tensors))
        reach = self._reach[module]
        if reach is None:
            return
        node.register_prehook(_Undo(reach, positions, module, self.tied))

    def _probe(self, function: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict,
               count: int) -> Reach | None:
        try:
            reach = probe(function, module, args, kwargs)
        except Exception as exc:  # the same forward just ran compiled; say so, change nothing
            warn_once(f"gradseam: could not run a compiled {type(module).__name__} eagerly to learn which "
                      f"parameters each of its outputs reaches ({type(exc).__name__}: {exc}); an output the "
                      "loss does not use gives its parameters zero gradients there, not None as in eager.")
            return None
        return reach if len(reach) == count else None


class _Undo:
    """The pre-hook on one call's compiled node."""

    __slots__ = ("module", "positions", "reach", "tied")

    def __init__(self, reach: Reach, positions: list[int], module: torch.nn.Module, tied: frozenset[int]) -> None:
        self.reach, self.positions, self.module, self.tied = reach, positions, module, tied

    def __call__(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        unused = [i for i, at in enumerate(self.positions) if at < len(grad_outputs) and grad_outputs[at] is None]
        if not unused:
            return None
        used = frozenset().union(*(r for i, r in enumerate(self.reach) if i not in unused))
        only = frozenset().union(*(self.reach[i] for i in unused)) - used
        if not only:
            return None
        handles = [p.register_post_accumulate_grad_hook(_to_none) for p in self.module.parameters()
                   if id(p) in only and id(p) not in self.tied and p.requires_grad and p.grad is None]
        if handles:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: [h.remove() for h in handles])
        return None


def _to_none(param: torch.Tensor) -> None:
    param.grad = None
