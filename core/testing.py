"""The conformance kit: what any adapter (built-in or third-party) must pass.

A plugin describes its family's tiny test model as a :class:`Case` and either subclasses
:class:`ConformanceSuite` in its own pytest run (one test per configuration, so a failure names
the configuration) or calls the checks here directly. gradseam's own tests use exactly these
functions for every built-in family.

The checks compare against the *unpatched* model on the CPU in float32, where gradseam must be
exact: same outputs, same gradient for every parameter and every input, to the bit. Exactness
alone is not enough, though: a seam that the model never calls is trivially exact and saves
nothing, and an interval chunk that falls back to per-block regions is exact but not what the
user asked for. :func:`check_regions` therefore also records, per planned region, how often it
ran and whether it ran as one region, and :func:`check_declared_sides` where attention kernels run
against what the family declares (no FFN seam around attention, no kernel outside the attention side).

The module is also a pytest plugin (registered by the first :class:`ConformanceSuite` pytest collects):
it declares the kit's ``compiled`` marker and leaves the compiled rows out unless ``-m`` selects them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import nn

from .backends import CATALOG, Offload, Scope
from .config import CheckpointConfig
from .spec import Kept, Kind, strategy_of
from .summary import RegionView
from .tools.measure import count_saved_bytes
from .tools.named_strategies import INTERVAL, KEEP, OFFLOAD_ATTENTION, ON, STRIDE

Inputs = dict[str, Any]

# Relative and absolute tolerance for backends that are not bit-identical to eager (the compiled ones,
# whose compiler sums gradient contributions in its own order): fp32 on the CPU differs by ~1e-8 there.
COMPILED_TOLERANCE = 1e-5


def randn(g: torch.Generator, *shape: int, grad: bool = False) -> torch.Tensor:
    """A CPU tensor of standard normals from ``g`` (a Case's inputs draw from it), optionally a leaf
    that requires grad: every family's tiny inputs are built from these."""
    return torch.randn(*shape, generator=g).requires_grad_(grad)


@dataclass
class Case:
    """A tiny, deterministic instance of a family's model and a way to feed it.

    ``inputs(generator)`` must return fresh tensors on every call (the same values for the same
    generator seed); tensors that should receive gradients must have ``requires_grad=True``.
    ``output`` picks the tensor(s) the loss is computed on from the model's return value.
    """

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], Inputs]
    output: Callable[[Any], torch.Tensor | tuple[torch.Tensor, ...]] = field(default=lambda out: out[0])
    seed: int = 0

    def twins(self) -> tuple[nn.Module, nn.Module]:
        """Two models with the same weights: one to patch, one to run unpatched beside it."""
        torch.manual_seed(self.seed)
        model = self.build()
        twin = self.build()
        twin.load_state_dict(model.state_dict())
        return model, twin


@dataclass
class Step:
    outputs: tuple[torch.Tensor, ...]
    input_grads: dict[str, torch.Tensor]
    param_grads: dict[str, torch.Tensor]
    saved_bytes: int


def _as_tuple(value: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def run_step(model: nn.Module, case: Case, *, seed: int = 1, count_bytes: bool = True) -> Step:
    """One forward + backward with ``sum(out.square().mean())`` as the loss; returns everything it touched.

    ``count_bytes=False`` runs the forward without the byte-counting saved-tensor hooks, for tests
    that must see gradseam's own hooks alone (``saved_bytes`` is then 0).
    """
    model.zero_grad(set_to_none=True)
    inputs = case.inputs(torch.Generator().manual_seed(seed))
    params = {id(p) for p in model.parameters()}
    with count_saved_bytes(params) if count_bytes else nullcontext([0]) as saved:
        outputs = _as_tuple(case.output(model(**inputs)))
    loss = sum(o.float().square().mean() for o in outputs)
    loss.backward()  # type: ignore[union-attr]
    input_grads = {
        k: v.grad.detach().clone()
        for k, v in inputs.items()
        if isinstance(v, torch.Tensor) and v.requires_grad and v.grad is not None
    }
    param_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return Step(tuple(o.detach().clone() for o in outputs), input_grads, param_grads, saved[0])


def assert_same_step(expected: Step, got: Step, *, atol: float = 0.0, what: str = "") -> None:
    """Outputs, every input gradient and every parameter gradient must match (to the bit by default)."""
    prefix = f"{what}: " if what else ""

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        if atol == 0.0:
            return torch.equal(a, b)
        return torch.allclose(a, b, atol=atol, rtol=atol)

    assert len(expected.outputs) == len(got.outputs), f"{prefix}number of outputs differs"
    for i, (a, b) in enumerate(zip(expected.outputs, got.outputs)):
        assert close(a, b), f"{prefix}output {i} differs by {(a - b).abs().max().item():.3e}"
    assert expected.input_grads.keys() == got.input_grads.keys(), (
        f"{prefix}inputs with gradients differ: {sorted(expected.input_grads)} vs {sorted(got.input_grads)}"
    )
    for name, a in expected.input_grads.items():
        b = got.input_grads[name]
        assert close(a, b), f"{prefix}gradient of input {name!r} differs by {(a - b).abs().max().item():.3e}"
    assert expected.param_grads.keys() == got.param_grads.keys(), (
        f"{prefix}parameters with gradients differ: "
        f"{sorted(set(expected.param_grads) ^ set(got.param_grads))[:5]}"
    )
    for name, a in expected.param_grads.items():
        b = got.param_grads[name]
        assert close(a, b), f"{prefix}gradient of parameter {name!r} differs by {(a - b).abs().max().item():.3e}"


# What a region did during a step is a RegionView of the handle with its counts taken over the step.
RegionRun = RegionView


@contextmanager
def record_regions(handle: Any) -> Iterator[list[RegionView]]:
    """Count, while the block is active, how each region of ``handle`` runs.

    Yields a list that is filled when the block exits with one :class:`~gradseam.handle.RegionView`
    per region, its counts taken over the block only (:meth:`gradseam.handle.PatchHandle.regions`).
    Attention-offload regions are listed too: their ``calls`` count the offloaded calls.
    """
    before = {r.label: r for r in handle.regions()}
    found: list[RegionView] = []
    try:
        yield found
    finally:
        for r in handle.regions():
            old = before.get(r.label)
            calls = tuple(c - (old.calls[i] if old and old.calls else 0) for i, c in enumerate(r.calls))
            found.append(replace(
                r, calls=calls, runs=r.runs - (old.runs if old else 0),
                chunk_calls=r.chunk_calls - (old.chunk_calls if old else 0),
                served=r.served - (old.served if old else 0),
                fallbacks=_since(r.fallbacks, old.fallbacks if old else {}),
                notes=_since(r.notes, old.notes if old else {}),
            ))


def _since(now: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """The counts gained between two readings of a cause -> count map (causes that did not move left out)."""
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


def assert_regions_ran(regions: list[RegionView], *, what: str = "") -> None:
    """Every planned region ran during the step: a seam the model never calls is trivially exact and
    saves nothing, so an adapter declaring one is wrong."""
    prefix = f"{what}: " if what else ""
    for r in regions:
        thing = ("attention submodule, so offloading it saves nothing. The family declares an attention side"
                 if r.kind is Kind.ATTENTION_OFFLOAD else
                 "module, so checkpointing it saves nothing. The family declares a block list or FFN seam")
        assert r.ran, (
            f"{prefix}region {r.label} ({r.kind}) never ran: the model did not call that {thing} that this "
            "model's forward does not use."
        )


def assert_regions_whole(regions: list[RegionView], *, what: str = "") -> None:
    """Every region ran during the step, and every chunk or multi-module seam ran as one region."""
    prefix = f"{what}: " if what else ""
    assert_regions_ran(regions, what=what)
    for r in regions:
        if r.whole or r.kind is Kind.ATTENTION_OFFLOAD:
            continue
        if r.kind == "chunk":
            why = (
                "the model changed a value between the blocks (a residual added in its loop), passed the next "
                "block other arguments, or the family's Carry does not say where the block's outputs go "
                "(see 'Carry' in docs/plugins.md)"
            )
        else:
            why = (
                "the seam's modules are not called strictly one on the previous one's output "
                "(see 'FFN seams' in docs/plugins.md)"
            )
        raise AssertionError(
            f"{prefix}region {r.label} ({r.kind}) did not run as one region: its members were called "
            f"{r.calls} times and it computed {r.runs} region(s)"
            f"{', and members computed alone because ' + '; '.join(r.fallbacks) if r.fallbacks else ''}. "
            f"Results stay exact, but {why}."
        )


@contextmanager
def count_kernels() -> Iterator[list[int]]:
    """How many attention kernel calls (:mod:`gradseam.run.kernels`) really run in the block.

    An outermost dispatch mode: a kernel answered from kept outputs in a recompute never reaches
    it, so with attention kept a patched step counts exactly what an unpatched step counts.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    from .run.kernels import attention_kernels

    kernels = attention_kernels()
    count = [0]

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if kernels(func):
                count[0] += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        yield count


# -- where attention kernels are called, against what the family declares ----------------------


@dataclass(frozen=True)
class KernelSite:
    """One attention kernel call of an unpatched step, and where in the model it was made.

    ``block`` labels the declared block it ran in (``"transformer_blocks[3]"``; ``""`` outside every
    block), ``module`` is the innermost submodule of that block whose ``forward`` was running (a path
    relative to the block, ``""`` for the block's own ``forward``), ``stack`` every submodule of the
    block on the call stack, outermost first.
    """

    op: str
    block: str
    block_type: str
    module: str
    stack: tuple[str, ...]


@dataclass
class KernelMap:
    """What :func:`locate_kernels` saw: each kernel call, which block submodules ran, and the declarations."""

    sites: list[KernelSite] = field(default_factory=list)
    called: set[tuple[str, str]] = field(default_factory=set)  # (block, submodule path) of every call
    declared: dict[str, Any] = field(default_factory=dict)  # block label -> its BlockClass

    @property
    def count(self) -> int:
        return len(self.sites)


@contextmanager
def locate_kernels(model: nn.Module, family: Any) -> Iterator[KernelMap]:
    """Count the attention kernel calls (:mod:`gradseam.run.kernels`) in the block, as :func:`count_kernels`
    does, and record for each which submodule of which declared block made it.

    For an unpatched model: forward hooks on every submodule of every block the family declares keep
    a call stack, and an outermost dispatch mode reads it whenever a kernel runs. The hooks are removed
    on exit.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    from .planning import resolve, unwrap
    from .run.kernels import attention_kernels

    kernels = attention_kernels()
    found = KernelMap()
    stack: list[tuple[str, str]] = []
    handles: list[Any] = []
    block_types: dict[str, str] = {}  # block label -> the block's class name

    def enter(label: str, path: str) -> Callable[..., None]:
        def pre(module: nn.Module, args: Any) -> None:
            stack.append((label, path))
            found.called.add((label, path))

        return pre

    def leave(label: str, path: str) -> Callable[..., None]:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            for i in range(len(stack) - 1, -1, -1):  # the latest entry (a module shared by blocks is hooked twice)
                if stack[i] == (label, path):
                    del stack[i]
                    break

        return post

    for block_list in family.block_lists:
        blocks = resolve(model, block_list.path)
        if blocks is None:
            continue
        for index, raw in enumerate(blocks):
            block = unwrap(raw)
            declared = family.block_class_for(type(block))
            if declared is None:
                continue
            label = f"{block_list.path}[{index}]"
            found.declared[label] = declared
            block_types[label] = type(block).__qualname__
            for path, sub in block.named_modules():
                handles.append(sub.register_forward_pre_hook(enter(label, path)))
                handles.append(sub.register_forward_hook(leave(label, path), always_call=True))

    class _Locate(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if kernels(func):
                label = stack[-1][0] if stack else ""
                inside = tuple(path for owner, path in stack if owner == label and path)
                found.sites.append(KernelSite(func._schema.name, label, block_types.get(label, ""),
                                              inside[-1] if inside else "", inside))
            return func(*args, **(kwargs or {}))

    try:
        with _Locate():
            yield found
    finally:
        for handle in handles:
            handle.remove()


def _on_stack(site: KernelSite, path: str) -> bool:
    return path in site.stack


def assert_seams_hold_no_attention(found: KernelMap, *, what: str = "") -> None:
    """No FFN seam calls an attention kernel. The ``-ffn`` backends recompute each seam in backward and keep
    only its input: a seam around attention recomputes attention and keeps every feed-forward activation,
    the opposite of what they are for, while every result stays exact (so parity alone cannot tell)."""
    prefix = f"{what}: " if what else ""
    for site in found.sites:
        declared = found.declared.get(site.block)
        if declared is None:
            continue
        for seam in declared.ffn:
            inside = [p for p in seam if _on_stack(site, p)]
            if inside:
                where = f"in {site.module!r}" if site.module != inside[0] else ""
                raise AssertionError(
                    f"{prefix}FFN seam {'→'.join(seam)} of {site.block_type} ({site.block}) contains attention: "
                    f"{inside[0]!r} calls an attention kernel ({site.op}){' ' + where if where else ''}. The -ffn "
                    "backends recompute a seam in backward and keep only its input, so this seam recomputes "
                    "attention and keeps every feed-forward activation: exact, but the opposite of what they are "
                    "for. Declare the feed-forward modules (the MLP) as the seam and the attention modules as the "
                    "attention side (see 'FFN seams' in docs/plugins.md)."
                )


def assert_attention_side_covers_kernels(found: KernelMap, *, what: str = "") -> None:
    """Every attention kernel a block calls runs inside its declared attention side (for block classes that
    declare one). Kept attention enters its kernel modes only inside the declared attention submodules, so a
    kernel called elsewhere is recomputed in backward (and attention offload leaves its saved tensors where
    they are) while ``summary()`` still says "except attention kernels"."""
    prefix = f"{what}: " if what else ""
    for site in found.sites:
        declared = found.declared.get(site.block)
        if declared is None or not declared.attention:
            continue
        if any(_on_stack(site, p) for p in declared.attention):
            continue
        notes = []
        for path in declared.attention:
            if (site.block, path) not in found.called:
                notes.append(f"{path!r} is never called by this block")
            elif not any(s.block == site.block and _on_stack(s, path) for s in found.sites):
                notes.append(f"{path!r} calls no attention kernel")
        declared_side = repr(tuple(declared.attention))
        if site.module:
            where = f"submodule {site.module!r}"
            fix = f"Declare {site.module!r} in BlockClass(attention=...)"
            if notes:
                fix += " in place of the module(s) that call no kernel"
        else:
            where = "the block's own forward, outside any submodule"
            fix = ("No attention side can cover that: declare none (attention=()), and kept attention watches "
                   "the whole block")
        raise AssertionError(
            f"{prefix}{site.block_type} ({site.block}) calls an attention kernel ({site.op}) in {where}, which "
            f"is outside its declared attention side {declared_side}{' (' + '; '.join(notes) + ')' if notes else ''}. "
            "Kept attention keeps kernel outputs only inside the declared attention modules, so this kernel is "
            "recomputed in backward while summary() says 'except attention kernels', and attention offload "
            f"leaves its saved tensors in place. {fix} (see 'Attention side' in docs/plugins.md)."
        )


def check_declared_sides(case: Case) -> KernelMap:
    """One unpatched step of ``case``'s model, watched for where attention kernels run: no FFN seam may call
    one (:func:`assert_seams_hold_no_attention`), and every one a block with an attention side calls must run
    inside that side (:func:`assert_attention_side_covers_kernels`). Returns what it saw."""
    from .patcher import family_for

    torch.manual_seed(case.seed)
    model = case.build()
    family = family_for(model)
    with locate_kernels(model, family) as found:
        run_step(model, case, count_bytes=False)
    assert_seams_hold_no_attention(found, what=case.name)
    assert_attention_side_covers_kernels(found, what=case.name)
    return found


@dataclass
class ParityReport:
    config: CheckpointConfig
    reference: Step
    patched: Step
    after_remove: Step
    regions: list[RegionRun] = field(default_factory=list)  # recorded over both patched steps

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
    """
    import gradseam

    cfg = CheckpointConfig.coerce(config)
    strategy = strategy_of(cfg)
    if strategy.backend is not None and not strategy.backend.bitwise:
        atol = max(atol, COMPILED_TOLERANCE)  # the compiler orders gradient sums its own way
    what = f"{case.name} {cfg.describe()}"
    torch.manual_seed(case.seed)
    model = case.build()
    before_dicts = {name: set(m.__dict__) for name, m in model.named_modules()}
    keys_before = list(model.state_dict().keys())
    # Kernel counts need a dispatch mode, under which torch.compile cannot compile: only where kept kernels are checked.
    kept = strategy.kept is not Kept.NOWHERE
    counting = count_kernels if kept else lambda: nullcontext([0])
    if kept or strategy.scope is Scope.FFN:
        # where the kernels run, against the declaration: a seam around attention, or an attention side that
        # misses the module calling the kernel, is exact, so it is said here, by name, before anything else
        from .patcher import family_for

        with locate_kernels(model, family_for(model)) as found:
            reference = run_step(model, case)
        unpatched_kernels = [found.count]
        if strategy.scope is Scope.FFN:
            assert_seams_hold_no_attention(found, what=what)
        if kept:
            assert_attention_side_covers_kernels(found, what=what)
    else:
        reference = run_step(model, case)
        unpatched_kernels = [0]
    handle = gradseam.patch(model, cfg)
    try:
        assert list(model.state_dict().keys()) == keys_before, "patching changed state_dict() keys"
        assert handle.plan.regions, f"{what}: the plan holds no region: nothing of the model is patched"
        with record_regions(handle) as regions, counting() as patched_kernels:
            patched = run_step(model, case)
        assert_regions_ran(regions, what=what)  # first: a dead seam explains every check below that fails
        # (a chunk that falls back computes its later blocks twice in forward: only whole runs compare)
        if strategy.kept is not Kept.NOWHERE and unpatched_kernels[0] and not any(r.fallbacks for r in regions):
            assert patched_kernels[0] == unpatched_kernels[0], (
                f"{what}: attention kernels ran {patched_kernels[0]} times in a step, unpatched "
                f"{unpatched_kernels[0]}: with attention kept they must not be recomputed. Every kernel call runs "
                "where kept attention looks (inside the declared attention side, or anywhere in a block that "
                "declares none), so it did not see the call that reaches the kernel: it sees "
                "F.scaled_dot_product_attention and registered kernel ops called by the model's code, not a "
                "kernel reached inside another torch function (nn.MultiheadAttention's "
                "F.multi_head_attention_forward, say)"
            )
            # a second step must be exact too (chains and kept outputs keep state between calls)
            assert_same_step(reference, run_step(model, case), atol=atol, what=f"{what} step 2")
        engine = handle.engine
        if strategy.needs_engine:
            assert engine is not None, f"{what}: an offload configuration installed no offload engine"
            if not engine.min_bytes:  # the CPU test mode moves every tensor, however small
                assert engine.offloaded_bytes > 0, f"{what}: the offload strategy moved nothing to host memory"
    finally:
        handle.remove()
    assert_same_step(reference, patched, atol=atol, what=what)
    after = run_step(model, case)
    assert_same_step(reference, after, what=f"{case.name} after remove()")
    after_dicts = {name: set(m.__dict__) for name, m in model.named_modules()}
    assert after_dicts == before_dicts, "remove() left attributes behind on some module"
    if cfg.enabled:
        assert patched.saved_bytes < reference.saved_bytes, (
            f"{what}: kept {patched.saved_bytes} bytes between forward and backward, "
            f"not fewer than unpatched ({reference.saved_bytes})"
        )
    if whole:
        assert_regions_whole(regions, what=what)
    return ParityReport(cfg, reference, patched, after, regions)


def check_no_grad(case: Case, config: CheckpointConfig | dict[str, Any] | None = None) -> None:
    """Under ``torch.no_grad()`` (sampling, validation) a patched model computes exactly as before and
    runs no checkpoint region at all."""
    import gradseam

    cfg = CheckpointConfig.coerce(config or {"gradient_checkpointing": True})
    torch.manual_seed(case.seed)
    model = case.build()
    with torch.no_grad():
        expected = _as_tuple(case.output(model(**case.inputs(torch.Generator().manual_seed(1)))))
        with gradseam.patch(model, cfg) as handle, record_regions(handle) as regions:
            got = _as_tuple(case.output(model(**case.inputs(torch.Generator().manual_seed(1)))))
    for i, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"{case.name} {cfg.describe()} under no_grad: output {i} differs"
    busy = [r.label for r in regions if r.runs]
    assert not busy, f"{case.name} {cfg.describe()} under no_grad ran checkpoint regions: {busy[:5]}"


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

    from .family import Preset
    from .tools.measure import forward_backward, grad_leaves
    from .tools.workloads import build, find_family, sequence_length

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
    assert leaves and x["hidden_states"].requires_grad, f"{family}: the inputs hold no tensor that needs gradients"
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


def cpu_configs(*, ffn: bool = True, interval: bool = True, stride: bool = True) -> list[dict[str, Any]]:
    """The CPU matrix every adapter passes: each catalog backend that moves nothing, x interval {1, 2}
    x stride {none, 4} where the backend chunks, and whole blocks that keep attention kernel outputs."""
    out, kept, compiled = [], [], []
    for b in CATALOG.values():
        if b.offload is not Offload.NOTHING or (b.scope is Scope.FFN and not ffn):
            continue
        if b.budget:  # compiled blocks: one row, at the end (see COMPILED_MARK)
            compiled.append({**ON, "gradient_checkpointing_backend": b.name})
            continue
        chunked = b.chunks and (interval or b.scope is Scope.FFN)
        for n in [None, 2] if chunked and interval else [None]:
            for s in [None, 4] if stride and b.chunks else [None]:
                out.append({**ON, "gradient_checkpointing_backend": b.name, INTERVAL: n, STRIDE: s})
        if b.scope is Scope.BLOCK and b.kept_attention:
            kept.append({**ON, "gradient_checkpointing_backend": b.name, KEEP: True,
                         INTERVAL: 2 if interval and b.chunks else None})
    return out + kept + compiled


def offload_configs(*, ffn: bool = True, interval: bool = True, attention: bool = True) -> list[dict[str, Any]]:
    """Offload configurations; run them inside :func:`gradseam.offload.cpu_test_mode` on the CPU,
    where every offloaded byte goes through host buffers and back exactly as on a GPU: each catalog
    backend that offloads (with interval 2 + stride 4 where it chunks), attention offload alone and
    beside every backend that supports it, and with a stride that leaves blocks out."""
    out: list[dict[str, Any]] = []
    compiled: list[dict[str, Any]] = []
    for b in CATALOG.values():
        if b.scope is Scope.FFN and not ffn:
            continue
        if b.offload is not Offload.NOTHING and b.budget:  # compiled blocks: at the end (see COMPILED_MARK)
            compiled.append({**ON, "gradient_checkpointing_backend": b.name})
        elif b.offload is not Offload.NOTHING:
            out.append({**ON, "gradient_checkpointing_backend": b.name})
            if interval and b.chunks and b.scope is Scope.BLOCK:
                out.append({**ON, "gradient_checkpointing_backend": b.name, INTERVAL: 2, STRIDE: 4})
    if attention:
        # (in the order the suites' reduced matrices were written against: whole blocks, alone, strided, FFN)
        offloaders = [b for b in CATALOG.values() if not b.budget and not (b.scope is Scope.FFN and not ffn)]
        for b in offloaders:
            if b.scope is Scope.BLOCK and b.kept_attention:
                n = 2 if interval and b.chunks and b.offload is not Offload.NOTHING else None
                out.append({**ON, "gradient_checkpointing_backend": b.name, OFFLOAD_ATTENTION: True, INTERVAL: n})
        out.append({OFFLOAD_ATTENTION: True})
        # a stride leaves blocks out: their attention is offloaded beside the checkpointed blocks' kept kernels
        out.append({**ON, STRIDE: 3, OFFLOAD_ATTENTION: True})
        out += [{**ON, "gradient_checkpointing_backend": b.name, OFFLOAD_ATTENTION: True}
                for b in offloaders if b.scope is Scope.FFN]
    return out + compiled


def pick(configs: list[dict[str, Any]], *wanted: dict[str, Any]) -> list[dict[str, Any]]:
    """The configs of a kit matrix with exactly these settings, in the order asked, found by content (not by
    position, which follows the backend catalog): each ``wanted`` is the keys a config sets besides
    ``gradient_checkpointing: True``, e.g. ``{"gradient_checkpointing_backend": "torch", INTERVAL: 2}``.
    For a reduced matrix over a case's input variants."""
    def set_keys(c: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in c.items() if v is not None}

    found = []
    for w in wanted:
        match = [c for c in configs if set_keys(c) == {**ON, **w}]
        assert match, f"the kit's matrix has no config {w}"
        found.append(copy.deepcopy(match[0]))
    return found


def _compiles(config: dict[str, Any]) -> bool:
    """Rows of a compiled backend: the kit marks them ``compiled`` (:data:`COMPILED_MARK`). Compiling each
    family's tiny model costs 5-90 s on a CPU, so they run only when ``-m`` selects them (see
    :func:`pytest_collection_modifyitems`)."""
    backend = strategy_of(CheckpointConfig.coerce(config)).backend
    return backend is not None and backend.budget


def config_id(config: dict[str, Any]) -> str:
    """A short, stable test id for a configuration (``torch-ffn+interval2+stride4``)."""
    cfg = CheckpointConfig.coerce(config)
    return cfg.describe().replace(", ", "+").replace(" ", "")


# -- pytest integration: the kit's marker, and its compiled rows opt-in ---------------------------
#
# gradseam.testing is a pytest plugin. A ConformanceSuite registers it when pytest collects the suite, so a
# plugin's test file needs no setup: the marker is declared (no PytestUnknownMarkWarning, --strict-markers
# passes) and the compiled rows are deselected unless -m selects them. Listing it in a conftest.py
# (``pytest_plugins = ["gradseam.testing"]``) or ``-p gradseam.testing`` registers it earlier, the same way.

COMPILED_MARK = "compiled"
MARKERS = (
    f"{COMPILED_MARK}: the gradseam conformance kit's compiled-backend rows (5-90 s each on a CPU); left out "
    "unless -m selects them: -m compiled runs them alone, -m 'compiled or not compiled' everything",
)
_PLUGIN_NAME = "gradseam.testing"


def pytest_configure(config: Any) -> None:
    """Declare the kit's markers."""
    for line in MARKERS:
        config.addinivalue_line("markers", line)


def _kit_compiled_row(item: Any) -> bool:
    cls = getattr(item, "cls", None)
    return (isinstance(cls, type) and issubclass(cls, ConformanceSuite)
            and item.get_closest_marker(COMPILED_MARK) is not None)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Deselect the kit's compiled rows unless ``-m`` was given (on the command line or in ``addopts``):
    then the expression decides, as for any marker."""
    if config.getoption("markexpr", ""):
        return
    compiled = [item for item in items if _kit_compiled_row(item)]
    if compiled:
        config.hook.pytest_deselected(items=compiled)
        items[:] = [item for item in items if not _kit_compiled_row(item)]
        config.stash[_deselected()] = len(compiled)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: Any, config: Any) -> None:
    """Say how many compiled rows were left out, and how to run them."""
    left_out = config.stash.get(_deselected(), 0)
    if left_out:
        terminalreporter.write_line(
            f"gradseam.testing: {left_out} compiled-backend row(s) deselected; run them with -m compiled "
            "(or -m 'compiled or not compiled' for everything)"
        )


_KEYS: list[Any] = []


def _deselected() -> Any:
    """The stash key for the count of deselected rows (made on first use: the kit does not import pytest)."""
    if not _KEYS:
        import pytest

        _KEYS.append(pytest.StashKey[int]())
    return _KEYS[0]


def _use_as_pytest_plugin(config: Any) -> None:
    """Register this module with pytest, once, if nothing registered it yet (pytest then calls its
    ``pytest_configure`` at once)."""
    import sys

    manager = config.pluginmanager
    module = sys.modules[__name__]
    if not manager.is_registered(module) and manager.get_plugin(_PLUGIN_NAME) is None:
        manager.register(module, _PLUGIN_NAME)


# -- the pytest suite a plugin subclasses --------------------------------------------------------


@contextmanager
def _matrix_warnings() -> Iterator[None]:
    """The suite's rows without the warning a row of its own matrix gives by design (``-ffn`` x interval 2:
    the interval only selects blocks through a stride), so a plugin's green run reads with no warning."""
    import warnings

    from .errors import GradseamWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"gradient_checkpointing_interval=\d+ does not group FFN regions",
                                GradseamWarning)
        yield


_FAMILIES: dict[int, tuple[Case, Any]] = {}  # id(case) -> (the case, held so that its id is not reused; its family)


def _over(kind: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def mark(test: Callable[..., None]) -> Callable[..., None]:
        test.conformance_configs = kind  # type: ignore[attr-defined]
        return test

    return mark


class ConformanceSuite:
    """Subclass in a plugin's tests and set ``case``; pytest runs one test per configuration.

    Example::

        from gradseam.testing import Case, ConformanceSuite

        class TestMyFamily(ConformanceSuite):
            case = Case("mymodel", build=tiny_model, inputs=tiny_inputs)

    The configurations follow from the family the model resolves to (no ``-ffn`` backends without
    an FFN seam, no interval without a ``Carry``, no attention offload without an attention side).
    Override ``configs`` / ``offload`` with explicit lists to change them, set ``whole_regions =
    False`` if the case's inputs make chunks fall back on purpose, or ``atol`` to compare with a
    tolerance instead of bit for bit (never needed on the CPU so far).

    Nothing else to set up: collecting a suite registers this module as a pytest plugin, which declares
    the ``compiled`` marker of the compiled-backend rows and leaves those rows out unless ``-m`` selects
    them (``-m compiled``).
    """

    case: ClassVar[Case]
    configs: ClassVar[list[dict[str, Any]] | None] = None
    offload: ClassVar[list[dict[str, Any]] | None] = None
    whole_regions: ClassVar[bool] = True
    atol: ClassVar[float] = 0.0

    @classmethod
    def family(cls) -> Any:
        """The family the case's model resolves to (the model is built once per case to find it)."""
        key = id(cls.case)
        if key not in _FAMILIES:
            from .patcher import family_for

            torch.manual_seed(cls.case.seed)
            _FAMILIES[key] = (cls.case, family_for(cls.case.build()))
        return _FAMILIES[key][1]

    @classmethod
    def strategy_configs(cls) -> list[dict[str, Any]]:
        if cls.configs is not None:
            return cls.configs
        family = cls.family()
        return cpu_configs(ffn=family.has_ffn, interval=family.supports_interval)

    @classmethod
    def offload_configs(cls) -> list[dict[str, Any]]:
        if cls.offload is not None:
            return cls.offload
        family = cls.family()
        return offload_configs(ffn=family.has_ffn, interval=family.supports_interval, attention=family.has_attention)

    def pytest_generate_tests(self, metafunc: Any) -> None:
        _use_as_pytest_plugin(metafunc.config)  # the kit's marker, before any test is marked with it
        kind = getattr(metafunc.function, "conformance_configs", None)
        if kind is None or "config" not in metafunc.fixturenames:
            return
        import pytest

        configs = self.strategy_configs() if kind == "strategy" else self.offload_configs()
        params = [pytest.param(copy.deepcopy(c), marks=[pytest.mark.compiled] if _compiles(c) else [])
                  for c in configs]
        metafunc.parametrize("config", params, ids=[config_id(c) for c in configs])

    def test_declaration_matches_the_model(self) -> None:
        """The model resolves to an installed family, every block list the family declares for this model is
        found and every block is planned (a list path or block class that does not match the installed
        diffusers fails here by name), no FFN seam calls an attention kernel, and every kernel a block with an
        attention side calls runs inside that side (:func:`check_declared_sides`)."""
        from .planning import plan, resolve

        family = self.family()
        torch.manual_seed(self.case.seed)
        model = self.case.build()
        planned = plan(model, family, CheckpointConfig(gradient_checkpointing=True))
        for block_list in family.block_lists:
            blocks = resolve(model, block_list.path)
            if blocks is None:
                assert block_list.optional, f"{self.case.name}: block list {block_list.path!r} is missing"
                continue
            covered = {i for r in planned.regions if r.list_path == block_list.path for i in r.blocks}
            assert covered == set(range(len(blocks))), (
                f"{self.case.name}: blocks {sorted(set(range(len(blocks))) - covered)} of {block_list.path!r} "
                "are not planned"
            )
        assert planned.regions, f"{self.case.name}: the family plans no region for this model"
        check_declared_sides(self.case)

    @_over("strategy")
    def test_strategy(self, config: dict[str, Any]) -> None:
        """Exact outputs and gradients, less kept memory, an exact ``remove()``, regions that run whole."""
        with _matrix_warnings():
            check_strategy(self.case, config, atol=self.atol, whole=self.whole_regions)

    @_over("offload")
    def test_offload(self, config: dict[str, Any]) -> None:
        """The same through the offload engine (CPU stand-in: host buffers, same copies as on a GPU)."""
        from .offload import cpu_test_mode

        with cpu_test_mode(), _matrix_warnings():
            check_strategy(self.case, config, atol=self.atol, whole=self.whole_regions)

    def test_no_grad(self) -> None:
        """Sampling under ``torch.no_grad()`` is untouched by a patch."""
        check_no_grad(self.case)

    def test_refuses_what_it_cannot_do(self) -> None:
        """Options the family cannot run, or this machine cannot, are refused with the model left untouched:
        offload on a CPU model (outside the test mode) for every family, the ``-ffn`` backends without an
        FFN seam, attention offload without an attention side."""
        import gradseam

        from .errors import UnsupportedStrategyError

        family = self.family()
        refused: list[dict[str, Any]] = [{**ON, "gradient_checkpointing_backend": b.name}
                                         for b in CATALOG.values() if b.offload is not Offload.NOTHING]
        refused.append({OFFLOAD_ATTENTION: True})
        if not family.has_ffn:
            refused += [{**ON, "gradient_checkpointing_backend": b.name} for b in CATALOG.values()
                        if b.scope is Scope.FFN]
        for config in refused:
            torch.manual_seed(self.case.seed)
            model = self.case.build()
            before = {name: set(m.__dict__) for name, m in model.named_modules()}
            try:
                gradseam.patch(model, config)
            except UnsupportedStrategyError:
                assert gradseam.handle_of(model) is None
                assert {name: set(m.__dict__) for name, m in model.named_modules()} == before, (
                    f"{self.case.name}: refusing {config_id(config)} left the model changed"
                )
            else:
                raise AssertionError(f"{self.case.name}: {config_id(config)} was accepted, though it cannot run here")
