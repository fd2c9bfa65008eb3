"""Blocks compiled one by one, optionally under the compiler's activation memory budget.

What a user would pick instead of gradseam is ``torch.compile`` with
``torch._functorch.config.activation_memory_budget``: the min-cut partitioner then recomputes
cheap ops to keep the saved activations under that fraction. Every benchmark and the advice read
gradseam's rows against it, so the context lives here, next to the measuring loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

# torch is imported where a block is compiled: the names and configs here are read by the command
# line's checks, before any heavy import (gradseam.tools.checks)

BUDGETS = (0.3, 0.1, 0.05, 0.0)  # 0: the compiled block keeps its inputs only
# Keys of a tool's row or candidate that are not gradseam config keys: they ask for compiled blocks
# (and the compiler's memory budget), so bench and advise name every configuration the same way.
COMPILE_KEYS = ("compile_blocks", "compile_memory_budget")


COMPILED = "compiled: "  # prefix of a gradseam configuration whose blocks are compiled too


def budget_name(budget: float) -> str:
    """The compiler alone under ``budget``: advise's candidate, and bench's reference row after "ref: "."""
    return f"compile, memory budget {budget:g}"


def budget_label(budget: float) -> str:
    return "ref: " + budget_name(budget)


def compiled_rows(named: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """``named`` gradseam configurations with their blocks compiled, named ``compiled: <label>`` everywhere."""
    return [(COMPILED + label, {**config, "compile_blocks": True}) for label, config in named]


def budget_config(budget: float) -> dict[str, Any]:
    """The compiler alone: every block compiled under ``budget``, no gradseam checkpointing."""
    return {"compile_blocks": True, "compile_memory_budget": budget}


def gradseam_keys(config: Mapping[str, Any]) -> dict[str, Any]:
    """The part of ``config`` that goes to :func:`gradseam.patch` (what a trainer config holds): not the compiler's
    keys, nor bench's own (``bench_*``: a row's GPU cap, the naive streaming reference)."""
    return {k: v for k, v in config.items() if k not in COMPILE_KEYS and not k.startswith("bench_")}


def compiles(config: Mapping[str, Any] | None) -> bool:
    """Whether a configuration compiles blocks: the compiler's own (``compile_blocks``), or a gradseam one whose region
    kind compiles. Such a configuration's first steps compile (warm-ups), and it can be faster than no checkpointing
    at all, which no eager checkpointing is."""
    if not config:
        return False
    if config.get("compile_blocks"):
        return True
    from ..config import CheckpointConfig
    from ..kinds import backend_of, kind_of

    kind = kind_of(backend_of(CheckpointConfig.from_dict(gradseam_keys(config))))
    return kind is not None and kind.compiles


@contextmanager
def applied(model: nn.Module, config: Mapping[str, Any], blocks: list[nn.Module] | None) -> Iterator[None]:
    """``model`` patched with ``config``'s gradseam keys, then its ``blocks`` compiled if it asks."""
    import gradseam

    keys = gradseam_keys(config)
    with ExitStack() as stack:
        if keys.get("gradient_checkpointing") or keys.get("gradient_checkpointing_offload_attention"):
            stack.callback(gradseam.patch(model, keys).remove)
        if config.get("compile_blocks"):
            if not blocks:
                raise gradseam.UnsupportedStrategyError("compiled blocks: the workload did not name its blocks")
            stack.enter_context(compiled_blocks(blocks, config.get("compile_memory_budget")))
        yield


@contextmanager
def compiled_blocks(blocks: list[nn.Module], budget: float | None = None) -> Iterator[None]:
    """Compile each block (``nn.Module.compile``) for the duration; ``budget`` sets the memory budget.

    Dynamo's caches are reset on entry and exit: a budget is read when a graph is partitioned, so
    a graph compiled under another budget must not be reused.
    """
    import torch
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
