"""Calls into a block from outside it: the model reaching for a block's submodule while that block is not running.

DiT's forward calls ``transformer_blocks[0].norm1.emb`` again after the loop, for the final layer's modulation.
Checkpointing never sees that call (regions wrap the block's forward), but weight streaming does: a streamed block's
weights are in host memory outside its forward, so the call would get host weights (on a GPU, a device mismatch;
on the CPU test mode nothing at all, which is why it needs a check of its own). A family declares such calls in
``BlockList.called_outside`` and streaming keeps those submodules resident. :func:`gradseam.testing.locate_kernels`
finds the calls (its call stack over every block submodule, :attr:`KernelMap.outside`), in the same unpatched step
that locates the attention kernels; this module checks them against the declaration.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from torch import nn

# (block list path, block index, submodule path): one call seen outside its block
Outside = tuple[str, int, str]


def assert_outside_calls_declared(found: Collection[Outside], family: Any, model: nn.Module, *, what: str,
                                  reads: Collection[Outside] = ()) -> None:
    """Each call in ``found`` and each read in ``reads`` (a block's parameter or buffer used by the model outside
    the block: :attr:`gradseam.testing.KernelMap.reads`) is covered by its block list's ``called_outside`` (the
    declared path or one of its parents), and each declared path names a submodule or tensor the block has; the
    message says what to declare."""
    from ..offload.weights import block_part
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
            if block_part(blocks[index], sub) is None:
                raise AssertionError(f"{what}: BlockList({path!r}).called_outside names {sub!r}, which block {at} "
                                     "does not have")
    for seen, verb in ((found, "calls"), (reads, "reads")):
        missing = sorted(
            (path, index, sub) for path, index, sub in seen
            if not any(sub == known or sub.startswith(known + ".")
                       for known in lists[path].outside(index, len(resolve(model, path))))
        )
        whose = "that block's" if len(missing) == 1 else "those blocks'"
        assert not missing, (
            f"{what}: the model {verb} {', '.join(f'{p}[{i}].{s}' for p, i, s in missing)} outside {whose} own "
            "forward; weight streaming would leave its weights in host memory then. Declare it on the block list: "
            + "; ".join(f"BlockList({p!r}, ..., called_outside=(({i}, {s!r}),))" for p, i, s in missing))
