"""The plan: which modules of a model become which regions, decided before anything is touched.

Planning is separate from installing so that a refused configuration (an ``-ffn`` backend on a
family without an FFN boundary, say) raises while the model is still exactly as it was, and so
that tools (the summary, the conformance kit, the advisor) can inspect a plan without patching.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .config import CheckpointConfig
from .errors import GradseamWarning, UnsupportedModelError, UnsupportedStrategyError, warn_once, warned  # noqa: F401 - GradseamWarning and warned are re-exported
from .family import BlockClass, BlockList, Family

# -- planning ---------------------------------------------------------------------------------


@dataclass
class Region:
    """One planned region: which modules, and what gradseam does with them."""

    list_path: str
    blocks: tuple[int, ...]  # indices in the block list
    kind: str  # "block", "chunk", "ffn" or "attention-offload"
    modules: tuple[nn.Module, ...]
    seam: tuple[str, ...] = ()  # submodule paths for ffn/attention regions
    block_class: str = ""
    stats: Any = None  # the installed chain's counts (strategies.ChainStats); kept after remove()


@dataclass
class Plan:
    family: Family
    config: CheckpointConfig
    regions: list[Region] = field(default_factory=list)
    plain: list[tuple[str, int, str]] = field(default_factory=list)  # blocks left as they are


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
    """The block inside torch's activation-checkpoint wrapper(s), or the module itself."""
    while isinstance(getattr(module, "_checkpoint_wrapped_module", None), nn.Module):
        module = module._checkpoint_wrapped_module
    return module


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


def plan(model: nn.Module, family: Family, config: CheckpointConfig) -> Plan:
    """Decide every region without touching the model."""
    result = Plan(family, config)
    whole = config.enabled and not config.ffn_scope
    if config.enabled and config.ffn_scope and not family.has_ffn:
        missing = [bc.name.rsplit(".", 1)[-1] for bc in family.block_classes if not bc.ffn]
        raise UnsupportedStrategyError(
            f"backend {config.backend!r} needs an FFN boundary, but family {family.name!r} declares none "
            f"for {missing}; gradseam will not silently run another scope. Use "
            f"'{config.backend.replace('-ffn', '')}' (whole-block) instead."
        )
    if config.offload_attention and not family.has_attention:
        raise UnsupportedStrategyError(
            f"gradient_checkpointing_offload_attention needs an attention side, but family {family.name!r} "
            "declares none; turn attention offload off for this model."
        )
    if config.keep_attention and not config.kept_kernels:
        why = ("no checkpointing runs" if not config.enabled else
               f"backend {config.backend!r} never recomputes attention (it only checkpoints the feed-forward side)")
        warn_once(
            f"gradient_checkpointing_keep_attention has no effect here: {why}. It keeps attention kernel "
            "outputs inside whole-block regions (backends 'torch' / 'unsloth')."
        )
    if config.enabled and config.gradient_checkpointing_interval and config.interval > 1:
        if config.ffn_scope and config.stride is None:
            warn_once(
                f"gradient_checkpointing_interval={config.interval} does not group FFN regions (attention "
                f"sits between them); with {config.backend!r} the interval only selects blocks through "
                "gradient_checkpointing_segment_stride."
            )
        elif not family.supports_interval:
            warn_once(
                f"family {family.name!r} does not support gradient_checkpointing_interval; ignoring "
                f"interval={config.interval} and checkpointing every selected block on its own."
            )

    wrapped = _externally_checkpointed(model) if config.enabled else set()
    skipped: list[str] = []
    for block_list, blocks in _blocks(model, family):
        chunk: list[int] = []

        def flush(chunk: list[int], block_list: BlockList = block_list, blocks: list[nn.Module] = blocks) -> None:
            if not chunk:
                return
            kind = "chunk" if len(chunk) > 1 else "block"
            result.regions.append(
                Region(
                    block_list.path,
                    tuple(chunk),
                    kind,
                    tuple(blocks[i] for i in chunk),
                    block_class=type(blocks[chunk[0]]).__qualname__,
                )
            )
            chunk.clear()

        group = config.interval if block_list.carry is not None else 1
        if whole and group > 1:
            for cls in {type(b): b for b in blocks}.values():
                _check_carry(family, block_list, cls)
        for index, block in enumerate(blocks):
            where = f"{block_list.path}[{index}]"
            declared = _block_class(family, block, where)
            selected = config.enabled and _selected(index, config)
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
                    result.regions.append(
                        Region(block_list.path, (index,), "ffn", subs, seam, type(block).__qualname__)
                    )
            if not selected or not whole:
                if config.offload_attention:
                    for path in declared.attention:
                        if _absent(block, (path,), declared):
                            continue
                        sub = _submodule(block, path, family, where)
                        result.regions.append(
                            Region(block_list.path, (index,), "attention-offload", (sub,), (path,),
                                   type(block).__qualname__)
                        )
                if not selected and not config.offload_attention:
                    result.plain.append((block_list.path, index, type(block).__qualname__))
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
    return result
