"""The checks: one call each, what a ConformanceSuite test runs and what a plugin's own tests may call.

:func:`check_strategy` is the conformance check for one configuration: the patched model against the
unpatched reference (:mod:`gradseam.testing.references`), to the bit on the CPU, with fewer bytes
kept, regions that ran (whole), kept attention kernels not recomputed, an offload that moved
something, and a ``remove()`` that restores the model. :func:`check_declared_sides` checks where
attention kernels run against the declaration, and that every call into a block from outside it is declared; :func:`check_no_grad` that sampling is untouched;
:func:`check_bench_workload` that ``gradseam bench`` and ``advise`` can run the family.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import CheckpointConfig
from ..summary import RegionView
from .facts import checks_ffn, keeps_kernels, moves_to_host, strategy_for, tolerance
from .kernels import (
    KernelMap,
    assert_attention_side_covers_kernels,
    assert_seams_hold_no_attention,
    count_kernels,
)
from .references import reference
from .regions import assert_regions_ran, assert_regions_whole, record_regions
from .steps import Case, Step, as_tuple, assert_same_step, run_step


def check_declared_sides(case: Case) -> KernelMap:
    """One unpatched step of ``case``'s model, watched for where attention kernels run: no FFN seam may call
    one (:func:`assert_seams_hold_no_attention`), and every one a block with an attention side calls must run
    inside that side (:func:`assert_attention_side_covers_kernels`); and every submodule the model calls, and
    every block tensor it reads, while its block is not running must be declared (``BlockList.called_outside``: weight streaming keeps those resident,
    :func:`~gradseam.testing.outside.assert_outside_calls_declared`). Returns what it saw.

    The step is the case's reference with kernel location (:func:`~gradseam.testing.references.reference`),
    shared with the rows of :func:`check_strategy` that locate kernels too."""
    from ..patcher import family_for
    from .outside import assert_outside_calls_declared

    model = case.fresh()
    family = family_for(model)
    found = reference(case, model, family=family).kernels
    assert found is not None
    assert_seams_hold_no_attention(found, what=case.name)
    assert_attention_side_covers_kernels(found, what=case.name)
    assert_outside_calls_declared(found.outside, family, model, what=case.name, reads=found.reads)
    return found


@dataclass
class ParityReport:
    """What :func:`check_strategy` compared: the unpatched reference, the patched step, the step after
    ``remove()``, and how each region ran over the patched steps."""

    config: CheckpointConfig
    reference: Step
    patched: Step
    after_remove: Step
    regions: list[RegionView] = field(default_factory=list)  # recorded over both patched steps

    @property
    def saved_ratio(self) -> float:
        return self.patched.saved_bytes / max(self.reference.saved_bytes, 1)


def check_strategy(
    case: Case, config: CheckpointConfig | dict[str, Any], *, atol: float = 0.0, whole: bool = False
) -> ParityReport:
    """The core conformance check for one configuration.

    Patched and unpatched runs must agree exactly; the patch must keep fewer bytes between
    forward and backward whenever it checkpoints anything; ``remove()`` must restore the model
    (same results, and no instance attribute left behind on any module). With ``whole=True``
    every planned region must also have run, and run as one region (:func:`assert_regions_whole`);
    leave it off for inputs that make a chunk fall back on purpose.

    The unpatched step comes from :func:`~gradseam.testing.references.reference`: computed on a fresh
    model of the case once, and reused while nothing that determines it changes.
    """
    import gradseam

    cfg = CheckpointConfig.coerce(config)
    strategy = strategy_for(cfg)
    atol = max(atol, tolerance(strategy))  # the compiler orders gradient sums its own way
    what = f"{case.name} {cfg.describe()}"
    model = case.fresh()
    before_dicts = {name: set(m.__dict__) for name, m in model.named_modules()}
    keys_before = list(model.state_dict().keys())
    # Kernel counts need a dispatch mode, under which torch.compile cannot compile: only where kept kernels are checked.
    kept = keeps_kernels(strategy)
    ffn = checks_ffn(strategy)
    counting = count_kernels if kept else lambda: nullcontext([0])
    unpatched_kernels = 0
    if kept or ffn:
        # where the kernels run, against the declaration: a seam around attention, or an attention side that
        # misses the module calling the kernel, is exact, so it is said here, by name, before anything else
        from ..patcher import family_for

        ref = reference(case, model, family=family_for(model))
        assert ref.kernels is not None
        unpatched_kernels = ref.kernels.keepable
        if ffn:
            assert_seams_hold_no_attention(ref.kernels, what=what)
        if kept:
            assert_attention_side_covers_kernels(ref.kernels, what=what)
    else:
        ref = reference(case, model)
    expected = ref.step
    handle = gradseam.patch(model, cfg)
    try:
        assert list(model.state_dict().keys()) == keys_before, "patching changed state_dict() keys"
        assert handle.plan.regions, f"{what}: the plan holds no region: nothing of the model is patched"
        with record_regions(handle) as regions, counting() as patched_kernels:
            patched = run_step(model, case)
        assert_regions_ran(regions, what=what)  # first: a dead seam explains every check below that fails
        # (a chunk that falls back computes its later blocks twice in forward: only whole runs compare)
        if kept and unpatched_kernels and not any(r.fallbacks for r in regions):
            assert patched_kernels[0] == unpatched_kernels, (
                f"{what}: attention kernel calls that kept attention keeps (at least a quarter as many keys as "
                f"queries, no dropout) ran {patched_kernels[0]} times in a step, unpatched {unpatched_kernels}: with "
                "attention kept they must not be recomputed. Every kernel call runs "
                "where kept attention looks (inside the declared attention side, or anywhere in a block that "
                "declares none), so it did not see the call that reaches the kernel: it sees "
                "F.scaled_dot_product_attention and registered kernel ops called by the model's code, not a "
                "kernel reached inside another torch function (nn.MultiheadAttention's "
                "F.multi_head_attention_forward, say)"
            )
            # a second step must be exact too (chains and kept outputs keep state between calls)
            assert_same_step(expected, run_step(model, case), atol=atol, what=f"{what} step 2")
        engine = handle.engine
        if moves_to_host(strategy):
            assert engine is not None, f"{what}: an offload configuration installed no offload engine"
            if not engine.min_bytes:  # the CPU test mode moves every tensor, however small
                assert engine.offloaded_bytes > 0, f"{what}: the offload strategy moved nothing to host memory"
    finally:
        handle.remove()
    assert_same_step(expected, patched, atol=atol, what=what)
    after = run_step(model, case)
    assert_same_step(expected, after, what=f"{case.name} after remove()")
    after_dicts = {name: set(m.__dict__) for name, m in model.named_modules()}
    assert after_dicts == before_dicts, "remove() left attributes behind on some module"
    if cfg.enabled:
        assert patched.saved_bytes < expected.saved_bytes, (
            f"{what}: kept {patched.saved_bytes} bytes between forward and backward, "
            f"not fewer than unpatched ({expected.saved_bytes})"
        )
    if whole:
        assert_regions_whole(regions, what=what)
    return ParityReport(cfg, expected, patched, after, regions)


def check_no_grad(case: Case, config: CheckpointConfig | dict[str, Any] | None = None) -> None:
    """Under ``torch.no_grad()`` (sampling, validation) a patched model computes exactly as before and
    runs no checkpoint region at all."""
    import gradseam

    cfg = CheckpointConfig.coerce(config or {"gradient_checkpointing": True})
    model = case.fresh()
    with torch.no_grad():
        expected = as_tuple(case.output(model(**case.inputs(torch.Generator().manual_seed(1)))))
        with gradseam.patch(model, cfg) as handle, record_regions(handle) as regions:
            got = as_tuple(case.output(model(**case.inputs(torch.Generator().manual_seed(1)))))
    for i, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"{case.name} {cfg.describe()} under no_grad: output {i} differs"
    busy = [r.label for r in regions if r.runs]
    assert not busy, f"{case.name} {cfg.describe()} under no_grad ran checkpoint regions: {busy[:5]}"


def preset_model(family: str, preset: str | None = None) -> tuple[Any, Any, Any]:
    """``(family, preset, model)``: the family's model class built with the preset's config (default the
    first) on the ``meta`` device, so a real-size preset can be planned, counted and checked against the
    class's constructor without its weights. What each family's preset tests start from."""
    from ..registry import REGISTRY
    from ..tools.checks import model_class

    found = REGISTRY.get(family)
    chosen = found.presets[preset if preset is not None else next(iter(found.presets))]
    with torch.device("meta"):
        return found, chosen, model_class(found)(**chosen.config)


def check_bench_workload(
    family: str,
    config: dict[str, Any],
    inputs: dict[str, Any],
    *,
    preset: str | None = None,
    sequence: int | None = None,
    patch_config: dict[str, Any] | None = None,
) -> None:
    """What ``gradseam bench --family NAME --layers 2`` does, on a tiny model built from ``config`` fed
    by the family's real input builder (``preset``'s, default the first) with ``inputs`` as its sizes:
    build, truncate every block list to two blocks, build the inputs, step; then the same step patched
    (default: checkpointing in chunks of two) must give bit-identical input gradients.

    A plugin author calls it with their family's tiny config to learn that ``bench`` and ``advise``
    will run it; ``sequence``, when given, is the token count the first block must see.
    """
    import warnings
    from dataclasses import replace as swap

    import gradseam

    from ..family import Preset
    from ..tools.checks import find_family
    from ..tools.measure import forward_backward, grad_leaves
    from ..tools.workloads import build, sequence_length

    fam = find_family(family)
    real = fam.presets[preset] if preset else next(iter(fam.presets.values()))
    tiny = swap(fam, presets={"tiny": Preset("tiny", config, inputs, real.make_inputs)})
    torch.manual_seed(0)
    workload = build(tiny, "tiny", layers=2, device="cpu", dtype=torch.float32)
    assert workload.truncated and all(kept <= 2 for kept, _ in workload.truncated.values()), workload.truncated
    x = workload.inputs()
    seen = sequence_length(workload.model, workload.family, x)
    assert seen == sequence if sequence is not None else seen > 0, f"{family}: the first block saw {seen} tokens"
    leaves = grad_leaves(x)
    assert leaves, f"{family}: the inputs hold no tensor that needs gradients"
    forward_backward(workload.model, x)()
    reference = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an interval the family may not support, bf16 casting notes
        chunked = patch_config or {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}
        with gradseam.patch(workload.model, chunked) as handle:
            assert handle.family.name == fam.name
            forward_backward(workload.model, x)()
    assert all(torch.equal(t.grad, r) for t, r in zip(leaves, reference)), f"{family}: patched gradients differ"
    assert workload.inputs(tokens=64) is not None
    # bench measures in bfloat16: one forward in that dtype catches a family that needs modules kept in
    # float32 (or inputs the builder makes in the wrong dtype) before a GPU run does
    torch.manual_seed(0)
    half = build(tiny, "tiny", layers=2, device="cpu", dtype=torch.bfloat16)
    with torch.no_grad():
        half.model(**half.inputs())


def check_builtin_flag(case: Case, config: dict[str, Any]) -> None:
    """diffusers' own ``enable_gradient_checkpointing()`` on ``case``'s model: exact by itself, switched off
    while gradseam patches the model with ``config`` (one checkpointing layer, exact, keeping less than the
    plain model) and handed back on ``remove()``. A family whose flag path is broken upstream tests that alone."""
    import gradseam

    model = case.fresh()
    reference = run_step(model, case)
    model.enable_gradient_checkpointing()
    assert_same_step(reference, run_step(model, case), what=f"{case.name}: diffusers' own checkpointing")
    with gradseam.patch(model, config):
        assert model.gradient_checkpointing is False, f"{case.name}: diffusers' flag stayed on under the patch"
        patched = run_step(model, case)
    assert model.gradient_checkpointing is True, f"{case.name}: remove() did not hand diffusers' flag back"
    assert_same_step(reference, patched, what=f"{case.name}: patched over diffusers' flag")
    assert patched.saved_bytes < reference.saved_bytes, f"{case.name}: the patch kept no less than the plain model"
