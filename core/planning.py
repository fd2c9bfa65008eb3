"""The plan: which modules of a model become which regions, and what each region does, decided once.

Planning is separate from installing so that a refused configuration (an ``-ffn`` backend on a
family without an FFN boundary, say) raises while the model is still exactly as it was, and so
that tools (the summary, the conformance kit, the advisor) can inspect a plan without patching.

It is also the one place that turns a config into regions. :func:`gradseam.spec.strategy_of` reads
the config, the catalog and the kinds once (which backend and kind, where kept attention kernel
outputs live); the kinds (:mod:`gradseam.kinds`) refuse what they cannot run; :func:`plan` copies
the result into an immutable :class:`RegionSpec` per region, and names the stores its regions
offload to. The run layer (:mod:`gradseam.run.install`) turns specs into what runs, and the summary,
``handle.regions()``, bench, advise and the kit read the specs and their kinds: none of them looks
at a backend's name.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import replace
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from .backends import Destination, Kept, Offload, Scope
from .config import (
    BLOCKS_KEY,
    DEFAULT_STREAM_PREFETCH,
    SELECTOR,
    STREAM_KEY,
    BlockOverride,
    CheckpointConfig,
    selector_parts,
)
from .errors import UnsupportedModelError, UnsupportedStrategyError, warn_once
from .family import BlockClass, BlockList, Family
from .kinds import ATTENTION_OFFLOAD, check_config
from .modules import resolve, unwrap
from .spec import LinkKind, Plan, RegionSpec, Shape, StoreSpec, Strategy, strategy_of


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


def _check_strategy(family: Family, config: CheckpointConfig, strategy: Strategy) -> None:
    """Refuse what the family cannot run, and warn for settings that cannot take effect as written: the
    config's own refusals first (:func:`gradseam.kinds.check_config`), then the kinds' of the family."""
    check_config(config)
    if strategy.backend is not None and strategy.kind is not None:
        strategy.kind.check_family(strategy.backend, family, config)
    if config.offload_attention:
        ATTENTION_OFFLOAD.check_family(strategy.backend, family, config)
    if config.keep_attention and strategy.backend is None:
        warn_once(
            "gradient_checkpointing_keep_attention has no effect here: no checkpointing runs. It keeps attention "
            "kernel outputs on the GPU inside whole-block regions (backends 'torch' / 'unsloth')."
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
    if (config.gradient_checkpointing_interval and interval > 1 and backend.scope is Scope.BLOCK
            and strategy.kind is not None and strategy.kind.chunks
            and chunkable and interval > max(n for _, n in chunkable)):
        shown = ", ".join(f"{bl.path}: {n}" for bl, n in chunkable)
        warn_once(
            f"gradient_checkpointing_interval={interval} is longer than every block list of {name} that can be "
            f"chunked ({shown}): each of them is checkpointed as one chunk of all its blocks, as an interval of "
            f"{max(n for _, n in chunkable)} would do, so backward recomputes a whole list at once. Use an "
            "interval of at most the list's length to choose the chunk size."
        )



def _streamed(model: nn.Module, config: CheckpointConfig, lists: list[tuple[BlockList, list[nn.Module]]],
              unchecked: set[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """The blocks whose frozen weights stream from host memory (:mod:`gradseam.offload.weights`), in forward
    order. The top-level N spreads over the blocks no entry of gradient_checkpointing_blocks sets it for
    (:func:`spread`; ``"all"``: every one); an entry's value does the same over the blocks it decides (the
    later entry wins, as for every key). Each refusal names what to do instead."""
    groups = _stream_groups(model, config, lists)
    if not any(wanted for wanted, _ in groups.values()):
        if config.gradient_checkpointing_stream_prefetch != DEFAULT_STREAM_PREFETCH:
            warn_once(f"gradient_checkpointing_stream_prefetch={config.gradient_checkpointing_stream_prefetch} set, "
                      f"but no weights stream ({STREAM_KEY} is {config.stream_weights!r}): it does nothing. Set "
                      f"{STREAM_KEY} too, or leave the prefetch out.")
        return ()
    wanted = next(w for w, _ in groups.values() if w)
    if config.gradient_checkpointing_interval and config.interval > 1:
        raise UnsupportedStrategyError(
            f"{STREAM_KEY} with gradient_checkpointing_interval={config.interval}: a chunk runs its later blocks "
            "ahead, before their weights are loaded, so streamed blocks are checkpointed one per region. Remove "
            "the interval (gradient_checkpointing_segment_stride still selects which blocks are checkpointed)."
        )
    from .offload import cpu_allowed

    if not torch.cuda.is_available() and not cpu_allowed():
        raise UnsupportedStrategyError(
            f"{STREAM_KEY}={wanted!r} keeps block weights in host memory and copies them to a CUDA GPU as each "
            "block runs, and no CUDA GPU is available here. Leave the key out on this machine (on the CPU the "
            "weights are in host memory already)."
        )
    chosen: list[tuple[str, int, nn.Module]] = []
    for (where, _), (wanted, entries) in groups.items():
        if not wanted:
            continue
        count = len(entries) if wanted == "all" else int(wanted)
        if count > len(entries):
            among = (f"{type(model).__name__} has {len(entries)} blocks "
                     f"({', '.join(f'{bl.path}: {len(b)}' for bl, b in lists)})" if where == "top" else
                     f"{where} decides it for {len(entries)} blocks")
            raise UnsupportedStrategyError(f"{STREAM_KEY}={count}, but {among}. Stream at most {len(entries)}, "
                                           "or \"all\".")
        chosen += [entries[i] for i in spread(count, [block_bytes(block) for _, _, block in entries])]
    order = {bl.path: n for n, (bl, _) in enumerate(lists)}
    chosen.sort(key=lambda e: (order[e[0]], e[1]))
    for path, index, block in chosen:
        if (path, index) in unchecked:
            raise UnsupportedStrategyError(
                f"{STREAM_KEY}={wanted!r} needs checkpointing, and {path}[{index}] runs without it: autograd then "
                "keeps its weights for backward, so streaming them frees nothing. Turn gradient_checkpointing on "
                "(any backend) where weights stream.")
        _refuse_unstreamable(model, f"{path}[{index}]", block)
    return tuple((path, index) for path, index, _ in chosen)


def _stream_groups(model: nn.Module, config: CheckpointConfig, lists: list[tuple[BlockList, list[nn.Module]]],
                   ) -> dict[tuple[str, int], tuple[int | str | None, list[tuple[str, int, nn.Module]]]]:
    """The blocks by what decides whether they stream: the top level, or the last entry of
    gradient_checkpointing_blocks that sets the key for them; each with its value and its blocks in forward
    order."""
    decided: dict[tuple[str, int], tuple[str, int]] = {}
    values: dict[tuple[str, int], int | str | None] = {("top", 0): config.stream_weights}
    for n, entry in enumerate(config.gradient_checkpointing_blocks or ()):
        keys = dict(entry)
        if STREAM_KEY in keys:
            where = (f"{BLOCKS_KEY}[{n}] ({keys[SELECTOR]!r})", n)
            values[where] = keys[STREAM_KEY]
            path, indices = _selection(model, lists, n, keys[SELECTOR])
            for i in indices:
                decided[(path, i)] = where
    groups: dict[tuple[str, int], tuple[int | str | None, list[tuple[str, int, nn.Module]]]] = {}
    for block_list, blocks in lists:
        for i, block in enumerate(blocks):
            where = decided.get((block_list.path, i), ("top", 0))
            groups.setdefault(where, (values[where], []))[1].append((block_list.path, i, block))
    return groups


SIZE_CLASSES = 8  # a block's size is read as one of this many fractions of the largest block's


def spread(count: int, sizes: Sequence[float]) -> list[int]:
    """``count`` of the blocks whose sizes are ``sizes`` (in forward order), each
    placed so the compute before it can hide its copy: the blocks are laid on an axis where each takes the inverse of
    its size, the axis is cut into ``count`` equal shares, and each share's middle is streamed. Blocks of one size are
    spread evenly: 2 of 8 -> [2, 6].

    Why not the first N: a streamed block's copy is issued when the streamed block before it starts, so it
    overlaps every block that runs between the two. Streamed back to back, a copy has one block's compute to
    hide behind, and where a block's copy takes longer than its compute (Flux at 4k tokens: ~13 ms against
    ~3 ms forward) the step waits for the host link; spread, each copy overlaps the resident blocks between.
    Centred rather than from block 0 so the first and last streamed blocks each have resident blocks beside
    them, as the rest do.

    Why by size: blocks of one model compute about alike and copy in proportion to their bytes. Spread by count,
    Flux's double blocks (0.63 GiB, ~13 ms to copy on an H100's link) came one block in two or three, too close to
    hide their copies, and its single blocks (0.26 GiB, ~5 ms) no closer; by size, the gap before each streamed
    block grows with its bytes (doubles about four blocks apart, singles two). A model of the copy stream with the
    H100's link and Flux dev 4k's forward (the even spread's ``stream 25`` forward: 222 ms modelled, 226.0 measured)
    gives 200 ms at 7.6 GiB freed and 208 at 8.5, where the even spread gave 222 ms at 8.0; streaming most of the
    weights, the link is the bound whatever the placement (280 ms at 12.3 GiB, 293 at 12.6). Sizes are read in
    :data:`SIZE_CLASSES` steps of the largest, so a LoRA added to some blocks, or the planner counting frozen bytes
    where the runtime counts all, places the same blocks."""
    total = len(sizes)
    if count <= 0:
        return []
    count = min(count, total)
    largest = max(sizes, default=0.0)
    steps = [max(1, round(SIZE_CLASSES * size / largest)) if largest > 0 else 1 for size in sizes]
    widths = [Fraction(1, step) for step in steps]
    length = sum(widths)
    chosen: list[int] = []
    at, start = 0, Fraction(0)
    for k in range(count):
        middle = (2 * k + 1) * length / (2 * count)
        while at < total - 1 and start + widths[at] <= middle:
            start += widths[at]
            at += 1
        # one block per share, in order, leaving a block for each share after it
        index = min(max(at, chosen[-1] + 1 if chosen else 0), total - (count - k))
        chosen.append(index)
    return chosen


def block_bytes(block: nn.Module) -> int:
    """The bytes of ``block``'s parameters and buffers (each once): the size :func:`spread` places it by (its frozen
    weights are nearly all of it; which of them are frozen may not be known yet, for a model patched as it loads)."""
    return sum(t.nbytes for t in (*block.parameters(), *block.buffers()))


def _refuse_unstreamable(model: nn.Module, where: str, block: nn.Module) -> None:
    """Quantized weights keep their bytes in inner tensors or on the parameter, which a copy of ``.data``
    would not move. (A block whose weights all train is refused once streaming starts: a model patched as
    it loads is frozen only afterwards, :meth:`gradseam.offload.weights.WeightStream.select`.)"""
    from .offload.state import is_sharded, is_wrapper

    for path, t in [*block.named_parameters(), *block.named_buffers()]:
        if is_sharded(t):
            raise UnsupportedStrategyError(
                f"{type(model).__name__}.{where}.{path} is sharded by FSDP2 (a DTensor): FSDP2 already gathers each "
                "block's weights for its use and frees them after, so streaming would move the same weights a "
                "second way. With FSDP2, keep the shards in host memory with its own offload "
                "(fully_shard(..., offload_policy=CPUOffloadPolicy())) and leave gradient_checkpointing_stream_weights "
                "out; gradseam's activation backends compose with FSDP2 as they are."
            )
        if is_wrapper(t) or type(t) not in (nn.Parameter, torch.Tensor):
            raise UnsupportedStrategyError(
                f"{type(model).__name__}.{where}.{path} is a {type(t).__name__} (a quantized weight), and weight "
                "streaming moves plain tensors only so far. Stream fewer blocks, or train this base without "
                "streaming (a quantized base is small: docs/strategies.md, Quantized bases)."
            )


class _Planner:
    """Walks the block lists once, turning each selected block into regions of the strategy's kind."""

    def __init__(self, model: nn.Module, family: Family, config: CheckpointConfig, strategy: Strategy) -> None:
        self.family, self.config, self.strategy = family, config, strategy
        backend, kind = strategy.backend, strategy.kind
        self.whole = backend is not None and backend.scope is Scope.BLOCK
        self.kernels: frozenset[str] = frozenset()
        if strategy.kept is not Kept.NOWHERE:
            from .registry import REGISTRY

            self.kernels = REGISTRY.attention_kernels()
        self.common: dict[str, Any] = {}
        if backend is not None and kind is not None:
            self.common = {"kind": kind, "backend": backend.name, "offload": backend.offload,
                           "destination": backend.destination, **kind.settings(config)}
        self.wrapped = _externally_checkpointed(model) if backend is not None else set()
        self.regions: list[RegionSpec] = []
        self.plain: list[tuple[str, int, str]] = []
        self.skipped: list[str] = []

    def add_list(self, block_list: BlockList, blocks: list[nn.Module], only: set[int] | None = None) -> None:
        """Plan the blocks of one list (``only``: just these indices, the others belonging to another plan's
        entry; a chunk never spans a block outside them)."""
        kind = self.strategy.kind
        group = self.config.interval if block_list.carry is not None and kind is not None and kind.chunks else 1
        if self.whole and group > 1:
            for cls in {type(b): b for b in blocks}.values():
                _check_carry(self.family, block_list, cls)
        chunk: list[int] = []
        declared_of: dict[int, BlockClass] = {}
        for index, block in enumerate(blocks):
            if only is not None and index not in only:
                continue
            where = f"{block_list.path}[{index}]"
            declared = declared_of[index] = _block_class(self.family, block, where)
            selected = self._selected(index, block, where)
            if self.whole:
                if chunk and (not selected or index - chunk[0] >= group or index != chunk[-1] + 1):
                    self._add_chunk(block_list, blocks, chunk, declared_of)
                    chunk = []
                if selected:
                    chunk.append(index)
            elif selected:
                self._add_ffn(block_list, index, block, declared, where)
            if not selected or not self.whole:
                self._add_attention(block_list, index, block, declared, where, selected)
        self._add_chunk(block_list, blocks, chunk, declared_of)

    def _selected(self, index: int, block: nn.Module, where: str) -> bool:
        selected = self.strategy.backend is not None and _selected(index, self.config)
        if selected and self.wrapped and any(id(m) in self.wrapped for m in block.modules()):
            self.skipped.append(where)
            return False  # torch's checkpoint wrapper already checkpoints it (or part of it)
        return selected

    def _add_chunk(self, block_list: BlockList, blocks: list[nn.Module], chunk: list[int],
                   declared_of: dict[int, BlockClass]) -> None:
        if not chunk:
            return
        several = len(chunk) > 1
        kept = self.strategy.kept
        common = dict(self.common)
        if kept is Kept.CPU and common["destination"] is Destination.DEVICE:
            common["destination"] = Destination.HOST  # the kept kernel outputs go to host memory
        self.regions.append(RegionSpec(
            block_list.path, tuple(chunk), shape=Shape.CHUNK if several else Shape.BLOCK,
            modules=tuple(blocks[i] for i in chunk), block_class=type(blocks[chunk[0]]).__qualname__,
            kept=kept, kernels=self.kernels, link=LinkKind.BLOCKS if several else LinkKind.NONE,
            carry=block_list.carry if several else None, per_block=block_list.per_block if several else (),
            attention=tuple(dict.fromkeys(p for i in chunk for p in declared_of[i].attention)), **common,
        ))

    def _add_ffn(self, block_list: BlockList, index: int, block: nn.Module, declared: BlockClass, where: str) -> None:
        for seam in declared.ffn:
            if _absent(block, seam, declared):
                continue  # declared optional, and this instance has none
            subs = tuple(_submodule(block, p, self.family, where) for p in seam)
            self.regions.append(RegionSpec(
                block_list.path, (index,), shape=Shape.FFN, modules=subs, seam=seam,
                block_class=type(block).__qualname__, link=LinkKind.SEAM if len(subs) > 1 else LinkKind.NONE,
                **self.common,
            ))

    def _add_attention(self, block_list: BlockList, index: int, block: nn.Module, declared: BlockClass, where: str,
                       selected: bool) -> None:
        """Attention submodules outside any region: offloaded where attention offload is on, else the block
        (when not selected) is left as it is."""
        if not self.strategy.attention_offload:
            if not selected:
                self.plain.append((block_list.path, index, type(block).__qualname__))
            return
        for path in declared.attention:
            if _absent(block, (path,), declared):
                continue
            self.regions.append(RegionSpec(
                block_list.path, (index,), ATTENTION_OFFLOAD, Shape.ATTENTION,
                (_submodule(block, path, self.family, where),), (path,), type(block).__qualname__,
                offload=Offload.SAVED, destination=Destination.HOST,
            ))

    def warn_skipped(self, model: nn.Module) -> None:
        if not self.skipped:
            return
        skipped = self.skipped
        warn_once(
            f"{len(skipped)} block(s) of {type(model).__name__} ({skipped[0]}"
            f"{', ...' if len(skipped) > 1 else ''}) are already checkpointed by torch's activation "
            "checkpointing (a CheckpointWrapper, as FSDP's or accelerate's activation_checkpointing applies "
            f"it); gradseam leaves them to it and does not checkpoint them again (backend {self.config.backend!r} "
            "is off for them; attention offload, if set, still applies)."
        )


def _selection(model: nn.Module, lists: list[tuple[BlockList, list[nn.Module]]], n: int,
               selector: str) -> tuple[str, range]:
    """The block list and the indices an entry of ``gradient_checkpointing_blocks`` names; a list the model
    lacks or a range outside it is refused, naming the model's lists and lengths."""
    path, lo, end = selector_parts(selector)
    lengths = {bl.path: len(blocks) for bl, blocks in lists}
    shown = ", ".join(f"{p} ({k} blocks)" for p, k in lengths.items())
    if path not in lengths:
        raise UnsupportedStrategyError(
            f"{BLOCKS_KEY}[{n}] selects {selector!r}, but {type(model).__name__} has no block list {path!r}; its "
            f"block lists: {shown}."
        )
    count = lengths[path]
    if "[" not in selector:
        return path, range(count)
    hi = count if end is None else end
    if not lo < hi <= count:
        raise UnsupportedStrategyError(
            f"{BLOCKS_KEY}[{n}] selects {selector!r}, but {path} has {count} blocks (indices 0 to {count - 1}; a "
            f"range [a:b] takes a <= i < b): select within them."
        )
    return path, range(lo, hi)


def _block_groups(model: nn.Module, config: CheckpointConfig, lists: list[tuple[BlockList, list[nn.Module]]]
                  ) -> list[tuple[CheckpointConfig, dict[str, set[int]]]]:
    """Every block's config (the top-level keys with the entries that select it over them, later entries
    winning), grouped: one config per group, with the blocks of each list that run it, in plan order."""
    entries = config.gradient_checkpointing_blocks or ()
    chosen: dict[tuple[str, int], list[BlockOverride]] = {}
    for n, entry in enumerate(entries):
        path, indices = _selection(model, lists, n, dict(entry)[SELECTOR])
        for i in indices:
            chosen.setdefault((path, i), []).append(entry)
    groups: dict[CheckpointConfig, dict[str, set[int]]] = {}
    resolved: dict[tuple[BlockOverride, ...], CheckpointConfig] = {}
    for block_list, blocks in lists:
        for i in range(len(blocks)):
            own = tuple(chosen.get((block_list.path, i), ()))
            if own not in resolved:
                resolved[own] = config.for_blocks(own)
            groups.setdefault(resolved[own], {}).setdefault(block_list.path, set()).add(i)
    return list(groups.items())


def _as_seen_by(family: Family, lists: list[tuple[BlockList, list[nn.Module]]],
                members: dict[str, set[int]] | None) -> Family:
    """``family`` with only the block classes of the blocks a per-block group covers (``members``; None: every
    block), so what a kind asks of every block class (an FFN seam for the ``-ffn`` backends) is asked of the
    blocks that run it: Ovis-Image's double blocks have seams, its single blocks none, and an ``-ffn`` entry for
    the double blocks alone is exact."""
    if members is None:
        return family
    covered = {family.block_class_for(type(blocks[i])) for block_list, blocks in lists
               for i in members.get(block_list.path, ())}
    kept = tuple(bc for bc in family.block_classes if bc in covered)
    return replace(family, block_classes=kept) if kept and len(kept) < len(family.block_classes) else family


def plan(model: nn.Module, family: Family, config: CheckpointConfig) -> Plan:
    """Decide every region, and how it runs, without touching the model.

    With per-block entries (``gradient_checkpointing_blocks``) each group of blocks that runs one config is
    planned as the whole model would be under it (its kind's checks included), and the regions merged in
    block order: the run layer installs each region by its own spec."""
    lists = _blocks(model, family)
    groups = _block_groups(model, config, lists) if config.gradient_checkpointing_blocks else [(config, None)]
    if len(groups) == 1:
        groups = [(groups[0][0], None)]  # every block runs one config: plan it as the whole model
    # the configs blocks run are what is checked (a top-level key no block runs is not refused for them)
    strategy = strategy_of(groups[0][0]) if len(groups) == 1 else strategy_of(config)
    _warn_longer_than_lists(model, config, strategy, lists)
    regions: list[RegionSpec] = []
    plain: list[tuple[str, int, str]] = []
    strategies: list[Strategy] = []
    shared_checked = False
    for group_config, members in groups:
        group = strategy_of(group_config)
        _check_strategy(_as_seen_by(family, lists, members), group_config, group)
        if (group.backend is not None or group.attention_offload) and not shared_checked:
            _refuse_shared(model, family, lists)
            shared_checked = True
        if group.backend is not None and group.kind is not None:
            group.kind.refuse_model(group.backend, model, family)
        planner = _Planner(model, family, group_config, group)
        for block_list, blocks in lists:
            planner.add_list(block_list, blocks, None if members is None else members.get(block_list.path, set()))
        planner.warn_skipped(model)
        regions += planner.regions
        plain += planner.plain
        strategies.append(group)
    if len(groups) > 1:
        order = {bl.path: n for n, (bl, _) in enumerate(lists)}
        regions.sort(key=lambda r: (order[r.list_path], r.blocks[0]))  # stable: a block's regions keep their order
        plain.sort(key=lambda p: (order[p[0]], p[1]))
    destinations = dict.fromkeys(r.destination for r in regions if r.moves)
    stores = tuple(StoreSpec(d, config.pin_buckets) for d in destinations)
    # blocks whose config turns checkpointing off (not those a stride leaves out: they reload like the others)
    unchecked = {(bl.path, i) for group_config, members in groups if not group_config.enabled
                 for bl, blocks in lists for i in range(len(blocks))
                 if members is None or i in members.get(bl.path, set())}
    streamed = _streamed(model, config, lists, unchecked)
    return Plan(family, config, strategy, tuple(regions), tuple(plain), stores, streamed,
                tuple(dict.fromkeys(strategies)))
