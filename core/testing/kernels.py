"""Where attention kernels run, and whether that matches what the family declares.

A declaration that cuts in the wrong place is exact, so parity cannot catch it: an "FFN seam" around
attention makes the ``-ffn`` backends recompute attention and keep every feed-forward activation, and an
attention side that misses the module calling the kernel makes kept attention recompute it while
``summary()`` says otherwise. :func:`locate_kernels` records, in an unpatched step, which submodule of
which declared block calls each attention kernel (:mod:`gradseam.run.kernels`); the two assertions
compare that with the declaration and name the module to declare. :func:`count_kernels` counts kernel
calls in a patched step, to prove that kept attention really is not recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@contextmanager
def count_kernels(*, kept_only: bool = True) -> Iterator[list[int]]:
    """How many attention kernel calls (:mod:`gradseam.run.kernels`) that kept attention keeps really run.

    An outermost dispatch mode: a kernel answered from kept outputs in a recompute never reaches
    it, so with attention kept a patched step counts exactly what an unpatched step counts
    (:attr:`KernelMap.keepable`). Only calls the runtime keeps count: one over few keys (PixArt's
    cross-attention to 300 prompt tokens beside 4,096 image tokens) or under attention dropout is
    recomputed on purpose (:meth:`gradseam.run.kernels.KernelSet.keeps`), and counting it would fail a
    correct declaration. ``kept_only=False`` counts every call (to see such a kernel run again).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    from ..run.kernels import attention_kernels

    kernels = attention_kernels()
    count = [0]

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if kernels.keeps(func, args, kwargs) if kept_only else kernels(func):  # kept_only: the others recompute
                count[0] += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        yield count


# -- where attention kernels are called, against what the family declares ----------------------


@dataclass(frozen=True)
class KernelSite:
    """One attention kernel call of an unpatched step, and where in the model it was made.

    ``block`` labels the declared block it ran in (``"transformer_blocks[3]"``; ``""`` outside every
    block), ``module`` is the innermost submodule of that block whose ``forward`` was running (a path
    relative to the block, ``""`` for the block's own ``forward``), ``stack`` every submodule of the
    block on the call stack, outermost first.
    """

    op: str
    block: str
    block_type: str
    module: str
    stack: tuple[str, ...]


@dataclass
class KernelMap:
    """What :func:`locate_kernels` saw: each kernel call, which block submodules ran, and the declarations."""

    sites: list[KernelSite] = field(default_factory=list)
    called: set[tuple[str, str]] = field(default_factory=set)  # (block, submodule path) of every call
    declared: dict[str, Any] = field(default_factory=dict)  # block label -> its BlockClass
    keepable: int = 0  # the calls kept attention keeps (enough keys, no dropout): what count_kernels counts
    # (list path, block index, submodule path) of each call into a block made while that block was not running,
    # outermost only (DiT's norm1.emb after the loop): what BlockList.called_outside must declare
    outside: set[tuple[str, int, str]] = field(default_factory=set)
    # (list path, block index, tensor path) of each read of a block's parameter or buffer's values (or device)
    # made while neither that block nor a call into it was running: the same declaration covers them
    reads: set[tuple[str, int, str]] = field(default_factory=set)

    @property
    def count(self) -> int:
        return len(self.sites)

    def copy(self) -> KernelMap:
        """A copy with containers of its own (the sites and declarations are immutable and shared)."""
        return KernelMap(list(self.sites), set(self.called), dict(self.declared), self.keepable, set(self.outside),
                         set(self.reads))


# What reading a tensor's metadata calls (torch function mode sees them): the same for a streamed weight's host copy,
# so not a use of its values. ``device`` is left out on purpose: a streamed weight's is the host's.
_METADATA = frozenset({"dtype", "shape", "requires_grad", "is_leaf", "ndim", "layout", "names", "grad_fn", "grad",
                       "_version", "is_sparse", "is_quantized", "is_meta", "is_nested", "itemsize", "nbytes",
                       "size", "dim", "numel", "nelement", "ndimension", "element_size", "is_floating_point",
                       "is_complex", "stride", "__hash__", "__len__"})


def _metadata(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    return name in _METADATA


@contextmanager
def locate_kernels(model: nn.Module, family: Any) -> Iterator[KernelMap]:
    """Count the attention kernel calls (:mod:`gradseam.run.kernels`) in the block, as :func:`count_kernels`
    does, and record for each which submodule of which declared block made it.

    For an unpatched model: forward hooks on every submodule of every block the family declares keep
    a call stack, and an outermost dispatch mode reads it whenever a kernel runs. The same stack says which
    submodules are called while their block is not running (:attr:`KernelMap.outside`; a module two blocks
    share is left out of that), and a torch function mode entered for the model's forward which of a block's
    parameters and buffers are read then (:attr:`KernelMap.reads`: ``block.scale_shift_table`` used by the model itself; a tensor two
    blocks share is left out). The hooks are removed on exit.
    """
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from ..planning import resolve, unwrap
    from ..run.kernels import attention_kernels

    kernels = attention_kernels()
    found = KernelMap()
    stack: list[tuple[str, str]] = []
    handles: list[Any] = []
    block_types: dict[str, str] = {}  # block label -> the block's class name
    hooked: dict[str, tuple[str, int, nn.Module]] = {}  # block label -> (list path, index, block) of each declared one

    def enter(label: str, path: str, outside: tuple[str, int, str] | None) -> Callable[..., None]:
        def pre(module: nn.Module, args: Any) -> None:
            if outside is not None and not any(owner == label for owner, _ in stack):
                found.outside.add(outside)  # neither its block nor an outer call into it is running
            stack.append((label, path))
            found.called.add((label, path))

        return pre

    def leave(label: str, path: str) -> Callable[..., None]:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            for i in range(len(stack) - 1, -1, -1):  # the latest entry (a module shared by blocks is hooked twice)
                if stack[i] == (label, path):
                    del stack[i]
                    break

        return post

    every = [unwrap(raw) for block_list in family.block_lists for raw in (resolve(model, block_list.path) or ())]
    seen: set[int] = set()
    shared: set[int] = set()  # modules two blocks hold (one rotary module handed to every block)
    for block in every:
        mine = {id(m) for m in block.modules() if m is not block}
        shared |= seen & mine
        seen |= mine
    for block_list in family.block_lists:
        blocks = resolve(model, block_list.path)
        if blocks is None:
            continue
        for index, raw in enumerate(blocks):
            block = unwrap(raw)
            declared = family.block_class_for(type(block))
            if declared is None:
                continue
            label = f"{block_list.path}[{index}]"
            found.declared[label] = declared
            hooked[label] = (block_list.path, index, block)
            block_types[label] = type(block).__qualname__
            for path, sub in block.named_modules():
                outside = (block_list.path, index, path) if path and id(sub) not in shared else None
                handles.append(sub.register_forward_pre_hook(enter(label, path, outside)))
                handles.append(sub.register_forward_hook(leave(label, path), always_call=True))

    # id of each tensor of a declared block -> (block label, (list path, index, tensor path)); one two blocks hold
    # is left out
    owners: dict[int, tuple[str, tuple[str, int, str]]] = {}
    twice: set[int] = set()
    for label, (list_path, index, block) in hooked.items():
        for path, sub in block.named_modules():
            if id(sub) in shared:
                continue
            for name, t in [*sub._parameters.items(), *sub._buffers.items()]:
                if t is None:
                    continue
                if id(t) in owners and owners[id(t)][0] != label:
                    twice.add(id(t))
                owners.setdefault(id(t), (label, (list_path, index, f"{path}.{name}" if path else name)))
    for key in twice:
        del owners[key]

    class _Reads(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if not _metadata(func):
                for leaf in tree_leaves((args, kwargs or {})):
                    owner = owners.get(id(leaf))
                    if owner is not None and not any(running == owner[0] for running, _ in stack):
                        found.reads.add(owner[1])
            return func(*args, **(kwargs or {}))

    class _Locate(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if kernels(func):
                label = stack[-1][0] if stack else ""
                inside = tuple(path for owner, path in stack if owner == label and path)
                found.sites.append(KernelSite(func._schema.name, label, block_types.get(label, ""),
                                              inside[-1] if inside else "", inside))
                found.keepable += kernels.keeps(func, args, kwargs)
            return func(*args, **(kwargs or {}))

    # reads are watched inside the model's forward only: the step around it hands the parameters to autograd and
    # reads their gradients, which streaming does not mind
    reads = _Reads()

    def watch(module: nn.Module, args: Any) -> None:  # returns None: a pre-hook's value would replace the inputs
        reads.__enter__()

    def unwatch(module: nn.Module, args: Any, output: Any) -> None:
        reads.__exit__(None, None, None)

    handles.append(model.register_forward_pre_hook(watch))
    handles.append(model.register_forward_hook(unwatch, always_call=True))
    try:
        with _Locate():
            yield found
    finally:
        for handle in handles:
            handle.remove()


def _on_stack(site: KernelSite, path: str) -> bool:
    return path in site.stack


def assert_seams_hold_no_attention(found: KernelMap, *, what: str = "") -> None:
    """No FFN seam calls an attention kernel. The ``-ffn`` backends recompute each seam in backward and keep
    only its input: a seam around attention recomputes attention and keeps every feed-forward activation,
    the opposite of what they are for, while every result stays exact (so parity alone cannot tell)."""
    prefix = f"{what}: " if what else ""
    for site in found.sites:
        declared = found.declared.get(site.block)
        if declared is None:
            continue
        for seam in declared.ffn:
            inside = [p for p in seam if _on_stack(site, p)]
            if inside:
                where = f"in {site.module!r}" if site.module != inside[0] else ""
                raise AssertionError(
                    f"{prefix}FFN seam {'→'.join(seam)} of {site.block_type} ({site.block}) contains attention: "
                    f"{inside[0]!r} calls an attention kernel ({site.op}){' ' + where if where else ''}. The -ffn "
                    "backends recompute a seam in backward and keep only its input, so this seam recomputes "
                    "attention and keeps every feed-forward activation: exact, but the opposite of what they are "
                    "for. Declare the feed-forward modules (the MLP) as the seam and the attention modules as the "
                    "attention side (see 'FFN seams' in docs/plugins.md)."
                )


def assert_attention_side_covers_kernels(found: KernelMap, *, what: str = "") -> None:
    """Every attention kernel a block calls runs inside its declared attention side (for block classes that
    declare one). Kept attention enters its kernel modes only inside the declared attention submodules, so a
    kernel called elsewhere is recomputed in backward (and attention offload leaves its saved tensors where
    they are) while ``summary()`` still says "except attention kernels"."""
    prefix = f"{what}: " if what else ""
    for site in found.sites:
        declared = found.declared.get(site.block)
        if declared is None or not declared.attention:
            continue
        if any(_on_stack(site, p) for p in declared.attention):
            continue
        notes = []
        for path in declared.attention:
            if (site.block, path) not in found.called:
                notes.append(f"{path!r} is never called by this block")
            elif not any(s.block == site.block and _on_stack(s, path) for s in found.sites):
                notes.append(f"{path!r} calls no attention kernel")
        declared_side = repr(tuple(declared.attention))
        if site.module:
            where = f"submodule {site.module!r}"
            fix = f"Declare {site.module!r} in BlockClass(attention=...)"
            if notes:
                fix += " in place of the module(s) that call no kernel"
        else:
            where = "the block's own forward, outside any submodule"
            fix = ("No attention side can cover that: declare none (attention=()), and kept attention watches "
                   "the whole block")
        raise AssertionError(
            f"{prefix}{site.block_type} ({site.block}) calls an attention kernel ({site.op}) in {where}, which "
            f"is outside its declared attention side {declared_side}{' (' + '; '.join(notes) + ')' if notes else ''}. "
            "Kept attention keeps kernel outputs only inside the declared attention modules, so this kernel is "
            "recomputed in backward while summary() says 'except attention kernels', and attention offload "
            f"leaves its saved tensors in place. {fix} (see 'Attention side' in docs/plugins.md)."
        )
