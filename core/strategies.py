"""Checkpoint regions: one block, a chunk of blocks, or a feed-forward seam inside a block.

Every region is a *chain*: modules that the model calls one after another, each on the previous
one's output. A chain of one is a plain checkpointed call. For longer chains (interval chunks,
or an FFN made of two submodules) the first member runs the whole chain inside one checkpoint
and keeps the later members' outputs; each later member, when called with exactly the object
its predecessor returned and the same other arguments, hands back the kept output instead of
computing. Anything else (a residual added between blocks, other arguments) makes that member
compute on its own and switches the chain to per-member regions from then on, so the result is
exact in every case and the model's own loop is never copied or edited.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .family import Carry
from .planning import _warn_once
from .seams import Original

Call = Callable[..., Any]

_state = threading.local()


def inside_region() -> bool:
    """True while a checkpoint region (forward or its recompute) is running on this thread.

    Attention offload consults it: inside a recomputed region nothing is kept for long, so
    moving those tensors to the CPU would cost copies and save nothing.
    """
    return getattr(_state, "depth", 0) > 0


class _RegionScope:
    # Under torch.compile the scope is a no-op: dynamo cannot trace the thread-local, and the only
    # reader (attention offload) runs eagerly anyway, outside any compiled region.
    def __enter__(self) -> None:
        if not torch.compiler.is_compiling():
            _state.depth = getattr(_state, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        if not torch.compiler.is_compiling():
            _state.depth -= 1


class Runner:
    """Runs a callable as one non-reentrant checkpoint region.

    ``saved_hooks`` (when set) wraps the checkpoint call in ``saved_tensors_hooks``: around a
    non-reentrant checkpoint those hooks see only what the checkpoint keeps across the region
    (its inputs), which is exactly what the unsloth backends move to the CPU.
    """

    def __init__(self, saved_hooks: Callable[[tuple, dict], Any] | None = None) -> None:
        self.saved_hooks = saved_hooks

    def __call__(self, fn: Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Keyword arguments go in positionally: checkpoint keeps positional tensors through
        # save_for_backward (visible to saved-tensor hooks, so they can be offloaded) but keyword
        # arguments only in a closure, out of any hook's reach.
        names = tuple(kwargs)
        n = len(args)

        def region(*flat: Any) -> Any:
            with _RegionScope():
                return fn(*flat[:n], **dict(zip(names, flat[n:])))

        flat = (*args, *kwargs.values())
        if self.saved_hooks is None:
            return checkpoint(region, *flat, use_reentrant=False)
        with self.saved_hooks(args, kwargs):
            return checkpoint(region, *flat, use_reentrant=False)


# -- how a chain member is called from its predecessor's output ------------------------------


def _same(a: Any, b: Any) -> bool:
    """Identity for tensors, structural equality for containers, ``==`` for plain values."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return False


class Link:
    """Declares how member ``j+1`` of a chain is called, given member ``j``'s output."""

    def next_call(self, member: nn.Module, prev_out: Any, head: inspect.BoundArguments) -> tuple[tuple, dict]:
        raise NotImplementedError

    def matches(self, member: nn.Module, prev_out: Any, head: inspect.BoundArguments, args: tuple, kwargs: dict) -> bool:
        raise NotImplementedError


def _bind(module: nn.Module, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs)
    bound.apply_defaults()
    return bound


class BlockLink(Link):
    """Blocks of one list: carried outputs go to named parameters, everything else is unchanged."""

    def __init__(self, carry: Carry) -> None:
        self.carry = carry

    def _carried(self, prev_out: Any) -> dict[str, Any]:
        return {name: prev_out if pos is None else prev_out[pos] for name, pos in self.carry.outputs.items()}

    def next_call(self, member: nn.Module, prev_out: Any, head: inspect.BoundArguments) -> tuple[tuple, dict]:
        arguments = dict(head.arguments)
        arguments.pop("self", None)
        arguments.update(self._carried(prev_out))
        bound = inspect.signature(type(member).forward).bind_partial(member, **_no_varargs(arguments))
        return (), {k: v for k, v in bound.arguments.items() if k != "self"}

    def matches(self, member: nn.Module, prev_out: Any, head: inspect.BoundArguments, args: tuple, kwargs: dict) -> bool:
        try:
            bound = _bind(member, args, kwargs)
        except TypeError:
            return False
        carried = self._carried(prev_out)
        for name, value in bound.arguments.items():
            if name == "self":
                continue
            expected = carried[name] if name in carried else head.arguments.get(name)
            if name in carried:
                if value is not expected:
                    return False
            elif not _same(value, expected):
                return False
        return True


def _no_varargs(arguments: dict[str, Any]) -> dict[str, Any]:
    # ``forward(self, x, **kwargs)`` binds the extras under "kwargs"; spread them back out.
    flat: dict[str, Any] = {}
    for name, value in arguments.items():
        if name == "kwargs" and isinstance(value, dict):
            flat.update(value)
        else:
            flat[name] = value
    return flat


class SeamLink(Link):
    """Submodules of an FFN seam: each takes the previous one's output as its only argument."""

    def next_call(self, member: nn.Module, prev_out: Any, head: inspect.BoundArguments) -> tuple[tuple, dict]:
        return (prev_out,), {}

    def matches(self, member: nn.Module, prev_out: Any, head: inspect.BoundArguments, args: tuple, kwargs: dict) -> bool:
        return len(args) == 1 and not kwargs and args[0] is prev_out


class Chain:
    """A checkpoint region spanning one or more modules; see the module docstring."""

    def __init__(self, members: Sequence[nn.Module], link: Link | None, runner: Runner, label: str) -> None:
        if len(members) > 1 and link is None:
            raise ValueError("a chain of several modules needs a link")
        self.members = list(members)
        self.link = link
        self.runner = runner
        self.label = label
        self.fallback = False  # set once a mismatch showed the model edits values between members
        self._originals: list[Original | None] = [None] * len(members)
        self._reset()

    def _reset(self) -> None:
        self._kept: list[Any] = []
        self._next = 0
        self._head: inspect.BoundArguments | None = None

    def reset(self) -> None:
        """Drop the outputs kept for later members (the patcher calls this around every model forward)."""
        self._reset()

    def __getstate__(self) -> dict[str, Any]:
        # A copy (deepcopy, pickle) starts with nothing in flight: kept outputs are graph tensors
        # of a step that belongs to the original and cannot be deep-copied anyway.
        return {**self.__dict__, "_kept": [], "_next": 0, "_head": None}

    def handler(self, index: int) -> Callable[[Original, tuple, dict], Any]:
        return _MemberHandler(self, index)

    def attach(self, index: int, original: Original) -> None:
        """Tell the chain how to call member ``index`` without going through its wrapper."""
        self._originals[index] = original

    def run_member(self, index: int, original: Original, args: tuple, kwargs: dict) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)  # inference: add no work
        if index == 0:
            return self._run_head(original, args, kwargs)
        return self._run_follower(index, original, args, kwargs)

    def _run_head(self, original: Original, args: tuple, kwargs: dict) -> Any:
        self._reset()
        if len(self.members) == 1 or self.fallback:
            return self.runner(original, args, kwargs)
        hooked = next((m for m in self.members[1:] if m._forward_pre_hooks), None)
        if hooked is not None:
            # Running a member ahead skips its pre-hooks, and they may be what makes it runnable:
            # FSDP2's fully_shard gathers the block's weights in one. Exact beats chunked; checked
            # on every call (not latched), so the chunk comes back once the hooks are removed.
            _warn_once(
                f"gradseam: {type(hooked).__name__} modules carry forward pre-hooks (FSDP2's fully_shard "
                "gathers a block's weights in one), and a checkpoint chunk would run them ahead of those "
                "hooks; they are checkpointed one at a time instead, so gradient_checkpointing_interval "
                "has no effect on them."
            )
            return self.runner(original, args, kwargs)
        head = _bind(self.members[0], args, kwargs)
        link = self.link
        assert link is not None
        originals = self._originals

        def whole_chain(*a: Any, **k: Any) -> tuple[Any, ...]:
            outs = [originals[0](*a, **k)]  # type: ignore[misc]
            for j in range(1, len(self.members)):
                ca, ck = link.next_call(self.members[j], outs[-1], head)
                outs.append(originals[j](*ca, **ck))  # type: ignore[misc]
            return tuple(outs)

        outs = self.runner(whole_chain, args, kwargs)
        self._kept = list(outs)
        self._head = head
        self._next = 1
        return outs[0]

    def _run_follower(self, index: int, original: Original, args: tuple, kwargs: dict) -> Any:
        head, kept = self._head, self._kept
        if head is not None and self._next == index:
            assert self.link is not None
            if self.link.matches(self.members[index], kept[index - 1], head, args, kwargs):
                out = kept[index]
                if index == len(self.members) - 1:
                    self._reset()  # drop references to the chunk's outputs as soon as possible
                else:
                    self._next = index + 1
                return out
            # The model changed something between members: stay exact, compute this one alone.
            self.fallback = True
        self._reset()
        return self.runner(original, args, kwargs)


class _MemberHandler:
    __slots__ = ("chain", "index")

    def __init__(self, chain: Chain, index: int) -> None:
        self.chain = chain
        self.index = index

    def __call__(self, original: Original, args: tuple, kwargs: dict) -> Any:
        return self.chain.run_member(self.index, original, args, kwargs)
