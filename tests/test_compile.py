"""Whole-block checkpoint regions really compile under torch.compile (CPU, ``aot_eager``).

tests/test_stack.py checks that compiled patched models give the compiled-unpatched results; this
file checks that the ``torch`` backend's blocks are actually compiled rather than skipped by dynamo
and run eagerly: every compiled frame holds the checkpoint as a higher-order op
(``tag_activation_checkpoint``), and dynamo reports no graph break. Two things used to stop it:
the region scope's thread-local (``strategies._RegionScope``, a no-op under compile now) and
``type(module).forward(...)`` in ``seams.Original.direct`` (the function is captured at install).
"""

from __future__ import annotations

import pytest
import torch
from test_stack import SMALL, _compiled_reference, _compiled_step
from torch._dynamo.utils import counters

import gradseam
from gradseam.run.chains import inside_region
from gradseam.testing import assert_same_step

TORCH = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch"}


class _Recorder:
    """An ``aot_eager`` backend that records the ops of every graph it is handed."""

    def __init__(self) -> None:
        from torch._dynamo.backends.registry import lookup_backend

        self.inner = lookup_backend("aot_eager")
        self.graphs: list[list[str]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs.append([str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes
                            if n.op == "call_function"])
        return self.inner(gm, example_inputs)


@pytest.mark.parametrize("case", SMALL, ids=lambda c: c.name)
def test_whole_block_regions_compile(case):
    # the compiled unpatched model's step, computed once per process with tests/test_stack.py's rows
    reference = _compiled_reference(case, "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = case.build()
    handle = gradseam.patch(model, TORCH)
    recorder = _Recorder()
    model.compile_repeated_blocks(backend=recorder)
    for step in (1, 2):
        assert_same_step(reference, _compiled_step(model, case), atol=1e-6, what=f"step {step}")
    assert recorder.graphs, "no block frame was compiled"
    assert all("tag_activation_checkpoint" in ops for ops in recorder.graphs), recorder.graphs
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not inside_region()  # the eager scope was left balanced
    handle.remove()
    torch._dynamo.reset()


def test_region_scope_still_counts_eagerly():
    from gradseam.run.chains import Runner

    seen = []
    x = torch.ones(2, requires_grad=True)
    Runner()(lambda t: (seen.append(inside_region()), t.sin())[1], (x,), {}).sum().backward()
    assert seen == [True, True]  # forward and recompute both ran inside the region
    assert not inside_region()
