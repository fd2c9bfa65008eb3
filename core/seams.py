"""Per-instance ``forward`` replacement: how gradseam gets between a model and its blocks.

Setting ``module.forward`` on the instance shadows the class method, so ``nn.Module.__call__``
(and with it every registered hook) keeps working, nothing is copied from the model's code, and
``state_dict()`` never sees a new key. The installed object is a plain class instance rather
than a closure so that ``copy.deepcopy`` and pickling carry it over to the copy correctly.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn


class Handler(Protocol):
    def __call__(self, call: Original, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


class Original:
    """Calls whatever ``forward`` the module had before gradseam wrapped it."""

    __slots__ = ("module", "previous")

    def __init__(self, module: nn.Module, previous: Any) -> None:
        self.module = module
        self.previous = previous  # an instance-level forward someone installed before us, or None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


class SeamForward:
    """The object installed as ``module.forward``; delegates to a strategy handler."""

    def __init__(self, module: nn.Module, handler: Handler | None) -> None:
        self.original = Original(module, module.__dict__.get("forward"))
        self.handler = handler

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        handler = self.handler
        if handler is None:  # removed while something installed later still points at us
            return self.original(*args, **kwargs)
        return handler(self.original, args, kwargs)

    @property
    def module(self) -> nn.Module:
        return self.original.module


def install(module: nn.Module, handler: Handler) -> SeamForward:
    seam = SeamForward(module, handler)
    module.forward = seam  # type: ignore[method-assign]
    return seam


def uninstall(seam: SeamForward) -> None:
    """Restore the module's previous ``forward``.

    If something else wrapped the module after us, we cannot unlink ourselves from its chain,
    so we turn into a pass-through instead: behaviour is restored either way.
    """
    module = seam.module
    if module.__dict__.get("forward") is seam:
        if seam.original.previous is None:
            del module.forward
        else:
            module.forward = seam.original.previous  # type: ignore[method-assign]
    seam.handler = None


def installed_seam(module: nn.Module) -> SeamForward | None:
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, SeamForward) else None
