"""Per-instance ``forward`` replacement: how gradseam gets between a model and its blocks.

Setting ``module.forward`` on the instance shadows the class method, so ``nn.Module.__call__``
(and with it every registered hook) keeps working, nothing is copied from the model's code, and
``state_dict()`` never sees a new key. The installed object is a plain class instance rather
than a closure so that ``copy.deepcopy`` and pickling carry it over to the copy correctly.

Wrappers installed on the same module *after* gradseam (diffusers' layerwise casting and group
offloading hooks, accelerate's hooks) sit outside the seam: their pre/post work (cast the weights
to the compute dtype, onload them) runs around the seam's call. A checkpoint recomputing the
module in backward, or a chain computing a later member ahead of its call, does not go through
the seam's call, so :class:`Original` routes such calls through the module's current outer
``forward`` (the wrappers), with the seam passing straight through, exactly as the model's own
call ran it.

That is right for wrappers that touch the module (cast or onload its weights), wrong for one that
transforms the call's arguments: diffusers' context parallelism splits a block's inputs across
ranks in a hook of its own. Installed after gradseam, that hook sits outside the seam, and a
recompute routed through it would split the already split inputs a second time (seen on a Wan
block: a shape mismatch in the rotary embedding; with other shapes it could compute on the wrong
shard without a word). The seam refuses that order when it sees it (:func:`_argument_hook_outside`);
context parallelism enabled *before* patching sits inside the seam and is exact.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Protocol

import torch
from torch import nn


class Handler(Protocol):
    def __call__(self, call: Original, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


_installed = itertools.count(1)  # every seam's install number: later seams have larger ones
_latest = [0]


class _Calls(threading.local):
    def __init__(self) -> None:
        self.running: list[SeamForward] = []  # seams whose handler runs on this thread, innermost last
        self.bypass: list[SeamForward] = []  # seams an outer wrapper is being re-entered for
        self.frontier: list[int] = []  # per running region: the latest seam installed when it ran forward


_calls = _Calls()


def _has(stack: list[SeamForward], seam: SeamForward) -> bool:
    return any(s is seam for s in stack)


class Original:
    """Calls whatever ``forward`` the module had before gradseam wrapped it.

    Called from inside the seam's own call, that is exactly the previous ``forward``. Called from
    outside it (a recompute in backward, a chain running this member ahead) while something has
    wrapped the module after gradseam, it goes through those wrappers too; see the module docstring.
    """

    __slots__ = ("function", "module", "previous", "seam")

    def __init__(self, module: nn.Module, previous: Any, seam: SeamForward | None = None) -> None:
        self.module = module
        self.previous = previous  # an instance-level forward someone installed before us, or None
        self.seam = seam
        # The class's forward, captured once: dynamo cannot trace ``type(module).forward`` on
        # diffusers block classes, but calls a plain function it was handed without trouble.
        self.function = type(module).forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        seam = self.seam
        if seam is not None and not torch.compiler.is_compiling():
            outer = self.module.__dict__.get("forward")
            if outer is not None and outer is not seam and not _has(_calls.running, seam):
                _calls.bypass.append(seam)
                try:
                    return outer(*args, **kwargs)
                finally:
                    _calls.bypass.pop()
        return self.direct(*args, **kwargs)

    def direct(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        if torch.compiler.is_compiling():
            return self.function(self.module, *args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


# diffusers' context-parallel hooks (diffusers.hooks.context_parallel): they split a module's inputs
# and gather its outputs, so running them twice on one call is not a no-op
_ARGUMENT_HOOKS = ("cp_input---", "cp_output---")


def _argument_hook_outside(seam: SeamForward) -> str | None:
    """The name of a diffusers hook registered on the seam's module *after* the seam that rewrites the
    call's arguments or outputs (context parallelism's), or None.

    diffusers' registry wraps whatever ``forward`` the module has when a hook registers, so the hooks
    from the first one that wrapped this seam onwards are the ones outside it.
    """
    registry = getattr(seam.module, "_diffusers_hook", None)
    refs, order = getattr(registry, "_fn_refs", None), getattr(registry, "_hook_order", None)
    if not refs or not order:
        return None
    first = next((i for i, ref in enumerate(refs)
                  if getattr(ref, "forward", None) is seam or getattr(ref, "original_forward", None) is seam), None)
    if first is None:
        return None
    return next((name for name in order[first:] if name.startswith(_ARGUMENT_HOOKS)), None)


def _refuse_argument_hooks(seam: SeamForward) -> None:
    name = _argument_hook_outside(seam)
    if name is not None:
        from ..errors import GradseamError

        raise GradseamError(
            f"diffusers' context parallelism was enabled after gradseam patched the model: its hook {name!r} on "
            f"{type(seam.module).__name__} wraps gradseam's seam, and a block recomputed in backward would have its "
            "already split inputs split again. Enable context parallelism first and patch afterwards "
            "(model.enable_parallelism(config=...), then gradseam.patch(model, ...)); on a patched model, "
            "handle.remove(), enable_parallelism, then patch again."
        )


class SeamForward:
    """The object installed as ``module.forward``; delegates to a strategy handler.

    ``owner`` is the patched model. A deep copy of the whole model copies the seam with it (the
    copy is patched too, with its own handle), but a deep copy of one block alone has no handle
    to undo it and would drag the block's whole chunk along: its seam copies as a pass-through
    that unlinks itself on the first call, so the copied block computes exactly as unpatched.
    """

    def __init__(self, module: nn.Module, handler: Handler | None, owner: nn.Module | None = None) -> None:
        self.original = Original(module, module.__dict__.get("forward"), self)
        self.handler = handler
        self.owner = owner
        self.epoch = _latest[0] = next(_installed)

    def __deepcopy__(self, memo: dict[int, Any]) -> SeamForward:
        import copy

        clone = SeamForward.__new__(SeamForward)
        memo[id(self)] = clone
        if self.owner is None or id(self.owner) in memo:  # the whole model is being copied
            clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
            return clone
        module = memo.get(id(self.module), self.module)
        clone.original = Original(module, copy.deepcopy(self.original.previous, memo), clone)
        clone.handler = None  # a pass-through: see the class docstring
        clone.owner = None
        return clone

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        handler = self.handler
        if handler is None:  # removed while something installed later still pointed at us
            if self.module.__dict__.get("forward") is self:  # ...and it has since put us back: unlink
                _unlink(self)
            return self.original.direct(*args, **kwargs)
        if torch.compiler.is_compiling():
            return handler(self.original, args, kwargs)
        if _calls.bypass and _has(_calls.bypass, self):  # re-entered through an outer wrapper
            return self.original.direct(*args, **kwargs)
        if self.module.__dict__.get("forward") is not self:  # wrapped after gradseam: by what?
            _refuse_argument_hooks(self)
        if _calls.frontier and self.epoch > _calls.frontier[-1]:
            # A region's recompute meets a seam installed after that region ran forward (a re-patch
            # between a forward and its backward): it passes through, so the recompute computes
            # exactly what the forward did and the old graph's backward runs as the old patch would.
            return self.original.direct(*args, **kwargs)
        _calls.running.append(self)
        try:
            return handler(self.original, args, kwargs)
        finally:
            _calls.running.pop()

    @property
    def module(self) -> nn.Module:
        return self.original.module


def latest() -> int:
    """The install number of the newest seam: what a region records when it runs forward."""
    return _latest[0]


class recomputing:  # noqa: N801 - used like a function: with recomputing(frontier)
    """Around a region's body: seams installed after ``frontier`` (the region's forward) pass through.

    A no-op under ``torch.compile``, like the region scope: dynamo cannot trace the thread-local.
    """

    __slots__ = ("frontier",)

    def __init__(self, frontier: int) -> None:
        self.frontier = frontier

    def __enter__(self) -> None:
        if not torch.compiler.is_compiling():
            _calls.frontier.append(self.frontier)

    def __exit__(self, *exc: object) -> None:
        if not torch.compiler.is_compiling():
            _calls.frontier.pop()


def install(module: nn.Module, handler: Handler, owner: nn.Module | None = None) -> SeamForward:
    seam = SeamForward(module, handler, owner)
    module.forward = seam  # type: ignore[method-assign]
    return seam


def uninstall(seam: SeamForward) -> None:
    """Restore the module's previous ``forward``.

    If something else wrapped the module after us, we cannot unlink ourselves from its chain,
    so we turn into a pass-through instead: behaviour is restored either way.
    """
    if seam.module.__dict__.get("forward") is seam:
        _unlink(seam)
    seam.handler = None


def _unlink(seam: SeamForward) -> None:
    module = seam.module
    if seam.original.previous is None:
        del module.forward
    else:
        module.forward = seam.original.previous  # type: ignore[method-assign]
