"""Attention kernels as ops: keep their outputs across a checkpoint instead of recomputing them.

A whole-block checkpoint recomputes everything in backward, attention included, and at long
sequences attention is most of the block's forward. But what attention's backward needs from its
forward is small beside the block's other activations: the kernel's output and its softmax
statistics. Keeping exactly those, and recomputing every other op, gives whole-block memory at
close to no-recompute speed (measured numbers: docs/benchmarks.md).

Attention is matched by *operator*, not by module: every family reaches the same few kernels
(aten's scaled-dot-product kernels, or the libraries diffusers' attention dispatcher routes to), so
no adapter has to say where its attention is, and a plugin whose model calls some other kernel
adds it by name (:func:`gradseam.hookspecs.register_attention_kernels`). An op that is not
installed simply never matches. Math attention (``_scaled_dot_product_attention_math``) is a
composite: it reaches the dispatcher as matmuls and a softmax, so it is recomputed, exactly.

Two ``TorchDispatchMode`` s carry the kept outputs from the checkpoint's forward to its recompute
(``torch.utils.checkpoint``'s ``context_fn``): :class:`_Keep` hands each kernel output to a
``pack`` function as it is produced (the offload engine's pack, which copies it to host memory on a
side stream; or a plain detach, keeping it on the GPU); :class:`_Replay` answers the same kernel
call in the recompute with ``unpack`` of what was kept, in order, without running it. Under
``torch.compile`` a Python dispatch mode cannot be traced, so compiled regions use torch's own
selective checkpoint with the same kernels marked must-save: kept on the GPU, not offloaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

# Operator schema names. aten's kernels are what F.scaled_dot_product_attention and diffusers'
# "native" backends reach; the rest are the custom ops of libraries diffusers' dispatcher can use.
BUILTIN_KERNELS: frozenset[str] = frozenset(
    {
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_fused_attention_overrideable",
        "aten::_flash_attention_forward",
        "aten::_efficient_attention_forward",
        "flash_attn::_flash_attn_forward",
        "flash_attn::_flash_attn_varlen_forward",
        "_diffusers_flash_attn_3::_flash_attn_forward",
        "xformers_flash::flash_fwd",
        "xformers::efficient_attention_forward_cutlass",
    }
)


class KernelSet:
    """Which operators count as attention kernels; answers per op object, memoised (ops are few)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)
        self._known: dict[Any, bool] = {}
        self._dropout: dict[Any, int | None] = {}  # where an op takes dropout_p, by position

    def __call__(self, func: Any) -> bool:
        found = self._known.get(func)
        if found is None:
            schema = getattr(func, "_schema", None)
            found = self._known[func] = schema is not None and schema.name in self.names
        return found

    def keeps(self, func: Any, args: tuple, kwargs: dict | None) -> bool:
        """A kernel call whose output is worth keeping, and may be.

        * Attention over few keys (cross-attention to 512 text tokens beside 32k video tokens) costs
          little to recompute but keeps an output as large as self-attention's: only calls with at
          least a quarter as many keys as queries are kept.
        * With attention dropout the kernel draws from the generator; a replay that skipped it would
          shift every later draw of the recompute (other dropout masks) off the forward's, so such a
          call is recomputed like any other op.

        Forward and recompute see the same calls, so they decide alike, call for call.
        """
        if not self(func):
            return False
        if not _enough_keys(func, args):
            return False
        if func not in self._dropout:
            names = [a.name for a in func._schema.arguments]
            self._dropout[func] = names.index("dropout_p") if "dropout_p" in names else None
        where = self._dropout[func]
        if where is None:
            return True
        p = kwargs.get("dropout_p") if kwargs and "dropout_p" in kwargs else args[where] if where < len(args) else 0.0
        return not p

    def overloads(self) -> list[Any]:
        """The installed ops' overloads, for torch's selective checkpoint (compiled regions)."""
        found = []
        for name in sorted(self.names):
            namespace, _, op = name.partition("::")
            packet = getattr(getattr(torch.ops, namespace, None), op, None)
            if packet is not None:
                found.extend(getattr(packet, o) for o in packet.overloads())
        return found


_HEADS_FIRST = "aten::_scaled_dot_product_"  # (batch, heads, sequence, dim); the other kernels put heads third


def _enough_keys(func: Any, args: tuple) -> bool:
    if len(args) < 2 or not isinstance(args[0], torch.Tensor) or not isinstance(args[1], torch.Tensor):
        return True  # a kernel whose layout we do not know: keep
    dim = -2 if func._schema.name.startswith(_HEADS_FIRST) else -3
    q, k = args[0], args[1]
    if q.dim() < -dim or k.dim() < -dim:
        return True
    return 4 * k.shape[dim] >= q.shape[dim]


class _Keep(TorchDispatchMode):
    """The checkpoint's forward: run every op, and hand each kernel output to ``pack``."""

    def __init__(self, kernels: KernelSet, kept: list[Any], pack: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.kernels, self.kept, self.pack = kernels, kept, pack

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.kernels.keeps(func, args, kwargs):
            self.kept.append(tree_map_only(torch.Tensor, self.pack, out))
        return out


class _Replay(TorchDispatchMode):
    """The checkpoint's recompute: answer each kernel call with what the forward kept, in order."""

    def __init__(self, kernels: KernelSet, kept: list[Any], unpack: Callable[[Any], torch.Tensor]) -> None:
        super().__init__()
        self.kernels, self.kept, self.unpack = kernels, kept, unpack
        self.next = 0

    def __enter__(self) -> _Replay:
        self.next = 0  # each recompute (a second backward included) replays from the start
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.next < len(self.kept) and self.kernels.keeps(func, args, kwargs):
            kept = self.kept[self.next]
            self.next += 1
            return _map_kept(self.unpack, kept)
        return func(*args, **(kwargs or {}))


def _map_kept(unpack: Callable[[Any], torch.Tensor], kept: Any) -> Any:
    if isinstance(kept, (tuple, list)):
        return type(kept)(_map_kept(unpack, k) for k in kept)
    if kept is None or isinstance(kept, (int, float, bool, torch.SymInt)):
        return kept
    return unpack(kept)


def _on_device(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def _alias(t: torch.Tensor) -> torch.Tensor:
    return t.detach()  # a fresh alias per replay: autograd gives each recompute's output its own node


def context_fn(kernels: KernelSet, pack: Callable[[torch.Tensor], Any] | None = None,
               unpack: Callable[[Any], torch.Tensor] | None = None) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint``: kernels kept by ``pack`` (default: on the GPU)."""
    if torch.compiler.is_compiling():
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            return CheckpointPolicy.MUST_SAVE if kernels.keeps(func, args, kwargs) else CheckpointPolicy.PREFER_RECOMPUTE

        return partial(create_selective_checkpoint_contexts, policy)
    kept: list[Any] = []
    modes = (_Keep(kernels, kept, pack or _on_device), _Replay(kernels, kept, unpack or _alias))
    return lambda: modes
