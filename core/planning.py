"""The plan: which modules of a model become which regions, and what each region does, decided once.

Planning is separate from installing so that a refused configuration (an ``-ffn`` backend on a
family without an FFN boundary, say) raises while the model is still exactly as it was, and so
that tools (the summary, the conformance kit, the advisor) can inspect a plan without patching.

It is also the one place that turns a config into behaviour. :func:`strategy_of` reads the config
and the backend catalog once (which scope, what is offloaded, where kept attention kernel outputs
live); :func:`plan` copies that into an immutable :class:`RegionSpec` per region (the types live in
:mod:`gradseam.spec`, so what reads a plan does not depend on how one is made). The run layer
(:mod:`gradseam.run.install`) turns specs into what runs, and the summary, ``handle.regions()``,
bench, advise and the kit read the specs: none of them looks at a backend's name again.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from .backends import CATALOG, Backend, Offload, Scope
from .config import CheckpointConfig
from .errors import GradseamWarning, UnsupportedModelError, UnsupportedStrategyError, warn_once, warned  # noqa: F401 - GradseamWarning and warned are re-exported
from .family import BlockClass, BlockList, Family
from .spec import Kept, Kind, LinkKind, Plan, RegionSpec, Strategy, strategy_of  # noqa: F401 - strategy_of re-exported


def resolve(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _blocks(model: nn.Module, family: Family) -> list[tuple[BlockList, list[nn.Module]]]:
    found = []
    for block_list in family.block_lists:
        modules = resolve(model, block_list.path)
        if modules is None:
            if block_list.optional:
                continue
            raise UnsupportedModelError(
                f"family {family.name!r} expects a block list at {type(model).__name__}.{block_list.path}, "
                "but the model has none; the adapter does not match this model version."
            )
        found.append((block_list, [unwrap(m) for m in modules]))
    return found


def unwrap(module: nn.Module) -> nn.Module:
    """The block inside torch's activation-checkpoint wrapper(s) or ``torch.compile``'s ``OptimizedModule``
    (``blocks[i] = torch.compile(blocks[i])``), or the module itself."""
    while True:
        inner = getattr(module, "_checkpoint_wrapped_module", None)
        if not isinstance(inner, nn.Module):
            inner = module._modules.get("_orig_mod") if is_optimized(module) else None
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def is_optimized(module: nn.Module) -> bool:
    return type(module).__name__ == "OptimizedModule" and type(module).__module__.startswith("torch._dynamo")


def _refuse_user_compiled(model: nn.Module, family: Family, backend: Backend) -> None:
    """A block the user compiled already would be traced whole by their compiler, seams included: the
    compiled backends' own compile (and their offload group outside it) could not take effect. The same
    for the whole model (``model.compile()``): its compiled call would trace every block, seams and all."""
    if getattr(model, "_compiled_call_impl", None) is not None:
        raise UnsupportedStrategyError(
            f"{type(model).__name__} is compiled with model.compile(), and backend {backend.name!r} compiles "
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
                    f"{backend.name!r} compiles each block itself, under its memory budget. Patch the uncompiled "
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


def _externally_checkpointed(model: nn.Module) -> set[int]:
    """Ids of every module inside a ``CheckpointWrapper`` (torch's activation checkpointing).

    FSDP's and accelerate's ``activation_checkpointing`` (``apply_activation_checkpointing``) wrap
    modules in it; a gradseam region on or inside such a module would checkpoint twice. A block in
    this set sits in (or is) a wrapper; a block containing one of them has a wrapped part.
    """
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    except ImportError:  # torch built without distributed support
        return set()
    return {id(m) for w in model.modules() if isinstance(w, CheckpointWrapper) for m in w.modules()}


def _block_class(family: Family, block: nn.Module, where: str) -> BlockClass:
    declared = family.block_class_for(type(block))
    if declared is None:
        raise UnsupportedModelError(
            f"family {family.name!r} declares no block class for {type(block).__qualname__} at {where}; "
            f"declared: {[bc.name.rsplit('.', 1)[-1] for bc in family.block_classes]}."
        )
    return declared


def _selected(index: int, config: CheckpointConfig) -> bool:
    if config.stride is None:
        return True
    return index % config.stride < config.interval


def _absent(block: nn.Module, paths: tuple[str, ...], declared: BlockClass) -> bool:
    """A seam whose modules this instance lacks, and that the family declared optional."""
    return all(p in declared.optional and resolve(block, p) is None for p in paths)


def _submodule(block: nn.Module, path: str, family: Family, where: str) -> nn.Module:
    sub = resolve(block, path)
    if not isinstance(sub, nn.Module):
        raise UnsupportedModelError(
            f"family {family.name!r} names submodule {path!r} of {type(block).__qualname__} ({where}), "
            "but the block has no such module."
        )
    return sub


def _check_carry(family: Family, block_list: BlockList, block: nn.Module) -> None:
    """Carry and per_block name ``forward`` parameters: say so at planning, not at the first step.

    Positions can only be checked against what a block returns, so the chain checks those when a
    chunk runs (and names the family there too).
    """
    carry = block_list.carry
    assert carry is not None
    params = list(inspect.signature(type(block).forward).parameters.values())[1:]  # the receiver, whatever its name
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    open_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    for name, position in carry.outputs.items():
        if name not in named and not open_kwargs:
            raise UnsupportedModelError(
                f"family {family.name!r}: the Carry of block list {block_list.path!r} names {name!r}, which "
                f"{type(block).__qualname__}.forward does not take (its parameters: {sorted(named)}); fix the "
                "Carry in the adapter (see 'Carry' in docs/plugins.md)."
            )
        if position is not None and (isinstance(position, bool) or not isinstance(position, int) or position < 0):
            raise UnsupportedModelError(
                f"family {family.name!r}: the Carry of block list {block_list.path!r} maps {name!r} to "
                f"{position!r}; a position is an output index >= 0, or None for a block returning one tensor."
            )
    # A per_block name the forward does not take would never find the state it guards, and the chunk
    # would run ahead with it after all: the silent wrong cache the declaration exists to prevent.
    for name in block_list.per_block:
        argument = name.split(".", 1)[0]
        if argument not in named and not open_kwargs:
            raise UnsupportedModelError(
                f"family {family.name!r}: block list {block_list.path!r} declares per_block {name!r}, but "
                f"{type(block).__qualname__}.forward takes no argument {argument!r} (its parameters: "
                f"{sorted(named)}); fix per_block in the adapter (see 'Block lists' in docs/plugins.md)."
            )


def _refuse_shared(model: nn.Module, family: Family, lists: list[tuple[BlockList, list[nn.Module]]]) -> None:
    """One block instance at several positions (weight sharing) would get one seam for two regions:
    the second position's recompute would run through the first one's region. Refused by name."""
    seen: dict[int, str] = {}
    for block_list, blocks in lists:
        for index, block in enumerate(blocks):
            where = f"{block_list.path}[{index}]"
            first = seen.setdefault(id(block), where)
            if first != where:
                raise UnsupportedStrategyError(
                    f"{type(model).__name__}.{where} is the same {type(block).__name__} instance as {first} "
                    f"(family {family.name!r}): one module at several positions of the block lists (shared "
                    "weights) cannot be patched, since its single forward would stand for two regions. Give each "
                    "position its own module (copy.deepcopy), or leave this model unpatched."
                )


def cpu_sibling(backend: Backend) -> str:
    """The backend that does what ``backend`` does (same scope, same runner) without offloading: what a
    CPU model can run instead, and what an offload backend runs as while its model is on the CPU
    (``unsloth`` -> ``torch``, ``unsloth-ffn`` -> ``torch-ffn``, ``unsloth-compile`` -> ``compile``)."""
    if not backend.offloads:
        return backend.name
    return next((b.name for b in CATALOG.values()
                 if b.runner == backend.runner and b.scope is backend.scope and not b.offloads), "torch")


def check_config(config: CheckpointConfig) -> None:
    """Refuse a setting the backend does not do, whatever the model (its catalog entry says): never
    silently ignored. Model-free, so ``gradseam run`` refuses these before the program starts."""
    backend = strategy_of(config).backend
    if config.gradient_checkpointing_memory_budget is not None and (backend is None or not backend.budget):
        users = [b.name for b in CATALOG.values() if b.budget]
        raise UnsupportedStrategyError(
            f"gradient_checkpointing_memory_budget={config.gradient_checkpointing_memory_budget:g} is the compiler's "
            f"activation memory budget for compiled blocks; backend "
            f"{backend.name if backend else 'none (checkpointing is off)'!r} compiles nothing. Use it with {users}, "
            "or remove the key."
        )
    if backend is None:
        return
    if not backend.chunks and config.gradient_checkpointing_interval and config.interval > 1:
        raise UnsupportedStrategyError(
            f"gradient_checkpointing_interval={config.interval}: backend {backend.name!r} makes every compiled block "
            "its own region (the compiler decides what each keeps), so blocks cannot be chunked. Remove the "
            "interval (gradient_checkpointing_segment_stride still selects which blocks are compiled)."
        )
    if not backend.kept_attention and (config.keep_attention or config.offload_attention):
        key = ("gradient_checkpointing_offload_attention" if config.offload_attention
               else "gradient_checkpointing_keep_attention")
        offloading = next((b.name for b in CATALOG.values() if b.runner == backend.runner and b.offloads), None)
        raise UnsupportedStrategyError(
            f"{key}: backend {backend.name!r} already keeps attention outputs (the compiler's partitioner keeps "
            f"what is costly to recompute){'' if backend.offloads or offloading is None else f'; to hold them in CPU memory use {offloading!r}'}. "
            "Remove the key."
        )


def _check_strategy(family: Family, config: CheckpointConfig, strategy: Strategy) -> None:
    """Refuse what the family cannot run, and warn for settings that cannot take effect as written."""
    backend = strategy.backend
    check_config(config)
    if backend is not None and backend.scope is Scope.FFN and not family.has_ffn:
        missing = [bc.name.rsplit(".", 1)[-1] for bc in family.block_classes if not bc.ffn]
        whole = next((b.name for b in CATALOG.values() if b.scope is Scope.BLOCK and b.offload is backend.offload),
                     "torch")
        raise UnsupportedStrategyError(
            f"backend {backend.name!r} needs an FFN boundary, but family {family.name!r} declares none "
            f"for {missing}; gradseam will not silently run another scope. Use {whole!r} (whole-block) instead."
        )
    if config.offload_attention and not family.has_attention:
        raise UnsupportedStrategyError(
            f"gradient_checkpointing_offload_attention needs an attention side, but family {family.name!r} "
            "declares none; turn attention offload off for this model."
        )
    if config.keep_attention and strategy.kept is Kept.NOWHERE:
        why = ("no checkpointing runs" if backend is None else
               f"backend {backend.name!r} never recomputes attention (it only checkpoints the feed-forward side)")
        warn_once(
            f"gradient_checkpointing_keep_attention has no effect here: {why}. It keeps attention kernel "
            "outputs on the GPU inside whole-block regions (backends 'torch' / 'unsloth')."
        )
    if backend is not None and config.gradient_checkpointing_interval and config.interval > 1:
        if backend.scope is Scope.FFN and config.stride is None:
            warn_once(
                f"gradient_checkpointing_interval={config.interval} does not group FFN regions (attention "
                f"sits between them); with {backend.name!r} the interval only selects blocks through "
                "gradient_checkpointing_segment_stride."
            )
        elif not family.supports_interval:
            warn_once(
                f"family {family.name!r} does not support gradient_checkpointing_interval; ignoring "
                f"interval={config.interval} and checkpointing every selected block on its own."
            )


def _warn_longer_than_lists(model: nn.Module, config: CheckpointConfig, strategy: Strategy,
                            lists: list[tuple[BlockList, list[nn.Module]]]) -> None:
    """An interval or a stride longer than every block list is accepted (the same config may serve a
    deeper model), but does not do what it says here: say what runs instead."""
    backend = strategy.backend
    lengths = [(bl, len(blocks)) for bl, blocks in lists]
    if backend is None or not lengths or max(n for _, n in lengths) == 0:
        return
    name = type(model).__name__
    stride, interval = config.stride, config.interval
    longest = max(n for _, n in lengths)
    if stride is not None and stride > longest:
        kept = sum(min(interval, n) for _, n in lengths)
        plain = sum(n for _, n in lengths) - kept
        shown = ", ".join(f"{bl.path}: {n}" for bl, n in lengths)
        warn_once(
            f"gradient_checkpointing_segment_stride={stride} is longer than every block list of {name} ({shown}): "
            f"each list holds one window of the stride, so backend {backend.name!r} takes only the first {interval} "
            f"block(s) of each list ({kept} block(s) in all) and the other {plain} run without checkpointing "
            f"(their activations kept). Use a stride of at most {longest} to repeat the pattern along the lists, "
            "or leave the stride out to checkpoint every block."
        )
        return
    chunkable = [(bl, n) for bl, n in lengths if bl.carry is not None]
    if (config.gradient_checkpointing_interval and interval > 1 and backend.scope is Scope.BLOCK and backend.chunks
            and chunkable and interval > max(n for _, n in chunkable)):
        shown = ", ".join(f"{bl.path}: {n}" for bl, n in chunkable)
        warn_once(
            f"gradient_checkpointing_interval={interval} is longer than every block list of {name} that can be "
            f"chunked ({shown}): each of them is checkpointed as one chunk of all its blocks, as an interval of "
            f"{max(n for _, n in chunkable)} would do, so backward recomputes a whole list at once. Use an "
            "interval of at most the list's length to choose the chunk size."
        )


def plan(model: nn.Module, family: Family, config: CheckpointConfig) -> Plan:
    """Decide every region, and how it runs, without touching the model."""
    strategy = strategy_of(config)
    _check_strategy(family, config, strategy)
    backend = strategy.backend
    whole = backend is not None and backend.scope is Scope.BLOCK
    kernels: frozenset[str] = frozenset()
    if strategy.kept is not Kept.NOWHERE:
        from .registry import REGISTRY

        kernels = REGISTRY.attention_kernels()
    common: dict[str, Any] = {}
    if backend is not None:
        common = {"runner": backend.runner, "backend": backend.name, "offload": backend.offload,
                  "budget": config.memory_budget if backend.budget else None}

    lists = _blocks(model, family)
    _warn_longer_than_lists(model, config, strategy, lists)
    if backend is not None or strategy.attention_offload:
        _refuse_shared(model, family, lists)
    if backend is not None and backend.budget:
        _refuse_user_compiled(model, family, backend)
        refuse_layerwise_casting(model, backend.name)
    wrapped = _externally_checkpointed(model) if backend is not None else set()
    regions: list[RegionSpec] = []
    plain: list[tuple[str, int, str]] = []
    skipped: list[str] = []
    for block_list, blocks in lists:
        chunk: list[int] = []
        declared_of: dict[int, BlockClass] = {}

        def flush(chunk: list[int], block_list: BlockList = block_list, blocks: list[nn.Module] = blocks,
                  declared_of: dict[int, BlockClass] = declared_of) -> None:
            if not chunk:
                return
            several = len(chunk) > 1
            attention = tuple(dict.fromkeys(p for i in chunk for p in declared_of[i].attention))
            regions.append(RegionSpec(
                block_list.path, tuple(chunk), Kind.CHUNK if several else Kind.BLOCK,
                tuple(blocks[i] for i in chunk), block_class=type(blocks[chunk[0]]).__qualname__,
                kept=strategy.kept, kernels=kernels, link=LinkKind.BLOCKS if several else LinkKind.NONE,
                carry=block_list.carry if several else None, per_block=block_list.per_block if several else (),
                attention=attention, **common,
            ))
            chunk.clear()

        group = config.interval if block_list.carry is not None else 1
        if whole and group > 1:
            for cls in {type(b): b for b in blocks}.values():
                _check_carry(family, block_list, cls)
        for index, block in enumerate(blocks):
            where = f"{block_list.path}[{index}]"
            declared = declared_of[index] = _block_class(family, block, where)
            selected = backend is not None and _selected(index, config)
            if selected and wrapped and any(id(m) in wrapped for m in block.modules()):
                selected = False  # torch's checkpoint wrapper already checkpoints it (or part of it)
                skipped.append(where)
            if whole:
                if not selected:
                    flush(chunk)
                elif chunk and (index - chunk[0] >= group or index != chunk[-1] + 1):
                    flush(chunk)
                    chunk.append(index)
                else:
                    chunk.append(index)
            elif selected:
                for seam in declared.ffn:
                    if _absent(block, seam, declared):
                        continue  # declared optional, and this instance has none
                    subs = tuple(_submodule(block, p, family, where) for p in seam)
                    regions.append(RegionSpec(
                        block_list.path, (index,), Kind.FFN, subs, seam, type(block).__qualname__,
                        link=LinkKind.SEAM if len(subs) > 1 else LinkKind.NONE, **common,
                    ))
            if not selected or not whole:
                if strategy.attention_offload:
                    for path in declared.attention:
                        if _absent(block, (path,), declared):
                            continue
                        sub = _submodule(block, path, family, where)
                        regions.append(RegionSpec(
                            block_list.path, (index,), Kind.ATTENTION_OFFLOAD, (sub,), (path,),
                            type(block).__qualname__, runner="attention-offload", offload=Offload.SAVED,
                        ))
                if not selected and not strategy.attention_offload:
                    plain.append((block_list.path, index, type(block).__qualname__))
        if whole:
            flush(chunk)
    if skipped:
        warn_once(
            f"{len(skipped)} block(s) of {type(model).__name__} ({skipped[0]}"
            f"{', ...' if len(skipped) > 1 else ''}) are already checkpointed by torch's activation "
            "checkpointing (a CheckpointWrapper, as FSDP's or accelerate's activation_checkpointing applies "
            f"it); gradseam leaves them to it and does not checkpoint them again (backend {config.backend!r} "
            "is off for them; attention offload, if set, still applies)."
        )
    return Plan(family, config, strategy, tuple(regions), tuple(plain))
