"""Measuring shares compiled block functions between the patches it makes (:func:`gradseam.run.compiled.sharing`).

``auto`` and ``advise`` patch one model once per candidate and depth, and once more for the plan's whole-model run.
Within a sharing scope a patch takes the functions an earlier patch compiled for the same budget: it compiles no
new graph and trains as a patch of its own would, to the bit. Outside one, each handle compiles its own (two
patched models in one training process never share a cache).
"""

from __future__ import annotations

import pytest
import torch
from cases import FLUX, WAN

import gradseam
from gradseam.offload import cpu_test_mode
from gradseam.run import compiled
from gradseam.testing import assert_same_step, run_step

ON = {"gradient_checkpointing": True}
COMPILE = {**ON, "gradient_checkpointing_backend": "compile"}
OFFLOADED = {**ON, "gradient_checkpointing_backend": "unsloth-compile"}


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _patched_step(model: torch.nn.Module, config: dict, case=WAN):
    with cpu_test_mode(), gradseam.patch(model, config):
        return run_step(model, case, count_bytes=False)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_within_a_sharing_scope_another_patch_compiles_nothing_and_steps_to_the_bit(fresh_dynamo):
    model = WAN.fresh()
    alone = _patched_step(model, COMPILE)  # a handle of its own, as in training
    with compiled.sharing():
        first = _patched_step(model, COMPILE)
        graphs = _graphs()
        again = _patched_step(model, COMPILE)
        assert _graphs() == graphs, "a second patch in the scope compiled again"
        offloaded = _patched_step(model, OFFLOADED)  # the same budget: the offload group sits outside the graph
        assert _graphs() == graphs, "unsloth-compile at compile's budget compiled again"
    assert_same_step(alone, first)
    assert_same_step(first, again)
    assert_same_step(first, offloaded)


def test_another_budget_in_the_scope_compiles_its_own(fresh_dynamo):
    model = WAN.fresh()
    with compiled.sharing():
        _patched_step(model, COMPILE)
        graphs = _graphs()
        _patched_step(model, {**COMPILE, "gradient_checkpointing_memory_budget": 0.3})
        assert _graphs() > graphs, "a patch under another budget took a function partitioned for the first"


def test_outside_a_scope_each_patch_compiles_its_own(fresh_dynamo):
    model = WAN.fresh()
    _patched_step(model, COMPILE)
    graphs = _graphs()
    _patched_step(model, COMPILE)
    assert _graphs() > graphs
    assert not compiled._SHARED, "a scope was left open"


def test_auto_and_advise_measure_inside_one_scope(monkeypatch):
    """Both planners' measuring runs inside one sharing scope, from the first candidate to the last."""

    from gradseam.auto import Request
    from gradseam.patcher import family_for
    from gradseam.tools import auto_planner
    from gradseam.tools.advise import Estimate, advise

    scopes: list[int] = []

    def measure(config):
        scopes.append(id(compiled._SHARED[-1]) if compiled._SHARED else 0)
        return Estimate(1.0, 100.0)

    advise(None, {}, 50.0, measure=measure, static_gib=1.0)
    assert len(scopes) >= 2 and len(set(scopes)) == 1 and scopes[0] != 0

    scopes.clear()
    model = WAN.fresh()
    request = Request(model, WAN.inputs(torch.Generator().manual_seed(1)), 40.0, 8.0, family_for(model))
    monkeypatch.setenv("GRADSEAM_CACHE_DIR", str(pytest.importorskip("tempfile").mkdtemp()))
    auto_planner.plan(request, measure_on=lambda request: (measure, "depths 1 and 2", 0.0))
    assert len(scopes) == len(auto_planner.CANDIDATES) and len(set(scopes)) == 1 and scopes[0] != 0
    assert not compiled._SHARED


def test_a_shared_function_near_dynamos_recompile_limit_is_not_handed_on(fresh_dynamo):
    """Past ``recompile_limit`` dynamo runs a function eagerly: a measurement would time the block without its
    budget or offload. A shared function with fewer than ``ROOM`` graphs left before the limit makes the next patch
    compile a fresh one."""
    from torch._dynamo import config as dynamo_config

    model = FLUX.fresh()
    with compiled.sharing():
        first = _patched_step(model, COMPILE, FLUX)  # compiled afresh: the reference for the renewed function's step
        before = dict(compiled._SHARED[-1])
        _patched_step(model, COMPILE, FLUX)
        assert compiled._SHARED[-1] == before, "a function with room was not handed on"
        # Flux's single-stream function holds two graphs (its first block's inputs are laid out unlike the rest's)
        with dynamo_config.patch(recompile_limit=compiled.ROOM + 1):
            graphs = _graphs()
            again = _patched_step(model, COMPILE, FLUX)
        after = compiled._SHARED[-1]
        renewed = [key for key in before if after[key][0] is not before[key][0]]
        assert renewed and _graphs() > graphs, "a function at the limit was handed on"
    assert_same_step(first, again)
