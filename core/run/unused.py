"""Unused outputs of a compiled block, and parameters no output reaches: no gradient, as in eager.

A block with several outputs (the image and text streams of a dual-stream MMDiT block) can have one
that feeds nothing: the text stream of the last such block in MageFlow, Qwen-Image or HunyuanVideo
1.5. Eager autograd never reaches the parameters that only feed it, so their ``.grad`` stays
``None``; a compiled block's backward is one node that always returns a gradient for every input,
so they get zeros (``torch.compile`` alone does the same). The same holds for a parameter the block
uses without a gradient path to any output: HiDream in eval mode routes its experts under
``no_grad`` (diffusers' ``moe_infer``), so eager leaves its gates' weights at ``None`` and a compiled
block gave them zeros. The two are not the same to an optimizer: AdamW skips a ``None`` gradient but
steps its moments and weight decay on a zero one. Why it is built this way:

* **Only the compiled node's own contribution is dropped, never a gradient.** A hook on the node
  (``register_hook``) sees which of its outputs no gradient reached (``None``: the node materializes
  zeros only inside) and returns ``None`` instead of the zeros it computed for every parameter only
  those outputs reach. Autograd then never accumulates anything from this node into them: whatever
  else reaches the parameter in the same backward (an L2 penalty on the weights, a tied use
  elsewhere) lands as in eager, and a parameter with no other path keeps ``None``.
* **Which parameters each output reaches comes from one eager forward of the block** (every compiled
  block, once, and again when it changed: a block with one output may still hold such parameters), keeping no
  activation (saved-tensor hooks that keep nothing), with the RNG state restored after it and the
  module hooks of the block's submodules (and the global ones) switched off, so a feature-capture
  hook never sees the probe's tensors. It runs the block's code once more, as every recompute of
  checkpointing does; a trace under fake tensors would write fake tensors into whatever state the
  block's code stores (caches, lists).
* **It is learnt again when the block changed**: each call checks that every parameter the compiled
  node takes a gradient for is one the probe saw (by identity, not by ``id()``, which Python
  reuses). A checkpoint loaded with ``load_state_dict(..., assign=True)``, a LoRA adapter added or
  switched with ``set_adapter``: the next call probes again.
* **Outputs that are views of one graph output** (Flux's single block returns two slices of one
  tensor) need nothing: that output is used, or the node does not run. **Where the block's outputs
  do not all come from one compiled node** (a graph break inside the block), or the eager forward
  fails, nothing is changed: zeros, as ``torch.compile`` gives, and a warning once. A failed probe is
  tried again after 1, 2, 4, ... of the block's calls (:class:`_Backoff`), not at every call.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from ..errors import warn_once


def _differentiable(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad]


def _source(tensor: torch.Tensor) -> tuple[Any, int]:
    """The autograd node and output position a block output's gradient reaches the compiled graph at.

    An output that is a view (Flux's single block returns two slices of one tensor) is regenerated
    outside the graph from its base, which is the graph's output (AOTAutograd returns such bases
    as outputs of their own)."""
    base = tensor._base if tensor._is_view() and tensor._base is not None else tensor
    return base.grad_fn, base.output_nr


def _reached(tensor: torch.Tensor) -> dict[int, torch.Tensor]:
    """The leaf tensors (parameters) ``tensor``'s autograd graph leads to, by id."""
    found: dict[int, torch.Tensor] = {}
    seen, stack = set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if variable is not None:
            found[id(variable)] = variable
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
               "_backward_hooks")


@contextlib.contextmanager
def _module_hooks_off(module: nn.Module) -> Iterator[None]:
    """No module hook (the submodules' own and the global ones) fires inside this block.

    The dicts are emptied and refilled in place: a hook's removable handle points at its dict, so it
    stays valid. diffusers' own hooks (group offloading, layerwise casting) replace ``forward`` and run."""
    from torch.nn.modules import module as torch_module

    held: list[tuple[dict, dict]] = []
    globals_ = [getattr(torch_module, name, None) for name in (
        "_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
        "_global_forward_hooks_with_kwargs", "_global_backward_pre_hooks", "_global_backward_hooks")]
    for table in [*globals_, *(getattr(m, n, None) for m in module.modules() for n in _HOOK_DICTS)]:
        if isinstance(table, dict) and table:
            held.append((table, dict(table)))
            table.clear()
    try:
        yield
    finally:
        for table, content in held:
            table.update(content)


def probe(function: Callable[..., Any], first: Any, args: tuple, kwargs: dict,
          hooks_of: nn.Module | None = None) -> list[dict[int, torch.Tensor]]:
    """Run ``function(first, *args, **kwargs)`` eagerly, keeping no activation, on detached inputs, with
    the module hooks of ``hooks_of`` off, and say which leaf tensors each differentiable output reaches."""
    def detached(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().requires_grad_(value.requires_grad)
        return value

    args, kwargs = tree_map(detached, (args, kwargs))
    owner = hooks_of if hooks_of is not None else first
    params = list(owner.parameters()) if isinstance(owner, nn.Module) else []
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    hooks = _module_hooks_off(owner) if isinstance(owner, nn.Module) else contextlib.nullcontext()
    with torch.random.fork_rng(devices=devices), hooks, \
            torch.autograd.graph.saved_tensors_hooks(_drop, _dropped):
        outputs = function(first, *args, **kwargs)
    return [_reached(t) for t in _differentiable(outputs)]


def _drop(tensor: torch.Tensor) -> None:
    return None


def _dropped(nothing: None) -> torch.Tensor:
    raise RuntimeError("gradseam: the reach probe's graph is never run backward")


class _Reach:
    """What one probe learnt of a block: per output, the parameters it reaches, and every parameter the block
    held then (held weakly): those no output reaches get no gradient in eager."""

    __slots__ = ("alive", "never", "outputs")

    def __init__(self, outputs: list[dict[int, torch.Tensor]], held: list[torch.Tensor]) -> None:
        self.outputs = [frozenset(found) for found in outputs]
        self.alive = {key: weakref.ref(t) for found in outputs for key, t in found.items()}
        reached = set(self.alive)
        self.alive.update((id(t), weakref.ref(t)) for t in held)
        self.never = frozenset(id(t) for t in held) - reached

    def knows(self, variable: torch.Tensor) -> bool:
        ref = self.alive.get(id(variable))
        return ref is not None and ref() is variable


WALK_LIMIT = 4096  # autograd nodes: a compiled block's own backward has tens; more means the walk left the block


def _block_nodes(outputs: list[torch.Tensor], inputs: Any, own: set[int]) -> list[Any]:
    """The autograd nodes between ``outputs`` and the block's ``inputs`` that accumulate into one of the block's
    parameters (``own``, by id): the compiled graph, or its pieces where the block's code breaks it. The walk
    stops at the inputs' own nodes; one that finds more than :data:`WALK_LIMIT` nodes (a tensor reached the
    block some other way than its inputs) gives up and returns what it found so far."""
    stop = {t.grad_fn for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    found, seen, stack = [], set(), [t.grad_fn for t in outputs]
    while stack and len(seen) < WALK_LIMIT:
        node = stack.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        edges = node.next_functions
        if any(id(getattr(n, "variable", None)) in own for n, _ in edges if n is not None):
            found.append(node)
        stack.extend(n for n, _ in edges)
    return found


def _edge_variables(node: Any) -> list[torch.Tensor | None]:
    """Per input edge of the compiled node: the leaf tensor it accumulates into, or None."""
    return [getattr(next_node, "variable", None) if next_node is not None else None
            for next_node, _ in node.next_functions]


class _Backoff:
    """A block whose probe failed: tried again after 1, then 2, 4, 8, ... of its calls.

    The probe runs right after the block's compiled call, with its outputs and every activation saved so
    far alive: under a capped card, HunyuanVideo 1.5's ran out of memory asking for a 4.90 GiB attention
    buffer (H100, 32 GiB), and AnyFlow-FAR's eager flex attention asks for 134.83 GiB on any card. Trying
    again at every call repeated that eager forward up to the failing allocation (and, out of memory, the
    allocator's emptying of its cache) at every call of the block, for nothing while the calls stay as
    crowded; never trying again would keep the zeros after one crowded moment. Doubling bounds the cost to
    a few forwards a run, and still finds a calmer call (a shorter clip, a smaller batch) when one comes."""

    __slots__ = ("left", "wait")

    def __init__(self, wait: int) -> None:
        self.wait = self.left = wait

    def due(self) -> bool:
        """Count one call of the block; True on the first call after ``wait`` skipped ones."""
        self.left -= 1
        return self.left < 0

    def doubled(self) -> _Backoff:
        return _Backoff(self.wait * 2)


class UnusedOutputs:
    """Per compiled-block handler: what each block's outputs reach, and the hooks that drop the zeros."""

    def __init__(self) -> None:
        self._reach: weakref.WeakKeyDictionary[nn.Module, _Reach | _Backoff] = weakref.WeakKeyDictionary()

    def __getstate__(self) -> dict[str, Any]:
        return {}  # a copy (deepcopy, pickling) probes its own blocks again: the map is a cache, and weak

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()

    def watch(self, function: Callable[..., Any], first: Any, block: nn.Module, args: tuple, kwargs: dict,
              outputs: Any) -> None:
        """Called with each compiled call's outputs (training, gradients on). ``function(first, ...)`` is the
        call that ran compiled; ``block`` the block whose parameters it uses."""
        tensors = _differentiable(outputs)
        if not tensors:
            return
        sources = [_source(t) for t in tensors]
        node = sources[0][0]
        one_graph = node is not None and all(n is node for n, _ in sources)
        if not one_graph:
            warn_once(f"gradseam: the outputs of a compiled {type(block).__name__} come from several compiled "
                      "graphs (a graph break inside the block); an output the loss does not use gives its "
                      "parameters zero gradients there, not None as in eager autograd.")
        direct = _edge_variables(node) if node is not None else []
        known = self._reach.get(block)
        if isinstance(known, _Backoff) and not known.due():
            return
        if isinstance(known, _Reach) and all(known.knows(v) for v in direct if isinstance(v, nn.Parameter)):
            reach = known
        else:  # never probed, the block changed, or a failed probe's wait is over
            reach = self._probe(function, first, block, args, kwargs, len(tensors))
            failed = known.doubled() if isinstance(known, _Backoff) else _Backoff(1)
            self._reach[block] = reach if reach is not None else failed
        if reach is None:
            return
        # several outputs of one graph (not views of one output): the unused ones' zeros are dropped there
        positions = [at for _, at in sources] if one_graph and len({at for _, at in sources}) > 1 else []
        if positions:
            node.register_hook(_DropZeros(reach, positions, direct))
        if reach.never:  # parameters no output reaches: in every piece of the block's graph, the first too
            own = {id(p) for p in block.parameters()}
            for piece in _block_nodes(tensors, (args, kwargs), own):
                if not (positions and piece is node):
                    piece.register_hook(_DropZeros(reach, [], _edge_variables(piece)))

    def _probe(self, function: Callable[..., Any], first: Any, block: nn.Module, args: tuple, kwargs: dict,
               count: int) -> _Reach | None:
        try:
            found = probe(function, first, args, kwargs, hooks_of=block)
        except Exception as exc:  # the same forward just ran compiled; say so, change nothing
            # once per block class and cause: AnyFlow-FAR's probe ran flex attention eagerly and ran out of memory at
            # every block (H100), each message naming another amount of free memory
            warn_once(f"gradseam: could not run a compiled {type(block).__name__} eagerly to learn which "
                      f"parameters each of its outputs reaches ({type(exc).__name__}: {exc}); an output the "
                      "loss does not use gives its parameters zero gradients there, not None as in eager, "
                      "until the probe runs (it is tried again after 1, 2, 4, ... of the block's calls).",
                      key=("reach probe", type(block), type(exc)))
            return None
        return _Reach(found, list(block.parameters())) if len(found) == count else None


class _DropZeros:
    """The hook on one call's compiled node: ``None`` instead of its zeros for what only unused outputs reach,
    and for the block's parameters no output reaches."""

    __slots__ = ("positions", "reach", "variables")

    def __init__(self, reach: _Reach, positions: list[int], variables: list[torch.Tensor | None]) -> None:
        self.reach, self.positions = reach, positions
        self.variables = [weakref.ref(v) if v is not None else None for v in variables]

    def __call__(self, grad_inputs: tuple[torch.Tensor | None, ...],
                 grad_outputs: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...] | None:
        if len(grad_inputs) != len(self.variables):
            return None
        unused = {i for i, at in enumerate(self.positions) if at < len(grad_outputs) and grad_outputs[at] is None}
        outputs = self.reach.outputs
        used = frozenset().union(*(r for i, r in enumerate(outputs) if i not in unused))
        only = (frozenset().union(*(outputs[i] for i in unused)) - used) | self.reach.never
        if not only:
            return None
        kept = list(grad_inputs)
        for i, ref in enumerate(self.variables):
            variable = ref() if ref is not None else None
            if variable is not None and id(variable) in only and self.reach.knows(variable):
                kept[i] = None
        return tuple(kept)
