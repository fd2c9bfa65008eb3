"""Calls into a block from outside it: the model reaching for a block's submodule while that block is not running.

DiT's forward calls ``transformer_blocks[0].norm1.emb`` again after the loop, for the final layer's modulation.
Checkpointing never sees that call (regions wrap the block's forward), but weight streaming does: a streamed block's
weights are in host memory outside its forward, so the call would get host weights (on a GPU, a device mismatch;
on the CPU test mode nothing at all, which is why it needs a check of its own). A family declares such calls in
``BlockList.called_outside`` and streaming keeps those submodules resident; this module finds them, by watching
every submodule of every declared block through one unpatched forward, so the kit can fail a family that leaves one
out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

# (block list path, block index, submodule path): one call seen outside its block
Outside = tuple[str, int, str]


def record_outside_calls(model: nn.Module, family: Any, inputs: Mapping[str, Any]) -> set[Outside]:
    """Every call to a submodule of a declared block made while that block's own forward is not running, in one
    forward of ``model(**inputs)`` without gradients; a submodule called from another one seen outside (the
    children of ``norm1.emb``) is left out, its outermost caller named instead."""
    from ..planning import resolve

    running: set[int] = set()  # ids of the blocks whose forward is under way
    outside: list[int] = []  # depth of outside calls under way (a child of one is not reported again)
    found: set[Outside] = set()
    hooks: list[Any] = []

    def enter(block: nn.Module, *_: Any) -> None:
        running.add(id(block))

    def leave(block: nn.Module, *_: Any) -> None:
        running.discard(id(block))

    def watch(where: Outside, block: nn.Module) -> tuple[Any, Any]:
        def pre(*_: Any) -> None:
            if id(block) in running:
                return
            if not outside:
                found.add(where)
            outside.append(1)

        def post(*_: Any) -> None:
            if id(block) not in running and outside:
                outside.pop()
        return pre, post

    declared = [(block_list.path, list(blocks)) for block_list in family.block_lists
                if isinstance(blocks := resolve(model, block_list.path), nn.ModuleList)]
    shared = _shared_modules([block for _, blocks in declared for block in blocks])
    try:
        for list_path, blocks in declared:
            for index, block in enumerate(blocks):
                hooks.append(block.register_forward_pre_hook(enter))
                hooks.append(block.register_forward_hook(leave, always_call=True))
                for path, sub in block.named_modules():
                    if path and id(sub) not in shared:  # a module two holders share runs for either: not a block's
                        pre, post = watch((list_path, index, path), block)
                        hooks.append(sub.register_forward_pre_hook(pre))
                        hooks.append(sub.register_forward_hook(post, always_call=True))
        with torch.no_grad():
            model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return found


def _shared_modules(blocks: list[nn.Module]) -> set[int]:
    """Ids of the modules two blocks hold (one rotary module handed to every block): a call to one while either
    runs is no call from outside (streaming keeps the tensors blocks share resident anyway)."""
    held: set[int] = set()
    seen: set[int] = set()
    for block in blocks:
        mine = {id(m) for m in block.modules() if m is not block}
        held |= seen & mine
        seen |= mine
    return held


def assert_outside_calls_declared(found: set[Outside], family: Any, model: nn.Module, *, what: str) -> None:
    """Each call in ``found`` is covered by its block list's ``called_outside`` (the declared path or one of its
    parents), and each declared path names a submodule the block has; the message says what to declare."""
    from ..planning import resolve

    lists = {bl.path: bl for bl in family.block_lists}
    for path, block_list in lists.items():
        blocks = resolve(model, path)
        if not isinstance(blocks, nn.ModuleList):
            continue
        for at, sub in block_list.called_outside:
            index = at if at >= 0 else at + len(blocks)
            assert 0 <= index < len(blocks), (
                f"{what}: BlockList({path!r}).called_outside names block {at}, and the list has {len(blocks)}")
            try:
                blocks[index].get_submodule(sub)
            except AttributeError:
                raise AssertionError(f"{what}: BlockList({path!r}).called_outside names {sub!r}, which block {at} "
                                     "does not have") from None
    missing = sorted(
        (path, index, sub) for path, index, sub in found
        if not any(sub == known or sub.startswith(known + ".")
                   for known in lists[path].outside(index, len(resolve(model, path))))
    )
    whose = "that block's" if len(missing) == 1 else "those blocks'"
    assert not missing, (
        f"{what}: the model calls {', '.join(f'{p}[{i}].{s}' for p, i, s in missing)} outside {whose} own "
        "forward; weight streaming would leave its weights in host memory then. Declare it on the block list: "
        + "; ".join(f"BlockList({p!r}, ..., called_outside=(({i}, {s!r}),))" for p, i, s in missing))
