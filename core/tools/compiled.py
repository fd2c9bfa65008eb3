"""Blocks compiled one by one, optionally under the compiler's activation memory budget.

What a user would pick instead of gradseam is ``torch.compile`` with
``torch._functorch.config.activation_memory_budget``: the min-cut partitioner then recomputes
cheap ops to keep the saved activations under that fraction. Every benchmark and the advice read
gradseam's rows against it, so the context lives here, next to the measuring loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

BUDGETS = (0.3, 0.1, 0.05)


def budget_label(budget: float) -> str:
    return f"ref: compile, memory budget {budget:g}"


@contextmanager
def compiled_blocks(blocks: list[nn.Module], budget: float | None = None) -> Iterator[None]:
    """Compile each block (``nn.Module.compile``) for the duration; ``budget`` sets the memory budget.

    Dynamo's caches are reset on entry and exit: a budget is read when a graph is partitioned, so
    a graph compiled under another budget must not be reused.
    """
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    old = functorch_config.activation_memory_budget
    if budget is not None:
        functorch_config.activation_memory_budget = budget
    for block in blocks:
        block.compile(backend="inductor" if torch.cuda.is_available() else "aot_eager")
    try:
        yield
    finally:
        for block in blocks:
            block._compiled_call_impl = None
        functorch_config.activation_memory_budget = old
        torch._dynamo.reset()
