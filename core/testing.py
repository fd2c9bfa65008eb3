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
ran and whether it ran as one region.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from .config import CheckpointConfig

Inputs = dict[str, Any]


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


@dataclass
class Step:
    outputs: tuple[torch.Tensor, ...]
    input_grads: dict[str, torch.Tensor]
    param_grads: dict[str, torch.Tensor]
    saved_bytes: int


def _as_tuple(value: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


@contextmanager
def count_saved_bytes(params: set[int]) -> Iterator[list[int]]:
    """Bytes of distinct storages autograd keeps from forward to backward (parameters excluded).

    Around a non-reentrant checkpoint these hooks see only what the checkpoint keeps (its
    inputs), so the count is exactly what a strategy leaves in memory between the two passes.
    """
    seen: set[tuple[int, int]] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        # Linear layers save ``weight.t()``: a view that owns no memory beyond the parameter's.
        base = t._base
        if id(t) not in params and not isinstance(t, nn.Parameter) and not (base is not None and id(base) in params):
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen and storage.nbytes() > 0:
                seen.add(key)
                total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def run_step(model: nn.Module, case: Case, *, seed: int = 1) -> Step:
    """One forward + backward with ``sum(out.square().mean())`` as the loss; returns everything it touched."""
    model.zero_grad(set_to_none=True)
    inputs = case.inputs(torch.Generator().manual_seed(seed))
    params = {id(p) for p in model.parameters()}
    with count_saved_bytes(params) as saved:
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


@dataclass
class ParityReport:
    config: CheckpointConfig
    reference: Step
    patched: Step
    after_remove: Step

    @property
    def saved_ratio(self) -> float:
        return self.patched.saved_bytes / max(self.reference.saved_bytes, 1)


def check_strategy(case: Case, config: CheckpointConfig | dict[str, Any], *, atol: float = 0.0) -> ParityReport:
    """The core conformance check for one configuration.

    Patched and unpatched runs must agree exactly; the patch must keep fewer bytes between
    forward and backward whenever it checkpoints anything; ``remove()`` must restore the model
    (same results, and no instance attribute left behind on any module).
    """
    import gradseam

    cfg = CheckpointConfig.coerce(config)
    torch.manual_seed(case.seed)
    model = case.build()
    before_dicts = {name: set(m.__dict__) for name, m in model.named_modules()}
    keys_before = list(model.state_dict().keys())
    reference = run_step(model, case)
    handle = gradseam.patch(model, cfg)
    try:
        assert list(model.state_dict().keys()) == keys_before, "patching changed state_dict() keys"
        patched = run_step(model, case)
        engine = getattr(handle, "engine", None)
        if engine is not None and not getattr(engine, "min_bytes", 0):
            assert engine.copies > 0, f"{case.name} {cfg.describe()}: the offload strategy moved nothing"
        # a second step must be exact too (chains keep state between calls)
        assert_same_step(reference, run_step(model, case), atol=atol, what=f"{case.name} {cfg.describe()} step 2")
    finally:
        handle.remove()
    assert_same_step(reference, patched, atol=atol, what=f"{case.name} {cfg.describe()}")
    after = run_step(model, case)
    assert_same_step(reference, after, what=f"{case.name} after remove()")
    after_dicts = {name: set(m.__dict__) for name, m in model.named_modules()}
    assert after_dicts == before_dicts, "remove() left attributes behind on some module"
    if cfg.enabled:
        assert patched.saved_bytes < reference.saved_bytes, (
            f"{case.name} {cfg.describe()}: kept {patched.saved_bytes} bytes between forward and backward, "
            f"not fewer than unpatched ({reference.saved_bytes})"
        )
    return ParityReport(cfg, reference, patched, after)


def cpu_configs(*, ffn: bool = True, interval: bool = True, stride: bool = True) -> list[dict[str, Any]]:
    """The CPU matrix every adapter passes: backends x interval {1, 2} x stride {none, 4}."""
    backends = ["torch"] + (["torch-ffn"] if ffn else [])
    out = []
    for backend in backends:
        for n in [None, 2] if interval else [None]:
            for s in [None, 4] if stride else [None]:
                out.append(
                    {
                        "gradient_checkpointing": True,
                        "gradient_checkpointing_backend": backend,
                        "gradient_checkpointing_interval": n,
                        "gradient_checkpointing_segment_stride": s,
                    }
                )
    return out


def config_id(config: dict[str, Any]) -> str:
    cfg = CheckpointConfig.coerce(config)
    return cfg.describe().replace(", ", "+").replace(" ", "")


class ConformanceSuite:
    """Subclass in a plugin's tests and set ``case``; pytest then runs the whole matrix.

    Example::

        class TestMyFamily(ConformanceSuite):
            case = Case("mymodel", build=tiny_model, inputs=tiny_inputs)
    """

    case: Case
    configs: list[dict[str, Any]] = cpu_configs()

    def test_matrix(self) -> None:
        for config in self.configs:
            check_strategy(self.case, copy.deepcopy(config))
