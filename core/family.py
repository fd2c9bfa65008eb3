"""What an adapter declares about a model family: plain data, no behaviour.

This module and :mod:`gradseam.hookspecs` are the only parts of the core an adapter imports.
Classes are named by their qualified name (``"diffusers.models....FluxTransformer2DModel"``)
so an adapter can describe a class before the installed diffusers has it, and so that listing
families never imports diffusers model modules. A bare class name without a module
(``"MageFlowTransformer2DModel"``) matches a class of that name from any module, for classes
whose upstream home is not settled yet.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

ClassRef = str | type


def class_name(ref: ClassRef) -> str:
    """The qualified name used everywhere a class is matched."""
    if isinstance(ref, str):
        return ref
    return f"{ref.__module__}.{ref.__qualname__}"


@dataclass(frozen=True)
class Carry:
    """How a block's output feeds the next block of the same list (needed for interval chunks).

    ``outputs`` maps a parameter name of the block's ``forward`` to the position of that value in
    the block's return value, or to ``None`` when the block returns that single tensor. Flux's
    double block returns ``(encoder_hidden_states, hidden_states)``, so it declares
    ``{"encoder_hidden_states": 0, "hidden_states": 1}``; Wan's block returns ``hidden_states``,
    so ``{"hidden_states": None}``. Every other argument must be passed unchanged along the list.
    """

    outputs: Mapping[str, int | None]


@dataclass(frozen=True)
class BlockList:
    """One ``nn.ModuleList`` of transformer blocks, found by attribute path on the model."""

    path: str
    carry: Carry | None = None  # None: blocks of this list cannot be chunked (interval is ignored)
    optional: bool = False  # the attribute may be missing or None in some configs


@dataclass(frozen=True)
class BlockClass:
    """The safe cuts inside one block class.

    ``ffn``: the feed-forward side as one or more *seams*. A seam is a tuple of submodule paths
    that the block calls in sequence, each on exactly the previous one's output (``("ff",)``, or
    ``("proj_mlp", "act_mlp")`` for a block whose MLP has no module of its own); gradseam runs a
    whole seam as one checkpoint region. Empty means the block has no safe FFN boundary and the
    ``-ffn`` backends refuse it.

    ``attention``: the submodules that make up the attention side (their saved tensors are what
    attention offload moves to the CPU). Empty means attention offload is refused.
    """

    cls: ClassRef
    ffn: tuple[tuple[str, ...], ...] = ()
    attention: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return class_name(self.cls)


@dataclass(frozen=True)
class Preset:
    """A real-size architecture config (constructor kwargs) for benchmarks; weights are never downloaded.

    ``make_inputs(model, device, dtype, tokens, **inputs)`` builds one real-size batch of forward
    keyword arguments for ``model`` (built from ``config``, possibly with truncated block lists)
    directly on ``device``: floating inputs in ``dtype``, the latents requiring grad. ``tokens``
    overrides the preset's image (or video) token count, approximately; None keeps the preset's.
    The preset's ``inputs`` are passed as keyword arguments, so they stay the one source of the sizes.
    """

    description: str
    config: Mapping[str, Any]
    inputs: Mapping[str, Any] = field(default_factory=dict)
    make_inputs: Callable[..., Mapping[str, Any]] | None = None


@dataclass(frozen=True)
class Family:
    """Everything gradseam needs to patch one model family."""

    name: str
    models: tuple[ClassRef, ...]
    block_lists: tuple[BlockList, ...]
    block_classes: tuple[BlockClass, ...]
    description: str = ""
    presets: Mapping[str, Preset] = field(default_factory=dict)

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(class_name(m) for m in self.models)

    @property
    def has_ffn(self) -> bool:
        return bool(self.block_classes) and all(bc.ffn for bc in self.block_classes)

    @property
    def has_attention(self) -> bool:
        return bool(self.block_classes) and all(bc.attention for bc in self.block_classes)

    @property
    def supports_interval(self) -> bool:
        return any(bl.carry is not None for bl in self.block_lists)

    def block_class_for(self, module_type: type) -> BlockClass | None:
        """The declaration matching a block's class, looking through subclasses' MRO."""
        by_name = {bc.name: bc for bc in self.block_classes}
        for klass in module_type.__mro__:
            found = by_name.get(class_name(klass)) or by_name.get(klass.__qualname__)
            if found is not None:
                return found
        return None
