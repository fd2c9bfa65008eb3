"""What streamed weights add to a step: the host link's rate, measured, and a model of the copy stream.

Why a model and not the two-depth line every other cost comes from: a streamed block's copy hides only behind the
compute between it and the streamed block before it (:mod:`gradseam.offload.weights` issues block ``k``'s copy
when streamed block ``k - prefetch`` starts), so what streaming costs depends on where the streamed blocks are in
the whole model and how large each is, which a model cut to two shallow depths does not show. On an H100 (Flux dev
at 4,096 tokens, 2026-12-05) the lines through depths 2 and 4 predicted ``unsloth-compile, budget 0.05 + stream
35`` at 934 ms where ``unsloth-compile + stream 35`` ran 684 ms on the whole model, and ``compile + stream 44`` at
696 ms where it ran 873: ``auto`` under 12 GiB chose the second and ran 1.74x the uncapped step, against the hand
plan's 1.40x. The model below gives the first 707 ms and the second 819 ms from the resident rows' steps.

The model (:func:`pass_ms`): blocks run in order, each taking its share of the pass's time; one copy stream moves
the streamed blocks' weights in that order at the link's rate; a streamed block's copy is issued when the streamed
block ``prefetch`` places before it starts (the first one when the pass starts), and the block starts once its
copy is done. The backward is the same pass run back to front (the last streamed block is copied as the forward
ends; each block is copied once for its recompute and its backward). What it leaves out (kernel launch gaps, the
activations' own copies, the allocator) is what the check on the whole model (:mod:`gradseam.tools.plan_check`)
measures.

The rate (:func:`measure_gib_s`) is measured on this machine as streaming uses the link: one block's tensors, each
its own copy from pinned host memory on a side stream, timed with CUDA events.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

# The forward's share of a step where a row's own forward time is unknown (a table measured before rows kept it):
# on an H100, Flux dev 4k's resident unsloth-compile ran its forward in 170.4 of 489.4 ms (0.35); a step without
# recompute does a third of its work forward, one with a whole-block recompute a quarter.
FORWARD_SHARE = 1 / 3
REPEATS = 5  # timed copies of one block when measuring the link (their median)
# What each streamed block adds to a step beyond the modelled waits: the least-squares constant over five rows an H100
# ran on the whole model (Flux dev 4k; unsloth-compile with 25 and 35 blocks evenly placed, compile with 31 and 44,
# unsloth-compile with 30 placed by size), from -0.1 to 2.7 ms a block; with it each row is within 9% of its
# measurement, without it from -14% to +0.5%. A sixth row (28 placed by size, its peak 15.3 GiB under a 16 GiB cap)
# left 5.4 ms a block: a plan that close to its cap is what the check on the whole model catches. Where it goes, from a
# profile of the by-size stream 30 (docs/scripts/stream_profile.py; docs/benchmarks.md): in forward Flux's double
# blocks are bound by the CPU (the next block's first kernel is launched 4.3-5 ms after the last one's, ~2.6 ms of it
# packing the saved tensors for offload), and a block whose load is launched there takes 0.7-3 ms more of it; the model
# gives every block the same compute and no CPU. Not the number of copies: loading a block in one copy per host
# allocation left the by-size stream 30 unchanged (595.9 ms, 591.8 before).
STREAMED_BLOCK_MS = 1.5


def pass_ms(compute_ms: Sequence[float], sizes_gib: Sequence[float], streamed: Iterable[int], link_gib_s: float,
            prefetch: int = 1) -> float:
    """One pass's time in the model above: the blocks take ``compute_ms`` each in this order and weigh ``sizes_gib``;
    those at ``streamed`` (indices in this order) have their weights copied in at ``link_gib_s``."""
    if link_gib_s <= 0:
        raise ValueError(f"the host link's rate must be positive, got {link_gib_s} GiB/s")
    order = sorted(set(streamed))
    done: dict[int, float] = {}  # k (the k-th streamed block) -> when its copy ends
    link_free = 0.0

    def issue(k: int, at: float) -> None:
        nonlocal link_free
        if k < len(order) and k not in done:
            link_free = max(at, link_free) + sizes_gib[order[k]] / link_gib_s * 1000.0
            done[k] = link_free

    issue(0, 0.0)  # the first streamed block is copied as the pass starts
    position = {block: k for k, block in enumerate(order)}
    clock = 0.0
    for block, ms in enumerate(compute_ms):
        k = position.get(block)
        if k is not None:
            issue(k, clock)
            clock = max(clock, done[k])
            for ahead in range(1, prefetch + 1):
                issue(k + ahead, clock)
        clock += ms
    return clock


def waits_ms(sizes_gib: Sequence[float], streamed: Iterable[int], forward_ms: float, backward_ms: float,
             link_gib_s: float, prefetch: int = 1) -> tuple[float, float]:
    """What streaming the blocks at ``streamed`` (indices in forward order) adds to the forward and to the backward,
    each pass's time spread evenly over the blocks (on the H100 the even split matched Flux's measured forward better
    than one by block size: 222 ms modelled, 226.0 measured, for ``stream 25``)."""
    count = len(sizes_gib)
    if not count:
        return 0.0, 0.0
    chosen = sorted(set(streamed))
    forward = pass_ms([forward_ms / count] * count, sizes_gib, chosen, link_gib_s, prefetch) - forward_ms
    backward = pass_ms([backward_ms / count] * count, list(reversed(sizes_gib)),
                       [count - 1 - i for i in chosen], link_gib_s, prefetch) - backward_ms
    return max(forward, 0.0), max(backward, 0.0)


def added_ms(sizes_gib: Sequence[float], streamed: Iterable[int], forward_ms: float, backward_ms: float,
             link_gib_s: float, prefetch: int = 1) -> tuple[float, float]:
    """What streaming the blocks at ``streamed`` adds to the forward and to the backward: the modelled waits
    (:func:`waits_ms`) and :data:`STREAMED_BLOCK_MS` for each streamed block, half in each pass."""
    chosen = sorted(set(streamed))
    ahead, behind = waits_ms(sizes_gib, chosen, forward_ms, backward_ms, link_gib_s, prefetch)
    each = STREAMED_BLOCK_MS * len(chosen) / 2
    return ahead + each, behind + each


def block_tensor_bytes(blocks: Sequence[Any]) -> list[int]:
    """The sizes of the tensors streaming moves for the largest of ``blocks``: what :func:`measure_gib_s` copies."""
    from ..offload.weights import streamable

    sizes = [[t.nbytes for *_, t in streamable(block)] for block in blocks]
    return max(sizes, key=sum, default=[])


def measure_gib_s(tensor_bytes: Sequence[int], device: Any, repeats: int = REPEATS) -> float:
    """The host-to-device rate in GiB/s of one block's tensors (``tensor_bytes``), each copied from pinned host memory
    on a side stream as :mod:`gradseam.offload.weights` copies them: the median of ``repeats`` timed copies after a
    warm-up. Needs CUDA; holds the block's size on the GPU and in pinned host memory while it runs."""
    import torch

    sizes = [int(n) for n in tensor_bytes if n > 0]
    total = sum(sizes)
    if not total:
        raise ValueError("no tensor to copy: the link is measured with a block's frozen weights")
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(total, dtype=torch.uint8, device=device)
    starts = [0, *itertools.accumulate(sizes)][:-1]
    stream = torch.cuda.Stream(device)
    times = []
    with torch.cuda.stream(stream):
        for run in range(repeats + 1):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(stream)
            for start, size in zip(starts, sizes):
                target[start:start + size].copy_(host[start:start + size], non_blocking=True)
            end.record(stream)
            end.synchronize()
            if run:  # the first run warms the copy engine and the stream up
                times.append(begin.elapsed_time(end))
    return total / 2**30 / (statistics.median(times) / 1000.0)


def measure_model_gib_s(model: Any, family: Any, device: Any = None) -> float | None:
    """The link's rate (:func:`measure_gib_s`) with the largest of ``model``'s blocks, on ``device`` (default: the
    GPU its first parameter on one is on; a model whose blocks stream keeps them in host memory); None off CUDA or
    where no block has frozen weights (then no candidate streams)."""
    import torch

    from .workloads import blocks

    if device is None:
        device = next((p.device for p in model.parameters() if p.device.type == "cuda"), None)
    sizes = block_tensor_bytes(blocks(model, family))
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available() or not sum(sizes):
        return None
    return measure_gib_s(sizes, device)
