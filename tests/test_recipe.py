"""The recipe for a backend (docs/internals.md, "Adding a backend") holds: the engine copies into the store
it is given, the plan carries the store's size, and a catalog entry of an existing kind runs everywhere
without touching the planner, the handle, the summary or the tools."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from cases import FLUX, WAN

import gradseam
from gradseam import backends, config
from gradseam.backends import Backend, Destination, Offload, Scope
from gradseam.kinds import KINDS, check_config, staying_sibling
from gradseam.offload import STORES, cpu_test_mode, host_store
from gradseam.planning import plan
from gradseam.spec import StoreSpec, strategy_of
from gradseam.testing import assert_same_step, check_strategy, run_step

UNSLOTH = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"}


class RecordingStore:
    """A store that keeps every buffer in plain memory and counts what went through it."""

    def __init__(self, max_buckets: int) -> None:
        self.max_buckets = max_buckets
        self.acquired = 0
        self.released = 0
        self.bytes = 0
        self.closed = False

    def acquire(self, nbytes: int, dtype: torch.dtype) -> tuple[torch.Tensor, None]:
        self.acquired += 1
        self.bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8), None

    def release(self, buf: torch.Tensor, token: object, events: list) -> None:
        self.released += 1

    def close(self) -> None:
        self.closed = True

    def stats(self) -> dict[str, int]:
        return {"acquired": self.acquired, "released": self.released}

    def __reduce__(self) -> tuple:
        return (RecordingStore, (self.max_buckets,))


def test_the_engine_copies_into_the_store_the_plan_names(monkeypatch):
    made: list[RecordingStore] = []

    def recording(max_buckets: int, *, test_mode: bool = False) -> RecordingStore:
        made.append(RecordingStore(max_buckets))
        return made[-1]

    monkeypatch.setitem(STORES, "host", recording)
    torch.manual_seed(0)
    model = WAN.build()
    reference = run_step(copy.deepcopy(model), WAN)
    with cpu_test_mode():
        handle = gradseam.patch(model, {**UNSLOTH, "gradient_checkpointing_offload_pin_memory_max_buckets": 5})
        assert handle.plan.stores == (StoreSpec(Destination.HOST, 5),)  # the key reaches the store through the plan
        got = run_step(model, WAN)
    (store,) = made
    assert store.max_buckets == 5 and store.acquired > 0 and store.bytes == handle.engine.offloaded_bytes
    assert handle.engine.store is store and handle.engine.stats()["acquired"] == store.acquired
    assert_same_step(reference, got, what="unsloth through a recording store")
    handle.remove()
    assert store.closed


def test_a_plan_that_moves_nothing_names_no_store():
    torch.manual_seed(0)
    model = FLUX.build()
    family = gradseam.patcher.family_for(model)
    for cfg in ({"gradient_checkpointing": True}, {**UNSLOTH, "gradient_checkpointing_backend": "torch-ffn"}):
        assert plan(model, family, gradseam.CheckpointConfig.coerce(cfg)).stores == ()
    attention = plan(model, family, gradseam.CheckpointConfig.coerce({"gradient_checkpointing_offload_attention": True}))
    assert attention.stores == (StoreSpec(Destination.HOST, 12),)


def test_a_store_pickles_as_a_fresh_one():
    pool = host_store(3, test_mode=True)
    buf, token = pool.acquire(10_000, torch.float32)
    clone = pickle.loads(pickle.dumps(pool))
    assert clone.max_buckets == 3 and clone.checked_out == 0 and pool.checked_out == 1
    pool.release(buf, token, [])


@pytest.fixture
def spill_backend(monkeypatch):
    """A backend added the way the recipe says: one catalog entry of an existing kind (whole-block),
    offloading its inputs to host memory, placed last on the ladder."""
    entry = Backend("unsloth-spill", Scope.BLOCK, Offload.INPUTS, Destination.HOST,
                    "whole blocks (or chunks of `interval` blocks)", "block inputs in spill memory",
                    kind="whole-block", ladder=99)
    monkeypatch.setitem(backends.CATALOG, entry.name, entry)
    monkeypatch.setattr(config, "BACKENDS", (*config.BACKENDS, entry.name))
    return entry


def test_a_new_catalog_entry_runs_through_every_layer(spill_backend):
    name = spill_backend.name
    cfg = gradseam.CheckpointConfig(gradient_checkpointing_backend=name, gradient_checkpointing_interval=2)
    check_config(cfg)
    strategy = strategy_of(cfg)
    assert strategy.kind is KINDS["whole-block"] and strategy.destinations == {Destination.HOST}
    assert staying_sibling(spill_backend).name == "torch"  # what a CPU model runs instead, found by kind
    with cpu_test_mode():
        report = check_strategy(FLUX, {"gradient_checkpointing_backend": name, "gradient_checkpointing_interval": 2})
    assert report.regions and all(r.kind == "whole-block" for r in report.regions)
    torch.manual_seed(0)
    model = FLUX.build()
    with cpu_test_mode(), gradseam.patch(model, cfg) as handle:
        text = str(handle.summary())
    assert f"{name}: recompute chunks of 2 blocks + CPU offload of region inputs" in text
    # the compiled kind refuses its key with the new backend too, in its own words
    with pytest.raises(gradseam.UnsupportedStrategyError, match=f"backend '{name}' compiles nothing"):
        check_config(gradseam.CheckpointConfig(gradient_checkpointing_backend=name,
                                               gradient_checkpointing_memory_budget=0.2))


def test_measuring_a_row_reads_the_engines_store():
    """bench and advise count pinned allocations through the engine's store: an engine's store that the
    measurement could not find would report 0 GiB pinned for every offload row (as it once did)."""
    from gradseam.tools.measure import forward_backward, measure

    torch.manual_seed(0)
    model = WAN.build()
    inputs = WAN.inputs(torch.Generator().manual_seed(1))
    with cpu_test_mode(), gradseam.patch(model, UNSLOTH) as handle:
        got = measure(forward_backward(model, inputs, lambda out: WAN.output(out).float().pow(2).mean(), count_saved=True), steps=2, device="cpu",
                      engine=handle.engine)
        assert handle.engine.store.stats()["pinned_allocations"] > 0
    assert got.pinned_allocations_after_warmup == 0  # the pool reuses its buffers after the warm-up
