"""Every built-in family through the conformance kit's own suite: the path plugin authors use.

One ``ConformanceSuite`` per tiny model and input variant (masks, per-token timesteps, batched
padding, audio, SigLIP, STG). Each runs the kit's whole matrix: exact outputs and every
parameter and input gradient for ``torch`` / ``torch-ffn`` x interval {1, 2} x stride {none, 4},
the offload backends through the engine's CPU test mode, sampling under ``no_grad``, and the
refusal of what the family cannot do (input variants: the reduced offload matrix). Family-specific
behaviour lives in the per-family files.

At the end, the kit's own promises: the reduced matrices lose no backend (and every built-in family runs
every backend across its suites), and the cached unpatched reference is the step computed afresh and
never answers for a case that changed.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from cases import FLUX, WAN, WAN_TI2V, flux_inputs, flux_model
from cases_image import CHROMA, CHROMA_MASKED, KREA2, KREA2_MASKED, ZIMAGE, ZIMAGE_BATCH, ZIMAGE_OMNI
from cases_video import LTX2, LTX2_MASKED, LTX2_STG, LTX23, MAGEFLOW, MAGEFLOW_BATCH

import gradseam
from gradseam.testing import (
    Case,
    ConformanceSuite,
    assert_same_step,
    cpu_configs,
    offload_configs,
    reduced_configs,
    reduced_offload_configs,
    references,
    run_step,
)
from gradseam.testing.facts import backends, compiles
from gradseam.tools.named_strategies import BACKEND, INTERVAL, KEEP, OFFLOAD_ATTENTION

# Input variants (masks, batches, per-token timesteps...) rerun the whole strategy matrix; of the
# offload matrix they run the kit's reduced one (one row per mechanism: offloaded chunks, offloaded FFN
# seams, offloaded attention kernels), which keeps the suite within CI's time while every plain case
# runs all of it.


class TestFlux(ConformanceSuite):
    case = FLUX


class TestWan(ConformanceSuite):
    case = WAN


class TestWanPerTokenTimesteps(ConformanceSuite):
    case = WAN_TI2V
    reduced_offload = True


class TestChroma(ConformanceSuite):
    case = CHROMA


class TestChromaMasked(ConformanceSuite):
    case = CHROMA_MASKED
    reduced_offload = True


class TestKrea2(ConformanceSuite):
    case = KREA2


class TestKrea2Masked(ConformanceSuite):
    case = KREA2_MASKED
    reduced_offload = True


class TestZImage(ConformanceSuite):
    case = ZIMAGE


class TestZImageBatch(ConformanceSuite):
    case = ZIMAGE_BATCH
    reduced_offload = True


class TestZImageOmni(ConformanceSuite):
    case = ZIMAGE_OMNI
    reduced_offload = True


class TestLTX2(ConformanceSuite):
    case = LTX2


class TestLTX2Masked(ConformanceSuite):
    case = LTX2_MASKED
    reduced_offload = True


class TestLTX2STG(ConformanceSuite):
    case = LTX2_STG
    whole_regions = False  # STG gives two blocks their own perturbation mask: those chunks fall back on purpose


class TestLTX23(ConformanceSuite):
    case = LTX23
    reduced_offload = True


class TestMageFlow(ConformanceSuite):
    case = MAGEFLOW


class TestMageFlowBatch(ConformanceSuite):
    case = MAGEFLOW_BATCH
    reduced_offload = True


# -- the kit's own promises: reduced matrices lose no backend, the reference cache is never stale --------

FLAGS = [dict(zip(("ffn", "interval", "attention"), bits)) for bits in itertools.product((True, False), repeat=3)]


def _backend(config: dict[str, Any]) -> str:
    return config.get(BACKEND) or "torch"


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "-".join(k for k, v in f.items() if v) or "none")
def test_reduced_matrices_run_every_backend_the_full_ones_run(flags: dict[str, bool]) -> None:
    """A variant case on the reduced matrices still runs each backend (but the compiled ones, which run once
    per family in full) and each mechanism: chunks or whole blocks, FFN seams, kept and offloaded kernels."""
    ffn, interval, attention = flags["ffn"], flags["interval"], flags["attention"]
    cpu, offload = cpu_configs(ffn=ffn, interval=interval), offload_configs(**flags)
    small_cpu, small_offload = reduced_configs(ffn=ffn, interval=interval), reduced_offload_configs(**flags)
    full = {_backend(c) for c in cpu + offload if not compiles(c) and c.get(BACKEND)}
    assert {_backend(c) for c in small_cpu} == {_backend(c) for c in cpu if not compiles(c)}
    assert {_backend(c) for c in small_cpu + small_offload} == full
    assert any(c.get(KEEP) for c in small_cpu)
    assert any(c.get(OFFLOAD_ATTENTION) for c in small_offload) is attention
    assert any(c.get(INTERVAL) for c in small_cpu + small_offload) is interval
    assert len(small_cpu) < len(cpu) and len(small_offload) < len(offload)


def _case(**changes: Any) -> Case:
    return replace(FLUX, **changes)


@pytest.fixture
def no_references() -> Iterator[None]:
    references.forget()
    yield
    references.forget()


def test_a_cached_reference_is_the_step_computed_afresh(no_references: None) -> None:
    model = FLUX.fresh()
    first = references.reference(FLUX, model)
    before = references.info()
    again = references.reference(FLUX, FLUX.fresh())
    assert references.info()["hits"] == before["hits"] + 1
    assert_same_step(run_step(FLUX.fresh(), FLUX), again.step, what="cached reference")
    assert_same_step(first.step, again.step)
    # a copy each time: a caller that changes its step in place leaves the cache as it was
    again.step.param_grads[next(iter(again.step.param_grads))].add_(1.0)
    assert_same_step(first.step, references.reference(FLUX, FLUX.fresh()).step)


@pytest.mark.parametrize("change", [
    {"seed": 7},
    {"inputs": lambda g: {**flux_inputs(g), "timestep": torch.tensor([0.25])}},
    {"build": lambda: flux_model()},
    {"output": lambda out: out[0] * 2},
], ids=["seed", "inputs", "build", "output"])
def test_a_changed_case_gets_a_fresh_reference(no_references: None, change: dict[str, Any]) -> None:
    references.reference(FLUX, FLUX.fresh())
    changed = _case(**change)
    misses = references.info()["misses"]
    got = references.reference(changed, changed.fresh())
    assert references.info()["misses"] == misses + 1
    assert_same_step(run_step(changed.fresh(), changed), got.step, what=f"changed {sorted(change)}")


def test_a_build_reading_changed_state_is_keyed_by_what_it_built(no_references: None) -> None:
    """Same case object, same callables: a build whose result depends on state a test changed (a width read
    from a dict, say) must not be answered from the model it built before."""
    width = {"layers": 1}

    def build() -> torch.nn.Module:
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=width["layers"],
                                      attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                      pooled_projection_dim=8, axes_dims_rope=[2, 2, 4])

    case = Case("flux-width", build, flux_inputs)
    hits = references.info()["hits"]
    one = references.reference(case, case.fresh())
    width["layers"] = 2
    two = references.reference(case, case.fresh())
    assert references.info()["hits"] == hits
    assert set(one.step.param_grads) < set(two.step.param_grads)


def test_located_and_plain_references_are_kept_apart(no_references: None) -> None:
    from gradseam.patcher import family_for

    model = FLUX.fresh()
    misses = references.info()["misses"]
    plain = references.reference(FLUX, model)
    located = references.reference(FLUX, model, family=family_for(model))
    assert plain.kernels is None and located.kernels is not None and located.kernels.count > 0
    assert references.info()["misses"] == misses + 2
    assert_same_step(plain.step, located.step)


def test_the_cache_is_bounded(no_references: None) -> None:
    for seed in range(references.MAX_REFERENCES + 3):
        case = _case(seed=seed)
        references.reference(case, case.fresh())
    assert references.info()["entries"] == references.MAX_REFERENCES


def test_a_build_that_is_not_deterministic_fails_by_name(no_references: None) -> None:
    calls = iter(range(100))

    def build() -> torch.nn.Module:
        model = flux_model()
        if next(calls):  # every build after the first differs
            torch.nn.init.zeros_(model.proj_out.weight)
        return model

    case = Case("flux-drifting", build, flux_inputs)
    with pytest.raises(AssertionError, match=r"flux-drifting: build\(\) gave a different model the second time"):
        references.reference(case, case.fresh())


def _suites(cls: type[ConformanceSuite]) -> list[type[ConformanceSuite]]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_suites(sub)]
    return found


HAND_WRITTEN = {"anyflow-far": "tests/test_family_anyflow.py"}
# Backends a family's suite leaves out because the kit's kernel locator cannot run flex attention, run by the
# named hand-written test instead: Kandinsky 6 SR always attends through flex attention.
HAND_WRITTEN_BACKENDS = {"kandinsky6-sr": ({"torch-ffn", "unsloth-ffn"}, "tests/test_family_kandinsky6.py", "test_sr_ffn_rows")}


def test_every_backend_runs_on_every_builtin_family() -> None:
    """What the reduced matrices may not lose: across its suites, each built-in family runs every backend of
    the catalog (the compiled ones in their ``compiled`` rows)."""
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        importlib.import_module(path.stem)  # the suites pytest collects from there (already imported)
    ran: dict[str, set[str]] = {}
    for suite in _suites(ConformanceSuite):
        if "case" in vars(suite) and suite.__module__ != "test_kit_fails_wrong_adapters":
            rows = suite.strategy_configs() + suite.offload_configs()
            ran.setdefault(suite.family().name, set()).update(_backend(c) for c in rows if c.get("gradient_checkpointing"))
    everything = {b.name for b in backends()}
    installed = {i.family.name: i.family for i in gradseam.installed() if i.distribution == "gradseam"}
    assert installed
    # a family without an FFN seam refuses the -ffn backends by declaration (tests in its file check the refusal)
    runnable = {name: {b.name for b in backends() if fam.has_ffn or not b.ffn}
                for name, fam in installed.items()}
    assert runnable["minimax-music3"] < everything  # the exemption is taken where it applies, and only there
    # run by hand-written tests of the kit's steps, not by a suite: the kit's kernel locator (a dispatch mode)
    # cannot run flex attention's eager path, which every FAR block calls
    for name in HAND_WRITTEN:
        assert name in installed and name not in ran, f"{name}: the exemption is stale; it has a suite now"
        ran[name] = runnable[name]
    for name, (backend_names, path, test) in HAND_WRITTEN_BACKENDS.items():
        source = (Path(__file__).parent.parent / path).read_text()
        assert f"def {test}(" in source and all(b in source for b in backend_names), f"{name}: {path}::{test} is gone"
        assert not backend_names <= ran.get(name, set()), f"{name}: the exemption is stale; its suite runs them now"
        ran.setdefault(name, set()).update(backend_names)
    missing = {name: sorted(runnable[name] - ran.get(name, set())) for name in sorted(installed)}
    assert not any(missing.values()), {name: lost for name, lost in missing.items() if lost}
