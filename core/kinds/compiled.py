"""Compiled-block regions (``compile``, ``unsloth-compile``): each block runs through ``torch.compile``
and the compiler's partitioner chooses what it keeps under ``gradient_checkpointing_memory_budget``;
what it keeps optionally offloaded. The run layer's half is :mod:`gradseam.run.compiled`.

This kind owns the memory budget key (refused with any other kind), refuses the keys the compiler
makes moot (interval chunks, kept attention), and refuses models the user compiled or put under
diffusers' layerwise casting, at patch time and again if that happens after patching, and weights whose
kernels the compiler cannot trace (optimum-quanto's Marlin fp8 tensors) at patch time and again before
each compile (quanto packs them when the model moves to a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..backends import CATALOG, Backend, Destination, Offload
from ..config import CheckpointConfig
from ..errors import UnsupportedStrategyError
from ..family import Family
from .base import RegionKind, RegionView, siblings

if TYPE_CHECKING:  # no torch at import: the tools read the kinds before torch is imported
    from torch import nn

BUDGET_KEY = "gradient_checkpointing_memory_budget"


class CompiledBlock(RegionKind):
    name = "compiled-block"
    compiles = True
    takes_interval = False
    # The compiler sums a tensor's gradient contributions in its own order, so compiled blocks match the
    # eager model to rounding, not bit for bit (docs/reliability.md).
    tolerance = 1e-5
    _global = "COMPILED_BLOCK"

    def may_keep_weights(self, backend: Backend) -> bool:
        # the partitioner may save a weight its backward needs; what an offloading backend saves goes to host memory
        return backend.offload is not Offload.SAVED

    def check_foreign(self, backend: Backend | None, config: CheckpointConfig) -> None:
        budget = config.gradient_checkpointing_memory_budget
        if budget is not None and (backend is None or backend.kind != self.name):
            users = [b.name for b in CATALOG.values() if b.kind == self.name]
            raise UnsupportedStrategyError(
                f"{BUDGET_KEY}={budget:g} is the compiler's activation memory budget for compiled blocks; backend "
                f"{backend.name if backend else 'none (checkpointing is off)'!r} compiles nothing. Use it with "
                f"{users}, or remove the key."
            )

    def settings(self, config: CheckpointConfig) -> dict[str, Any]:
        return {"memory_budget": config.memory_budget}

    def check_config(self, backend: Backend, config: CheckpointConfig) -> None:
        if config.gradient_checkpointing_interval and config.interval > 1:
            raise UnsupportedStrategyError(
                f"gradient_checkpointing_interval={config.interval}: backend {backend.name!r} makes every compiled "
                "block its own region (the compiler decides what each keeps), so blocks cannot be chunked. Remove "
                "the interval (gradient_checkpointing_segment_stride still selects which blocks are compiled)."
            )
        if config.keep_attention or config.offload_attention:
            key = ("gradient_checkpointing_offload_attention" if config.offload_attention
                   else "gradient_checkpointing_keep_attention")
            moving = next((b.name for b in siblings(backend) if b.moves), None)
            hint = "" if backend.moves or moving is None else f"; to hold them in CPU memory use {moving!r}"
            raise UnsupportedStrategyError(
                f"{key}: backend {backend.name!r} already keeps attention outputs (the compiler's partitioner "
                f"keeps what is costly to recompute){hint}. Remove the key."
            )

    def refuse_model(self, backend: Backend, model: nn.Module, family: Family) -> None:
        refuse_user_compiled(model, family, backend.name)
        refuse_uncompilable_weights(model, backend.name)

    def changed_since(self, model: nn.Module, blocks: Sequence[nn.Module]) -> bool:
        """The user compiled a block or the model (``block.compile()``, ``compile_repeated_blocks``,
        ``model.compile()``) after patching: planning again refuses it, naming the fix, where running on
        would silently drop the memory budget and the offload."""
        from ..modules import unwrap

        if getattr(model, "_compiled_call_impl", None) is not None:
            return True
        return any(getattr(unwrap(m), "_compiled_call_impl", None) is not None for m in blocks)

    def describe(self, region: Any, *, own: str, later: str) -> str:
        where = "CPU" if region.destination is Destination.HOST else own
        return (f"{region.backend}: compiled, the compiler recomputes under memory budget {region.memory_budget:g}; "
                f"what it keeps in {where} memory{later}")

    def notes(self, views: Sequence[RegionView]) -> list[str]:
        """One note for every compiled block a foreign compile traced (one per block would flood a 57-block model)."""
        fell = [v for v in views if v.fallbacks]
        if not fell:
            return []
        causes: dict[str, int] = {}
        for v in fell:
            for cause, n in v.fallbacks.items():
                causes[cause] = causes.get(cause, 0) + n
        why = "; ".join(f"{n}x {cause}" for cause, n in sorted(causes.items(), key=lambda kv: -kv[1]))
        return [f"{len(fell)} compiled block(s), from {fell[0].label}, did not run gradseam's compiled call: {why}. "
                "With a compiled backend compile nothing yourself, or keep your compile with a non-compiling "
                "backend such as 'torch'"]


COMPILED_BLOCK = CompiledBlock()


def refuse_user_compiled(model: nn.Module, family: Family, backend: str) -> None:
    """A block the user compiled already would be traced whole by their compiler, seams included: the
    compiled backends' own compile (and their offload group outside it) could not take effect. The same
    for the whole model (``model.compile()``): its compiled call would trace every block, seams and all."""
    from ..modules import is_optimized, resolve, unwrap

    if getattr(model, "_compiled_call_impl", None) is not None:
        raise UnsupportedStrategyError(
            f"{type(model).__name__} is compiled with model.compile(), and backend {backend!r} compiles "
            "each block itself, under its memory budget: inside your compiled model the blocks would be traced "
            "by your compiler, so the budget and the offload would not apply. Compile nothing yourself and let "
            "the backend compile the blocks, or keep your compile with a non-compiling backend such as 'torch'."
        )
    for block_list in family.block_lists:
        for index, outer in enumerate(resolve(model, block_list.path) or ()):
            if is_optimized(outer) or getattr(unwrap(outer), "_compiled_call_impl", None) is not None:
                raise UnsupportedStrategyError(
                    f"{type(model).__name__}.{block_list.path}[{index}] is already compiled with torch.compile "
                    f"(torch.compile(block), block.compile() or compile_repeated_blocks), and backend "
                    f"{backend!r} compiles each block itself, under its memory budget. Patch the uncompiled "
                    "model and let the backend compile (remove your torch.compile of the blocks), or keep your "
                    "compile with a non-compiling backend such as 'torch'."
                )


LAYERWISE_CASTING = "layerwise_casting"  # the name diffusers registers its casting hook under


def layerwise_cast(module: nn.Module) -> list[str]:
    """The submodules of ``module`` under diffusers' layerwise casting (``enable_layerwise_casting``)."""
    found = []
    for name, sub in module.named_modules():
        registry = getattr(sub, "_diffusers_hook", None)
        get = getattr(registry, "get_hook", None)
        if get is not None and get(LAYERWISE_CASTING) is not None:
            found.append(name or type(module).__name__)
    return found


def refuse_layerwise_casting(model: nn.Module, backend: str) -> None:
    """diffusers' layerwise casting stores weights in one dtype and casts them per call in a hook that swaps
    ``.data``; traced by the compiler, the backward of a compiled block then multiplies float32 by float16
    ("expected m1 and m2 to have the same dtype"), deep in the first step. Refused before anything runs."""
    cast = layerwise_cast(model)
    if cast:
        raise UnsupportedStrategyError(
            f"backend {backend!r} cannot compile blocks under diffusers' layerwise casting (enabled on "
            f"{len(cast)} modules of {type(model).__name__}, e.g. {cast[0]!r}): the compiled backward fails on "
            "the mixed dtypes. Use an eager backend ('unsloth' with gradient_checkpointing_offload_attention, "
            "or 'torch'), which run layerwise casting exactly, or store the weights in the compute dtype "
            "(model.to(torch.bfloat16)) instead of layerwise casting."
        )


def marlin_weights(module: nn.Module) -> list[str]:
    """The parameters of ``module`` that are optimum-quanto Marlin tensors (``MarlinF8QBytesTensor``: quanto
    packs qfloat8 weights that way on a CUDA GPU of compute capability 8 or more, for its own kernel)."""
    return [name for name, p in module.named_parameters()
            if type(p).__name__.startswith("Marlin") and type(p).__module__.startswith("optimum.quanto")]


def refuse_uncompilable_weights(module: nn.Module, backend: str) -> None:
    """Weights a compiled block cannot run with, refused before anything runs: diffusers' layerwise casting
    (:func:`refuse_layerwise_casting`) and optimum-quanto's Marlin fp8 weights, whose kernel has no
    fake-tensor implementation, so dynamo fails on the first linear it traces ("RuntimeError when making
    fake tensor call", seen on the H200 with Flux dev)."""
    refuse_layerwise_casting(module, backend)
    marlin = marlin_weights(module)
    if marlin:
        raise UnsupportedStrategyError(
            f"backend {backend!r} cannot compile {type(module).__name__}: {len(marlin)} of its weights (e.g. "
            f"{marlin[0]!r}) are optimum-quanto Marlin fp8 tensors (quanto's qfloat8 on a CUDA GPU), whose kernel "
            "torch.compile cannot trace. Use an eager backend: 'unsloth' with "
            "gradient_checkpointing_offload_attention (the least memory) or 'torch'; or quantize with torchao "
            "(Float8WeightOnlyConfig(set_inductor_config=False)), whose fp8 weights compile "
            "(docs/strategies.md, Quantized bases)."
        )
